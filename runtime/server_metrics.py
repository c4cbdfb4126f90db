"""The server's Prometheus metrics, in a registry of each server's own, and the /metrics text read back.

    metrics = ServerMetrics(ttft_slo=0.5, tpot_slo=0.05)
    metrics.observe_finished(request)      # a finished scheduler request: latencies, tokens, SLOs
    metrics.observe_state(scheduler)       # after each step: queue depths, KV usage, preemptions, drafts
    scrape(metrics.exposition().decode())  # {"kiln_num_requests_running": 0.0, ...}
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kiln.runtime.openai_api import OPENAI_FINISH


def kv_pool_line(cache) -> str:
    """The KV pool in a few words: blocks and bytes, and its groups where sliding-window layers keep only their
    window (a block id is then one group's share of the storage)."""
    line = f"{cache.num_blocks} KV blocks of {cache.block_size} tokens, {cache.nbytes / 2**20:.0f} MiB"
    if cache.windowed:
        windows = sorted({g.window for g in cache.groups if g.window is not None})
        line += (f" in {len(cache.groups)} groups of {len(cache.groups[0].layers)} layers (windows "
                 f"{', '.join(map(str, windows))} keep only theirs)")
    return line


class ServerMetrics:
    """Prometheus series in a registry of this server's own (two servers in a process never share one).

    With SLOs (`ttft_slo`, `tpot_slo` seconds) it also counts finished requests against them, what a Prometheus
    SLO rule divides: kiln_slo_requests_total (finished with a first token), kiln_slo_ttft_met_total,
    kiln_slo_tpot_met_total (a one-token request meets TPOT) and kiln_slo_met_total (both): attainment =
    met / requests, goodput = rate(kiln_slo_met_total)."""

    def __init__(self, ttft_slo: float | None = None, tpot_slo: float | None = None):
        r = self.registry = CollectorRegistry()
        self.ttft_slo, self.tpot_slo = ttft_slo, tpot_slo
        self.slo = None
        if ttft_slo is not None or tpot_slo is not None:
            self.slo = {name: Counter(f"kiln_slo_{name}", help_text, registry=r) for name, help_text in (
                ("requests", "Finished requests held to the SLOs (those with a first token)"),
                ("ttft_met", f"Of those, first token within {ttft_slo} s" if ttft_slo else "TTFT SLO unset: all"),
                ("tpot_met", f"Of those, time per output token within {tpot_slo} s" if tpot_slo
                 else "TPOT SLO unset: all"),
                ("met", "Of those, within both SLOs (goodput)"))}
        latency = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
        self.ttft = Histogram("kiln_time_to_first_token_seconds", "Arrival to first token", buckets=latency,
                              registry=r)
        self.tpot = Histogram("kiln_time_per_output_token_seconds", "Mean seconds per output token after the first",
                              buckets=latency[:-3], registry=r)
        self.e2e = Histogram("kiln_e2e_request_latency_seconds", "Arrival to the last token", buckets=latency,
                             registry=r)
        self.decode_compiled = Gauge("kiln_decode_compiled", "1 once decode steps run compiled (torch.compile), "
                                     "else 0", registry=r)
        self.waiting = Gauge("kiln_num_requests_waiting", "Requests in the wait queue", registry=r)
        self.running = Gauge("kiln_num_requests_running", "Requests in the running batch", registry=r)
        self.kv_usage = Gauge("kiln_kv_cache_usage_ratio", "KV blocks held by sequences / blocks in the pool",
                              registry=r)
        self.prefix_hit_rate = Gauge("kiln_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / "
                                     "prompt tokens looked up", registry=r)
        self.success = Counter("kiln_request_success", "Requests finished, by finish reason", ["finish_reason"],
                               registry=r)
        self.rejected = Counter("kiln_requests_rejected", "Requests answered 429 (wait queue full)", registry=r)
        self.aborted = Counter("kiln_requests_aborted", "Requests aborted, by cause", ["cause"], registry=r)
        self.prompt_tokens = Counter("kiln_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("kiln_generation_tokens", "Tokens generated", registry=r)
        self.preemptions = Counter("kiln_preemptions", "Requests preempted (blocks given back, recomputed later)",
                                   registry=r)
        self._preemptions_seen = 0
        # speculative decoding (vLLM's spec_decode counters): acceptance = accepted / draft tokens, tokens per
        # verification = emitted / verifications
        self.spec = {name: Counter(f"kiln_spec_decode_{name}", help_text, registry=r) for name, help_text in (
            ("num_verifications", "Verification forwards, per request row"),
            ("num_draft_tokens", "Draft tokens verified"),
            ("num_accepted_tokens", "Draft tokens accepted"),
            ("num_emitted_tokens", "Tokens emitted by verifications (accepted drafts and the target's own)"))}
        self._spec_seen = dict.fromkeys(self.spec, 0)
        self.spec_by_position = Counter("kiln_spec_decode_num_accepted_tokens_per_pos",
                                        "Verifications whose draft at this position (0 = the first, as vLLM) was accepted",
                                        ["position"], registry=r)
        self._by_position_seen: list[int] = []

    def observe_state(self, scheduler) -> None:
        stats = scheduler.stats()
        self.waiting.set(stats["waiting"])
        self.running.set(stats["running"])
        self.kv_usage.set(stats["kv_utilization"])
        self.prefix_hit_rate.set(stats["prefix_hit_rate"])
        if stats["preemptions"] > self._preemptions_seen:
            self.preemptions.inc(stats["preemptions"] - self._preemptions_seen)
            self._preemptions_seen = stats["preemptions"]
        for name, key in (("num_verifications", "spec_verifications"), ("num_draft_tokens", "spec_draft_tokens"),
                          ("num_accepted_tokens", "spec_accepted_tokens"), ("num_emitted_tokens", "spec_emitted_tokens")):
            if stats.get(key, 0) > self._spec_seen[name]:
                self.spec[name].inc(stats[key] - self._spec_seen[name])
                self._spec_seen[name] = stats[key]
        by_position = stats.get("spec_accepted_by_position", [])
        for j, count in enumerate(by_position):
            seen = self._by_position_seen[j] if j < len(self._by_position_seen) else 0
            if count > seen:
                self.spec_by_position.labels(str(j)).inc(count - seen)
        self._by_position_seen = list(by_position)  # cumulative, and only ever longer

    def observe_finished(self, request) -> None:
        self.prompt_tokens.inc(len(request.prompt_ids))
        if request.finish_reason not in OPENAI_FINISH:
            return
        self.success.labels(OPENAI_FINISH[request.finish_reason]).inc()
        if request.ttft is not None:
            self.ttft.observe(request.ttft)
        if request.tpot is not None:
            self.tpot.observe(request.tpot)
        if request.finished_at is not None:
            self.e2e.observe(request.finished_at - request.arrival)
        if self.slo is not None and request.ttft is not None:
            ttft_ok = self.ttft_slo is None or request.ttft <= self.ttft_slo
            tpot_ok = self.tpot_slo is None or request.tpot is None or request.tpot <= self.tpot_slo
            self.slo["requests"].inc()
            self.slo["ttft_met"].inc(ttft_ok)
            self.slo["tpot_met"].inc(tpot_ok)
            self.slo["met"].inc(ttft_ok and tpot_ok)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def scrape(exposition: str) -> dict[str, float]:
    """/metrics text as {sample name with its labels: value} (prometheus_client's parser), as a client reads it."""
    out = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sample.labels.items())
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out

