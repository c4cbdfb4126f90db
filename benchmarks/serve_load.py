"""Load test of `optimize serve`: concurrent streaming clients, SLO goodput, overload, prefix caching.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/serve_load.py ARTIFACT [--clients 8] [--requests 48]
        [--duration 60] [--max-queue 32] [--max-num-seqs 8] [--ttft-slo 0.5] [--tpot-slo 0.05] [--check 12]
        [--burst 200] [--prefix-requests 24] [--prefix-tokens 200] [--json]
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/serve_load.py ARTIFACT --rates 0.25,0.5,1,2,4 [--rate-seconds 40]
        [--trace FILE.jsonl] [--plot goodput.png] [--ttft-slo 1] [--tpot-slo 0.1] [--json]

Starts the server as a subprocess on loopback and runs four phases:

1. Load: `--clients` asyncio + httpx clients stream completions until `--requests` are done or `--duration`
   seconds pass. Prompts are the first 8, 32 or 96 words of evaluation.txt paragraphs; max_tokens is 16, 64 or
   128; every other request is greedy, the others sample (temperature 0.8, seeded). Per request: TTFT (first
   chunk), TPOT ((last chunk - first chunk) / (tokens - 1)). Goodput: completed requests within both SLOs.
   Lost: a transport error, an error status other than 429, an error event, or a stream without [DONE].
2. Overload: `--burst` requests at once, far above --max-queue: some must get 429, none may fail otherwise, and
   the server must still answer /health and go back to no running request and no KV block in use.
3. Prefix cache: `--prefix-requests` prompts sharing a `--prefix-tokens` system prompt (token ids) with short
   suffixes: a first (cold) one, then the others one at a time, then all at once; TTFT with the cache on, then on
   a server restarted with --no-prefix-caching. TTFT twice: p50 at the HTTP client, and the server's own mean
   from /metrics (arrival in the scheduler to first token: no HTTP, JSON or client time in it).
4. Reference (servers stopped): `Engine.generate` on `--check` of the load phase's greedy requests, one at a
   time: each text must equal the server's (else it is counted corrupted), and its tokens/s is the naive
   baseline the server's throughput is compared with.

Server memory is its peak RSS (VmHWM of /proc/PID/status). `--json` prints one JSON object instead of tables.

Open loop (`--rates 0.25,0.5,1,2,4`): instead of the phases above, a goodput sweep. At each rate requests arrive
as a Poisson process (exponential gaps, seeded) for `--rate-seconds`, whatever the server's state, so the
offered load is a demand the server meets or not; each is one streaming request from the workload above or
from `--trace FILE` (JSON lines: {"prompt": text or token ids, "max_tokens": n}, cycled). Per rate: offered
rate, throughput (completed requests / s over the arrival window, or to the last completion if later), goodput (completed
within both SLOs / s), SLO attainment (those / sent), 429s, lost, and p50/p90/p99 of TTFT and TPOT; `--plot
FILE.png` draws goodput and throughput against offered load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kiln.optimizer.defaults import EVALUATION_TEXT
from kiln.runtime.server_metrics import scrape

PROMPT_WORDS = (8, 32, 96)
MAX_TOKENS = (16, 64, 128)


# --- the server process --------------------------------------------------------------------------------------
class ServerProcess:
    """`optimize serve ARTIFACT ARGS` on a free port, ready once /health answers. Its decode step is eager
    (`--compile off`) unless ARGS names a --compile mode: the default compiles in the background, and a switch
    to the compiled step in the middle of a measurement would mix two servers' figures."""

    def __init__(self, artifact: Path, args: list[str], log_dir: Path):
        if "--compile" not in args:
            args = [*args, "--compile", "off"]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"serve-{self.port}.log"
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "TOKENIZERS_PARALLELISM": "false"}
        with self.log.open("w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "kiln.optimizer.cli", "serve", str(artifact),
                                          "--port", str(self.port), *args], stdout=log, stderr=subprocess.STDOUT,
                                         env=env)
        start = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                sys.exit(f"the server exited {self.proc.returncode}:\n{self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() - start > 120:
                self.proc.kill()
                sys.exit(f"the server did not come up in 120 s:\n{self.log.read_text()[-2000:]}")
            time.sleep(0.2)
        self.startup_seconds = time.monotonic() - start

    def peak_rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def metrics(self) -> dict[str, float]:
        return scrape(httpx.get(f"{self.url}/metrics", timeout=10).text)

    def wait_idle(self, timeout: float = 30) -> dict[str, float]:
        end = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (m["kiln_num_requests_running"] + m["kiln_num_requests_waiting"] + m["kiln_kv_cache_usage_ratio"] == 0
                    or time.monotonic() > end):
                return m
            time.sleep(0.1)

    def stop(self) -> int:
        """SIGTERM (graceful drain); the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


# --- one streaming request ------------------------------------------------------------------------------------
@dataclass
class Result:
    status: int | None = None
    text: str = ""
    tokens: int = 0
    ttft: float | None = None
    tpot: float | None = None
    done: bool = False
    error: str | None = None

    @property
    def completed(self) -> bool:
        return self.status == 200 and self.done and self.error is None

    @property
    def lost(self) -> bool:
        return not self.completed and self.status != 429


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict) -> Result:
    result = Result()
    start = time.perf_counter()
    first = last = None
    try:
        async with client.stream("POST", f"{url}/v1/completions",
                                 json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            result.status = r.status_code
            if r.status_code != 200:
                await r.aread()
                result.error = r.text[:200]
                return result
            pieces = []
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    result.done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = event["error"]["message"]
                    break
                now = time.perf_counter()
                if event.get("choices"):
                    first = now if first is None else first
                    last = now
                    pieces.append(event["choices"][0]["text"])
                if event.get("usage"):
                    result.tokens = event["usage"]["completion_tokens"]
            result.text = "".join(pieces)
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    if first is not None:
        result.ttft = first - start
        if result.tokens > 1:
            result.tpot = (last - first) / (result.tokens - 1)
    return result


def _client(connections: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(300, connect=30),
                             limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections))


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


# --- phases ---------------------------------------------------------------------------------------------------
def workload(count: int, seed: int) -> list[dict]:
    paragraphs = [p.strip() for p in EVALUATION_TEXT.read_text().split("\n\n") if len(p.split()) >= 100]
    rng = random.Random(seed)
    out = []
    for i in range(count):
        words = rng.choice(paragraphs).split()[: rng.choice(PROMPT_WORDS)]
        greedy = i % 2 == 0
        out.append({"prompt": " ".join(words), "max_tokens": rng.choice(MAX_TOKENS),
                    "temperature": 0 if greedy else 0.8, **({} if greedy else {"seed": i})})
    return out


async def load_phase(url: str, requests: list[dict], clients: int, duration: float):
    pending = list(enumerate(requests))
    results: dict[int, Result] = {}
    deadline = time.monotonic() + duration
    async with _client(clients) as client:
        async def worker():
            while pending and time.monotonic() < deadline:
                index, body = pending.pop(0)
                results[index] = await stream_completion(client, url, body)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - start
    return results, wall


async def open_loop_phase(url: str, requests: list[dict], rate: float, seconds: float, seed: int):
    """Poisson arrivals at `rate` per second for `seconds`: each request starts at its arrival time whatever
    the others are doing (open loop). Returns the results in arrival order and the wall time: the arrival
    window, or to the last completion where that is later."""
    rng = random.Random(seed)
    arrivals, t = [], rng.expovariate(rate)
    while t < seconds:
        arrivals.append(t)
        t += rng.expovariate(rate)
    async with _client(max(1, len(arrivals))) as client:
        start = time.perf_counter()

        async def arrive(i: int, at: float) -> Result:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            return await stream_completion(client, url, requests[i % len(requests)])

        results = await asyncio.gather(*(arrive(i, at) for i, at in enumerate(arrivals)))
        wall = max(seconds, time.perf_counter() - start)  # the arrival window, or longer while the last drain
    return list(results), wall


def trace_requests(path: Path) -> list[dict]:
    """The requests of a trace file: one JSON object per line with "prompt" (text or token ids) and
    "max_tokens"; greedy unless it gives a temperature."""
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            out.append({"prompt": entry["prompt"], "max_tokens": int(entry["max_tokens"]),
                        "temperature": float(entry.get("temperature", 0))})
        except (ValueError, KeyError, TypeError) as exc:
            sys.exit(f"{path}:{n}: a trace line needs prompt and max_tokens ({type(exc).__name__}: {exc})")
    if not out:
        sys.exit(f"{path}: no requests")
    return out


def rate_row(rate: float, results: list[Result], wall: float, ttft_slo: float, tpot_slo: float) -> dict:
    done = [r for r in results if r.completed]
    good = [r for r in done if r.ttft is not None and r.ttft <= ttft_slo and (r.tpot is None or r.tpot <= tpot_slo)]
    ttfts = [r.ttft for r in done if r.ttft is not None]
    tpots = [r.tpot for r in done if r.tpot is not None]
    wall = max(wall, 1e-9)
    row = {"offered_rps": rate, "sent": len(results), "completed": len(done),
           "rejected_429": sum(r.status == 429 for r in results), "lost": sum(r.lost for r in results),
           "wall_s": wall, "throughput_rps": len(done) / wall, "goodput_rps": len(good) / wall,
           "slo_attainment": len(good) / max(1, len(results)),
           "tokens_per_s": sum(r.tokens for r in done) / wall}
    for name, values in (("ttft", ttfts), ("tpot", tpots)):
        for q in (50, 90, 99):
            row[f"{name}_p{q}_s"] = percentile(values, q)
    return row


def sweep(args, flags: list[str], logs: Path) -> None:
    """The open-loop goodput sweep (`--rates`): one server, the rates in order, idle between them."""
    requests = trace_requests(args.trace) if args.trace else workload(4096, args.seed)
    rates = [float(r) for r in args.rates.split(",")]
    if not rates or any(not r > 0 for r in rates):
        sys.exit(f"--rates must be positive numbers, got {args.rates!r}")
    server = ServerProcess(args.artifact, [*flags, "--ttft-slo", str(args.ttft_slo), "--tpot-slo",
                                           str(args.tpot_slo)], logs)
    rows = []
    for i, rate in enumerate(rates):
        results, wall = asyncio.run(open_loop_phase(server.url, requests, rate, args.rate_seconds, args.seed + i))
        rows.append(rate_row(rate, results, wall, args.ttft_slo, args.tpot_slo))
        server.wait_idle(timeout=120)
        print(f"rate {rate:g}/s: {rows[-1]['completed']}/{rows[-1]['sent']} completed, goodput "
              f"{rows[-1]['goodput_rps']:.2f}/s", file=sys.stderr, flush=True)
    metrics = server.metrics()
    server.stop()
    report = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "rates": rows,
              "server_slo": {k: v for k, v in metrics.items() if k.startswith("kiln_slo_") and k.endswith("_total")}}
    if args.plot:
        plot_sweep(rows, args.plot, args.ttft_slo, args.tpot_slo)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
        return
    print(f"\nopen-loop sweep: Poisson arrivals for {args.rate_seconds:g} s per rate; SLOs TTFT <= {args.ttft_slo:g} s, "
          f"TPOT <= {args.tpot_slo * 1000:g} ms; --max-num-seqs {args.max_num_seqs} --max-queue {args.max_queue}")
    print("| offered req/s | sent | completed | 429 | lost | throughput req/s | goodput req/s | SLO attainment | "
          "TTFT p50 / p90 / p99 ms | TPOT p50 / p90 / p99 ms | tokens/s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|")
    for r in rows:
        print(f"| {r['offered_rps']:g} | {r['sent']} | {r['completed']} | {r['rejected_429']} | {r['lost']} | "
              f"{r['throughput_rps']:.2f} | {r['goodput_rps']:.2f} | {r['slo_attainment']:.0%} | "
              f"{_ms(r['ttft_p50_s'])} / {_ms(r['ttft_p90_s'])} / {_ms(r['ttft_p99_s'])} | "
              f"{_ms(r['tpot_p50_s'])} / {_ms(r['tpot_p90_s'])} / {_ms(r['tpot_p99_s'])} | {r['tokens_per_s']:.0f} |")
    if report["server_slo"]:
        print(f"server /metrics SLO counters after the sweep: {report['server_slo']}")


def plot_sweep(rows: list[dict], path: Path, ttft_slo: float, tpot_slo: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    offered = [r["offered_rps"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(offered, offered, ":", color="grey", label="offered (ideal)")
    ax.plot(offered, [r["throughput_rps"] for r in rows], "o-", label="throughput")
    ax.plot(offered, [r["goodput_rps"] for r in rows], "s-", label=f"goodput (TTFT <= {ttft_slo:g} s, "
                                                                     f"TPOT <= {tpot_slo * 1000:g} ms)")
    ax.set_xlabel("offered load (requests / s, Poisson)")
    ax.set_ylabel("requests / s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


async def burst_phase(url: str, count: int):
    body = {"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0}
    async with _client(count) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(stream_completion(client, url, body) for _ in range(count)))
        wall = time.perf_counter() - start
    return results, wall


def _server_ttft(server: ServerProcess) -> tuple[float, float]:
    m = server.metrics()
    return m["kiln_time_to_first_token_seconds_sum"], m["kiln_time_to_first_token_seconds_count"]


def prefix_phase(server: ServerProcess, prompts: list[list[int]]) -> dict:
    """Client TTFTs of the prompts one at a time (the first, cold one apart), then all at once; the server's
    own mean TTFT (arrival in the scheduler to first token, from /metrics) over the same requests; the texts."""
    def body(prompt):
        return {"prompt": prompt, "max_tokens": 8, "temperature": 0}

    async def one_at_a_time(batch):
        async with _client(1) as client:
            return [await stream_completion(client, server.url, body(p)) for p in batch]

    async def all_at_once(batch):
        async with _client(len(batch)) as client:
            return await asyncio.gather(*(stream_completion(client, server.url, body(p)) for p in batch))

    out = {"cold": asyncio.run(one_at_a_time(prompts[:1]))[0]}
    for mode, run in (("sequential", one_at_a_time), ("concurrent", all_at_once)):
        before = _server_ttft(server)
        results = asyncio.run(run(prompts[1:]))
        after = _server_ttft(server)
        out[mode] = results
        out[f"{mode}_server_mean"] = (after[0] - before[0]) / max(1, after[1] - before[1])
    return out


def prefix_prompts(tokenizer, count: int, prefix_tokens: int) -> list[list[int]]:
    paragraphs = [p.strip() for p in EVALUATION_TEXT.read_text().split("\n\n") if p.strip()]
    system = tokenizer(" ".join(paragraphs[:20]))["input_ids"][:prefix_tokens]
    suffixes = [tokenizer(" " + " ".join(p.split()[:8]), add_special_tokens=False)["input_ids"][:12]
                for p in paragraphs[100: 100 + count]]
    return [system + s for s in suffixes]


# --- reporting ------------------------------------------------------------------------------------------------
def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def table(title: str, rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    vwidth = max(len(v) for _, v in rows)
    print(f"\n{title}")
    print(f"| {'':<{width}} | {'':>{vwidth}} |")
    print(f"|{'-' * (width + 2)}|{'-' * (vwidth + 2)}|")
    for k, v in rows:
        print(f"| {k:<{width}} | {v:>{vwidth}} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--clients", type=int, default=8, help="concurrent streaming clients (load phase)")
    parser.add_argument("--requests", type=int, default=48, help="requests in the load phase at most")
    parser.add_argument("--duration", type=float, default=60, help="seconds the load phase runs at most")
    parser.add_argument("--max-queue", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--ttft-slo", type=float, default=0.5, help="seconds")
    parser.add_argument("--tpot-slo", type=float, default=0.05, help="seconds per output token")
    parser.add_argument("--check", type=int, default=12, help="greedy responses checked against Engine.generate")
    parser.add_argument("--burst", type=int, default=200, help="requests fired at once in the overload phase")
    parser.add_argument("--prefix-requests", type=int, default=24)
    parser.add_argument("--prefix-tokens", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rates", help="open-loop sweep: Poisson arrival rates, requests/s, comma-separated")
    parser.add_argument("--rate-seconds", type=float, default=40, help="seconds of arrivals per rate")
    parser.add_argument("--trace", type=Path, help="open loop: JSON lines of {prompt, max_tokens} to send")
    parser.add_argument("--plot", type=Path, help="open loop: PNG of goodput and throughput against offered load")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if not (args.artifact / "manifest.json").is_file():
        sys.exit(f"{args.artifact}: not an artifact directory (build one with `optimize build`)")
    if args.rates:
        flags = ["--max-queue", str(args.max_queue), "--max-num-seqs", str(args.max_num_seqs),
                 "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        sweep(args, flags, Path(tempfile.mkdtemp(prefix="kiln-serve-load-")))
        return

    from kiln.runtime.engine import load_tokenizer

    tokenizer = load_tokenizer(args.artifact)
    flags = ["--max-queue", str(args.max_queue), "--max-num-seqs", str(args.max_num_seqs),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    report: dict = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    logs = Path(tempfile.mkdtemp(prefix="kiln-serve-load-"))

    # 1-3 on a server with prefix caching
    server = ServerProcess(args.artifact, flags, logs)
    requests = workload(args.requests, args.seed)
    results, wall = asyncio.run(load_phase(server.url, requests, args.clients, args.duration))
    done = [r for r in results.values() if r.completed]
    ttfts = [r.ttft for r in done if r.ttft is not None]
    tpots = [r.tpot for r in done if r.tpot is not None]
    good = [r for r in done if r.ttft is not None and r.ttft <= args.ttft_slo
            and (r.tpot is None or r.tpot <= args.tpot_slo)]
    tokens = sum(r.tokens for r in done)
    load = {"requests": len(results), "completed": len(done), "rejected_429": sum(r.status == 429 for r in
                                                                                  results.values()),
            "lost": sum(r.lost for r in results.values()), "wall_s": wall, "completion_tokens": tokens,
            "tokens_per_s": tokens / wall, "goodput_requests_per_s": len(good) / wall,
            "goodput_fraction": len(good) / max(1, len(results)),
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "tpot_p50_s": percentile(tpots, 50), "tpot_p99_s": percentile(tpots, 99),
            "errors": sorted({r.error for r in results.values() if r.error})[:5]}
    load["server_peak_rss_mb_after_load"] = server.peak_rss_mb()
    m = server.wait_idle()
    load["preemptions"] = m["kiln_preemptions_total"]

    burst, burst_wall = asyncio.run(burst_phase(server.url, args.burst))
    idle = server.wait_idle()
    health = httpx.get(f"{server.url}/health", timeout=10).status_code
    overload = {"sent": len(burst), "ok_200": sum(r.completed for r in burst),
                "rejected_429": sum(r.status == 429 for r in burst), "lost": sum(r.lost for r in burst),
                "wall_s": burst_wall, "health_after": health, "server_alive": server.proc.poll() is None,
                "running_after": idle["kiln_num_requests_running"], "kv_usage_after": idle["kiln_kv_cache_usage_ratio"],
                "server_peak_rss_mb": server.peak_rss_mb()}

    prompts = prefix_prompts(tokenizer, args.prefix_requests, args.prefix_tokens)
    cached = prefix_phase(server, prompts)
    hit_rate = server.metrics()["kiln_prefix_cache_hit_rate"]
    peak_rss = server.peak_rss_mb()
    exit_code = server.stop()

    off_server = ServerProcess(args.artifact, [*flags, "--no-prefix-caching"], logs)
    uncached = prefix_phase(off_server, prompts)
    off_exit = off_server.stop()

    prefix = {"prompt_tokens": len(prompts[0]), "shared_tokens": args.prefix_tokens,
              "cold_ttft_s": cached["cold"].ttft, "server_prefix_hit_rate": hit_rate,
              "same_texts_on_off": [r.text for r in cached["sequential"]] == [r.text for r in uncached["sequential"]]}
    for mode in ("sequential", "concurrent"):
        for name, phase in (("on", cached), ("off", uncached)):
            prefix[f"{mode}_ttft_p50_{name}_s"] = percentile([r.ttft for r in phase[mode] if r.ttft is not None], 50)
            prefix[f"{mode}_server_ttft_mean_{name}_s"] = phase[f"{mode}_server_mean"]
        for kind in ("ttft_p50", "server_ttft_mean"):
            on, off = prefix[f"{mode}_{kind}_on_s"], prefix[f"{mode}_{kind}_off_s"]
            prefix[f"{mode}_{kind}_speedup"] = off / on if on and off else None

    # 4: the naive baseline and the corruption check, with no server running
    from kiln import runtime

    engine = runtime.load(args.artifact)
    greedy = [(i, requests[i]) for i, r in results.items() if r.completed and requests[i]["temperature"] == 0]
    sample = random.Random(args.seed).sample(greedy, min(args.check, len(greedy)))
    corrupted, naive_tokens, naive_seconds = [], 0, 0.0
    for index, body in sample:
        start = time.perf_counter()
        generation = engine.generate(body["prompt"], body["max_tokens"], temperature=0)[0]
        naive_seconds += time.perf_counter() - start
        naive_tokens += len(generation.token_ids)
        if generation.text != results[index].text:
            corrupted.append(index)
    load.update({"checked": len(sample), "corrupted": len(corrupted), "naive_tokens_per_s": naive_tokens / naive_seconds
                 if naive_seconds else None})
    load["speedup_vs_naive"] = load["tokens_per_s"] / load["naive_tokens_per_s"] if load["naive_tokens_per_s"] else None
    shutil.rmtree(logs, ignore_errors=True)  # the servers' logs (kept when one fails to start: it is printed)
    report.update({"load": load, "overload": overload, "prefix_cache": prefix,
                   "server": {"peak_rss_mb": peak_rss, "startup_s": server.startup_seconds,
                              "sigterm_exit_code": exit_code, "no_prefix_server_exit_code": off_exit}})

    if args.json:
        print(json.dumps(report, indent=2, default=str))
        return
    table(f"load: {args.clients} streaming clients, {len(results)} requests (prompts of {PROMPT_WORDS} words, "
          f"max_tokens {MAX_TOKENS}, half greedy), --max-num-seqs {args.max_num_seqs} --max-queue {args.max_queue}", [
              ("requests / completed / 429 / lost",
               f"{load['requests']} / {load['completed']} / {load['rejected_429']} / {load['lost']}"),
              ("corrupted (greedy vs Engine.generate)", f"{load['corrupted']} of {load['checked']} checked"),
              (f"goodput (TTFT <= {args.ttft_slo:g} s, TPOT <= {args.tpot_slo * 1000:g} ms)",
               f"{load['goodput_requests_per_s']:.2f} req/s ({load['goodput_fraction']:.0%})"),
              ("TTFT p50 / p99 (ms)", f"{_ms(load['ttft_p50_s'])} / {_ms(load['ttft_p99_s'])}"),
              ("TPOT p50 / p99 (ms)", f"{_ms(load['tpot_p50_s'])} / {_ms(load['tpot_p99_s'])}"),
              ("throughput (completion tokens/s)", f"{load['tokens_per_s']:.0f}"),
              ("naive Engine.generate, one at a time", f"{load['naive_tokens_per_s']:.0f} tokens/s"),
              ("server vs naive", f"{load['speedup_vs_naive']:.2f}x"),
              ("preemptions", f"{load['preemptions']:.0f}"),
              ("server peak RSS", f"{peak_rss:.0f} MB"),
          ])
    table(f"overload: {args.burst} requests at once (--max-queue {args.max_queue})", [
        ("200 / 429 / lost", f"{overload['ok_200']} / {overload['rejected_429']} / {overload['lost']}"),
        ("wall", f"{burst_wall:.1f} s"),
        ("after: /health, running, KV usage",
         f"{health}, {overload['running_after']:.0f}, {overload['kv_usage_after']:.0%}"),
        ("server peak RSS", f"{overload['server_peak_rss_mb']:.0f} MB"),
        ("SIGTERM exit code", str(exit_code)),
    ])
    print(f"\nprefix cache: {args.prefix_requests} prompts = a shared {args.prefix_tokens}-token system prompt + "
          f"a {len(prompts[0]) - args.prefix_tokens}-token suffix, 8 tokens each; TTFT in ms (the first, cold "
          "request left out; client: p50 at the HTTP client; server: mean from arrival in the scheduler)")
    print(f"| {'requests':<22} | {'TTFT':<6} | {'cache on':>9} | {'cache off':>9} | {'off / on':>8} |")
    print(f"|{'-' * 24}|{'-' * 8}|{'-' * 11}|{'-' * 11}|{'-' * 10}|")
    for mode, label in (("sequential", "one at a time"), ("concurrent", f"{args.prefix_requests - 1} at once")):
        for kind, name in (("ttft_p50", "client"), ("server_ttft_mean", "server")):
            on, off, ratio = (prefix[f"{mode}_{kind}_on_s"], prefix[f"{mode}_{kind}_off_s"],
                              prefix[f"{mode}_{kind}_speedup"])
            print(f"| {label:<22} | {name:<6} | {_ms(on):>9} | {_ms(off):>9} | "
                  f"{'-' if ratio is None else f'{ratio:.2f}x':>8} |")
    print(f"cold first request (cache on): {_ms(prefix['cold_ttft_s'])} ms; server prefix hit rate "
          f"{hit_rate:.0%}; greedy texts identical with and without the cache: {prefix['same_texts_on_off']}")
    if load["errors"]:
        print(f"\nerrors seen: {load['errors']}")


if __name__ == "__main__":
    main()
