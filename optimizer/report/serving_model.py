"""Prefill/decode disaggregation, modelled (`optimize report --workload`): for a workload (arrival rate, prompt and
output lengths, TTFT and TPOT SLOs) and a GPU, the GPUs a co-located deployment with chunked prefill needs against
prefill and decode pools, each sized to meet its SLO; goodput per GPU, $/Mtok, and which wins.

One iteration (a forward over D decode rows, each holding c tokens of KV, and a prefill chunk of P tokens after o
cached tokens of its prompt) runs three kernels, each a roofline over the model's figures; their times add:

    GEMMs             max(weight bytes read for D + P tokens / HBM bandwidth, (D + P) x GEMM seconds per token)
    decode attention  D x max(KV bytes(c) / HBM bandwidth, decode attention FLOPs at c / BF16 peak)
    chunk attention   max(KV bytes(o) / HBM bandwidth, causal attention FLOPs of tokens o+1..o+P / BF16 peak)

(no per-iteration overhead on a GPU: not modelled). A decode-only iteration whose GEMMs are memory-bound is
roofline.decode_step's; a prefill-only one whose GEMMs are compute-bound is roofline.prefill_seconds'. One max over
the whole iteration would hide the decode rows' KV reads under the chunk's GEMMs, which separate kernels do not.

Co-located, chunked prefill (vLLM's and Kiln's scheduler): every iteration runs the decode rows, then the prompt at
the head of the queue fills the rest of a token budget (chunks of budget - D tokens; one prompt an iteration, its
chunks back to back, first come first served). Steady state of one replica at lambda requests/s:

    D      = lambda x (O - 1) x TPOT                 Little: rows decoding at a random instant
    TPOT   = 1 / (lambda k + (1 - lambda S') / iteration(1 + D, c, 0))     the mean time between a request's tokens
    TTFT   = lambda E[S^2] / (2 (1 - rho)) + R + S    M/G/1 wait of the prompt queue (Pollaczek-Khinchine), the
                                                      decode-only iteration in progress (R), the prompt's own chunks

k chunks a prompt; S = sum of its chunk iterations with D rows riding along, S' the same with 1 + D (a decoding
request sees itself and D others: Poisson arrivals see time averages); rho = lambda S; c = P + O/2, the mean
context of a decoding row. TTFT is a mean. TPOT: the SLO binds the slowest iteration a decoding request waits for,
a chunk iteration (Sarathi-Serve sizes its token budget so: a token behind a long chunk is late however short the
other gaps are); the mean is shown too. The replicas: the fewest at which the steady state exists, TTFT and TPOT
meet the SLOs and the running sequences' KV fits; the budget: the largest of BUDGETS that meets them (a chunk
iteration too slow for the TPOT SLO shrinks it).

Disaggregated: a prefill pool (each prompt alone, in chunks of the default budget: S; its KV over the link,
T = KV bytes(P) / link bandwidth, overlapping the next prompt's prefill; M/D/1 over max(S, T);
TTFT = wait + S + T) and a decode pool (decode-only iterations at the batch that carries lambda (O - 1) tokens a
second, TPOT the fixed point above with no chunks; the KV of its sequences must fit; its link receives
lambda x KV bytes(P) a second). Each pool has the fewest GPUs that meet its SLO.

Goodput per GPU = lambda / GPUs (in the steady state every request meets the SLOs); tokens/s per GPU = lambda x O /
GPUs (output tokens); $/Mtok = roofline.usd_per_mtok at that rate. The fewer GPUs win; a tie goes to co-located (no
KV transfer, one pool). The waterfall's "disaggregation" step takes the better deployment: factor = co-located
$/Mtok / the winner's, 1.00 when co-located wins (as a cost multiplier, at most 1.00: never worse than the baseline).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kiln.kernels.targets import Device
from kiln.optimizer.report.figures import ModelFigures
from kiln.optimizer.report.roofline import decode_step, gemm_seconds_per_token, prefill_attention_seconds
from kiln.optimizer.report.workload import MAX_RATE, Workload, duration

DEFAULT_BUDGET = 8192  # tokens an iteration runs (decode rows + prefill chunk) before shrinking
BUDGETS = (8192, 4096, 2048, 1024, 512, 256, 128)
MAX_GPUS = 1 << 20
FIXED_POINT_STEPS = 400

SERVING_ASSUMPTIONS = (
    ("an iteration is three kernels, each a roofline at peak bandwidth and dense FLOPs: GEMMs, decode attention, "
     "chunk attention; no per-iteration overhead (launch, scheduling, sampling)"),
    ("TTFT is a mean over requests in the steady state (Poisson arrivals, an M/G/1 prompt queue); the TPOT SLO binds "
     "the slowest iteration a decoding request waits for (a chunk iteration), the table gives the mean as well"),
    ("co-located: decode rows first, then one prompt's next chunk fills the token budget (chunks of several prompts "
     f"are not packed into one iteration); the budget is the largest of {', '.join(map(str, BUDGETS))} that meets "
     "both SLOs"),
    ("disaggregated: prefill in chunks of the default budget, one prompt at a time; the first token comes with the "
     "prefill; the KV is sent after it, overlapping the next prompt, and TTFT includes it"),
    "KV memory: every running sequence holds prompt + output tokens of KV (10% of HBM reserved, as economics)",
)
SERVING_NOT_MODELLED = (
    "tails: TTFT's p90/p99 (the mean is modelled) and the spread of TPOT across requests",
    "prefix caching, preemption, and the prompt and output length spread (each workload is one length)",
    "load balancing across replicas (every replica gets lambda / GPUs), and the network's own congestion",
)


# --- what an iteration costs ----------------------------------------------------------------------------------------
class IterationCost:
    """Seconds of one iteration: `decode_rows` rows at `context` tokens of KV each, and a prefill chunk of
    `prefill_tokens` after `prefill_offset` tokens of its prompt already cached. Rows may be a mean (fractional)."""

    def seconds(self, decode_rows: float, context: float, prefill_tokens: int = 0, prefill_offset: int = 0) -> float:
        raise NotImplementedError


class RooflineCost(IterationCost):
    """A GPU described by its datasheet: the per-phase roofline over a model's figures (figures.py)."""

    def __init__(self, figures: ModelFigures, device: Device, overhead_seconds: float = 0.0):
        self.figures, self.device, self.overhead_seconds = figures, device, overhead_seconds
        self.bandwidth = device.hbm_bytes_per_second
        self.gemm_per_token = gemm_seconds_per_token(figures, device)
        self._kv: dict[int, int] = {}
        self._attention: dict[int, float] = {}

    def kv_bytes(self, context: int) -> int:
        if context not in self._kv:
            self._kv[context] = self.figures.kv_bytes(context)
        return self._kv[context]

    def decode_attention_seconds(self, context: int) -> float:
        """Attention compute of one decode row at `context`: roofline's decode step less its GEMMs."""
        if context not in self._attention:
            self._attention[context] = (decode_step(self.figures, self.device, 1, context).compute_seconds
                                        - self.gemm_per_token)
        return self._attention[context]

    def seconds(self, decode_rows: float, context: float, prefill_tokens: int = 0, prefill_offset: int = 0) -> float:
        tokens = decode_rows + prefill_tokens
        if tokens <= 0:
            return 0.0
        context = round(context)
        gemm = max(self.figures.read_bytes(tokens) / self.bandwidth, tokens * self.gemm_per_token)
        decode = prefill = 0.0
        if decode_rows and context:
            decode = decode_rows * max(self.kv_bytes(context) / self.bandwidth,
                                       self.decode_attention_seconds(context))
        if prefill_tokens:
            prefill = max(self.kv_bytes(prefill_offset) / self.bandwidth,
                          prefill_attention_seconds(self.figures, self.device, prefill_tokens, prefill_offset))
        return self.overhead_seconds + gemm + decode + prefill


@dataclass(frozen=True)
class MeasuredCost(IterationCost):
    """A device described by measured rates (the CPU check): Kiln's scheduler runs the decode rows and the prompt
    chunk as two forwards, each a fixed cost plus a cost per row or token, the chunk's causal attention a cost per
    (query, key) pair; the decode rows' context is left out (short contexts)."""

    decode_fixed: float
    decode_per_row: float
    prefill_fixed: float
    prefill_per_token: float
    prefill_per_pair: float = 0.0  # x ((o + n)(o + n + 1) - o(o + 1)) for n tokens after o, as the roofline's

    def seconds(self, decode_rows: float, context: float, prefill_tokens: int = 0, prefill_offset: int = 0) -> float:
        # a mean below one row pays that share of the decode forward's fixed cost
        decode = min(decode_rows, 1.0) * self.decode_fixed + decode_rows * self.decode_per_row
        if not prefill_tokens:
            return decode
        n, o = prefill_offset + prefill_tokens, prefill_offset
        return (decode + self.prefill_fixed + prefill_tokens * self.prefill_per_token
                + self.prefill_per_pair * (n * (n + 1) - o * (o + 1)))


# --- co-located with chunked prefill ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class RequestClass:
    share: float  # of the requests
    prompt_tokens: int
    output_tokens: int


def chunks(prompt: int, chunk: int) -> list[tuple[int, int]]:
    """(tokens, offset) of each chunk of a `prompt`-token prompt under a `chunk`-token limit."""
    return [(min(chunk, prompt - o), o) for o in range(0, prompt, chunk)]


@dataclass(frozen=True)
class ColocatedState:
    """One replica's steady state at `rate` requests/s; `saturated` says why there is none (the rest is None)."""

    rate: float
    budget: int
    saturated: str | None = None
    tpot: float | None = None  # mean
    slowest: float | None = None  # the slowest iteration a decoding request waits for: its worst chunk iteration
    ttft: tuple[float, ...] = ()  # mean, per request class
    decode_rows: float | None = None  # mean rows decoding
    chunk: int | None = None  # prefill tokens an iteration carries at most
    prefill_share: float | None = None  # rho: of the time, iterations that carry a chunk
    wait: float | None = None  # mean M/G/1 wait of the prompt queue
    residual: float | None = None  # mean wait for the decode-only iteration in progress
    service: tuple[float, ...] = ()  # a prompt's prefill time, per class

    def ttft_mean(self, classes: Sequence[RequestClass]) -> float:
        return sum(c.share * t for c, t in zip(classes, self.ttft, strict=True))

    def ttft_quantile(self, classes: Sequence[RequestClass], q: float) -> float:
        """The q-quantile of TTFT over the request mix: a class's TTFT = residual + its prefill + the queue wait,
        which is 0 with probability 1 - rho and else exponential with mean wait / rho (the M/G/1 tail,
        approximated)."""
        rho = self.prefill_share

        def below(t: float) -> float:
            out = 0.0
            for c, s in zip(classes, self.service, strict=True):
                x = t - self.residual - s
                if x >= 0:
                    out += c.share * (1 - (rho * math.exp(-x * rho / self.wait) if self.wait > 0 else 0.0))
            return out

        low, high = 0.0, 20 * max(self.ttft) + 1
        for _ in range(100):
            mid = (low + high) / 2
            low, high = (mid, high) if below(mid) < q else (low, mid)
        return high

    def misses(self, w: Workload) -> list[str]:
        """What this state misses of `w`'s SLOs (TPOT: every iteration a decoding request waits for)."""
        if self.saturated:
            return [self.saturated]
        out = []
        if self.ttft[0] > w.ttft_slo:
            out.append(f"TTFT {duration(self.ttft[0])} > {duration(w.ttft_slo)}")
        if self.slowest > w.tpot_slo:
            out.append(f"a {self.chunk}-token chunk iteration takes {duration(self.slowest)} > TPOT "
                       f"{duration(w.tpot_slo)}")
        return out


def colocated_state(cost: IterationCost, rate: float, classes: Sequence[RequestClass], budget: int,
                    max_sequences: float) -> ColocatedState:
    """The steady state of one co-located replica (module docstring): the fixed point of TPOT, then TTFT.
    `max_sequences`: the running sequences it holds (the KV that fits on a GPU; max_num_seqs on Kiln's server)."""
    decode_steps = sum(c.share * (c.output_tokens - 1) for c in classes)  # decode iterations a request takes
    context = (sum(c.share * (c.output_tokens - 1) * (c.prompt_tokens + c.output_tokens / 2) for c in classes)
               / decode_steps if decode_steps else 0.0)
    tpot = cost.seconds(1, context)
    for _ in range(FIXED_POINT_STEPS):
        others = rate * decode_steps * tpot
        if others > max_sequences:
            return ColocatedState(rate, budget, f"the decode batch outgrows the {max_sequences:.0f} sequences a "
                                                "replica holds")
        chunk = math.floor(budget - others)
        if chunk < 1:
            return ColocatedState(rate, budget, f"{others:.0f} decode rows fill the {budget}-token budget")
        seen = 1 + others
        times = [[cost.seconds(seen, context, n, o) for n, o in chunks(c.prompt_tokens, chunk)] for c in classes]
        chunk_iterations = rate * sum(c.share * len(t) for c, t in zip(classes, times, strict=True))
        busy = rate * sum(c.share * sum(t) for c, t in zip(classes, times, strict=True))
        if busy >= 1:
            return ColocatedState(rate, budget, f"prefill iterations take {busy:.0%} of the time")
        decode_only = cost.seconds(seen, context)
        new = 1 / (chunk_iterations + (1 - busy) / decode_only) if decode_steps else 0.0
        settled = abs(new - tpot) <= 1e-9 * max(new, 1e-12)
        tpot = new
        if settled:
            break
    else:
        return ColocatedState(rate, budget, "TPOT does not settle (the decode batch grows without bound)")
    slowest = max(decode_only, *(max(t) for t in times))
    others = rate * decode_steps * tpot
    service = tuple(sum(cost.seconds(others, context, n, o) for n, o in chunks(c.prompt_tokens, chunk))
                    for c in classes)
    rho = rate * sum(c.share * s for c, s in zip(classes, service, strict=True))
    if rho >= 1:
        return ColocatedState(rate, budget, f"prefill iterations take {rho:.0%} of the time")
    if others + rho > max_sequences:
        return ColocatedState(rate, budget, f"KV of {others + rho:.0f} running sequences; {max_sequences:.0f} fit")
    wait = rate * sum(c.share * s * s for c, s in zip(classes, service, strict=True)) / (2 * (1 - rho))
    # arriving while no prompt is in service, a prompt waits out the decode-only iteration running, if any
    residual = (1 - rho) * (1 - math.exp(-others)) * cost.seconds(1 + others, context) / 2
    return ColocatedState(rate, budget, None, tpot, slowest, tuple(wait + residual + s for s in service), others,
                          chunk, rho, wait, residual, service)


# --- disaggregated ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PrefillState:
    rate: float  # per prefill GPU
    saturated: str | None = None
    ttft: float | None = None
    service: float | None = None  # the prompt's prefill
    transfer: float | None = None  # its KV over the link
    utilisation: float | None = None

    def misses(self, w: Workload) -> list[str]:
        if self.saturated:
            return [self.saturated]
        return [f"TTFT {duration(self.ttft)} > {duration(w.ttft_slo)}"] if self.ttft > w.ttft_slo else []


def prefill_state(cost: IterationCost, rate: float, prompt: int, kv_bytes: float, link: float) -> PrefillState:
    service = sum(cost.seconds(0, 0, n, o) for n, o in chunks(prompt, DEFAULT_BUDGET))
    transfer = kv_bytes / link
    busiest = max(service, transfer)  # the link sends one prompt's KV while the next prefills
    rho = rate * busiest
    if rho >= 1:
        what = "prefill" if service >= transfer else "the KV link"
        return PrefillState(rate, f"{what} busy {rho:.0%} of the time", service=service, transfer=transfer)
    wait = rate * busiest * busiest / (2 * (1 - rho))  # M/D/1
    return PrefillState(rate, None, wait + service + transfer, service, transfer, rho)


@dataclass(frozen=True)
class DecodeState:
    rate: float  # per decode GPU
    saturated: str | None = None
    tpot: float | None = None  # every iteration alike: mean = slowest
    decode_rows: float | None = None

    def misses(self, w: Workload) -> list[str]:
        if self.saturated:
            return [self.saturated]
        return [f"TPOT {duration(self.tpot)} > {duration(w.tpot_slo)}"] if self.tpot > w.tpot_slo else []


def decode_state(cost: IterationCost, rate: float, prompt: int, output: int, max_sequences: float,
                 kv_bytes: float, link: float) -> DecodeState:
    inbound = rate * kv_bytes / link
    if inbound >= 1:
        return DecodeState(rate, f"its link receives KV {inbound:.0%} of the time")
    context = prompt + output / 2
    tpot = cost.seconds(1, context)
    for _ in range(FIXED_POINT_STEPS):
        others = rate * (output - 1) * tpot
        if others > max_sequences:
            return DecodeState(rate, f"the decode batch outgrows the {max_sequences:.0f} sequences a GPU holds")
        new = cost.seconds(1 + others, context)
        if abs(new - tpot) <= 1e-9 * new:
            return DecodeState(rate, None, new, rate * (output - 1) * new)
        tpot = new
    return DecodeState(rate, "TPOT does not settle (the decode batch grows without bound)")


# --- sizing ----------------------------------------------------------------------------------------------------------
def fewest(meets: Callable[[int], bool], limit: int = MAX_GPUS) -> int | None:
    """The fewest GPUs n in [1, limit] with meets(n), assuming more GPUs never hurt; None if even `limit` fails."""
    high = 1
    while not meets(high):
        if high >= limit:
            return None
        high = min(2 * high, limit)
    low = high // 2  # fails (or 0)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if meets(mid) else (mid, high)
    return high


def most(meets: Callable[[float], bool], start: float) -> float:
    """The largest rate (requests/s, to 0.01%) one GPU carries with meets(rate); 0 if none does."""
    low, high = start, start
    if meets(start):
        while meets(high) and high < MAX_RATE:
            low, high = high, 2 * high
    else:
        while not meets(low):
            if low < 1e-9:
                return 0.0
            low, high = low / 2, low
    while high - low > 1e-4 * low:
        mid = (low + high) / 2
        low, high = (mid, high) if meets(mid) else (low, mid)
    return low


def _bound(gpus: int | None, state: Callable[[int], object], w: Workload, none: str) -> str:
    """What one GPU fewer misses (what binds the count), or `none` when no count meets the SLOs."""
    if gpus is None:
        return none
    if gpus == 1:
        return "a single GPU suffices"
    return f"with {gpus - 1} GPU{'s' if gpus > 2 else ''}, " + ", ".join(state(gpus - 1).misses(w))


@dataclass(frozen=True)
class Colocated:
    gpus: int | None
    state: ColocatedState | None  # at `gpus`, the largest budget that meets the SLOs
    default: ColocatedState | None  # at `gpus`, the default budget (the same state when it meets them)
    bound: str  # what one GPU fewer misses, or why no count meets the SLOs
    capacity: float  # the most requests/s one GPU carries within the SLOs (no rounding to whole GPUs)


def size_colocated(cost: IterationCost, w: Workload, max_sequences: float) -> Colocated:
    classes = (RequestClass(1.0, w.prompt_tokens, w.output_tokens),)

    def state(rate: float, budget: int) -> ColocatedState:
        return colocated_state(cost, rate, classes, budget, max_sequences)

    def best(rate: float) -> ColocatedState | None:
        return next((s for s in (state(rate, b) for b in BUDGETS) if not s.misses(w)), None)

    gpus = fewest(lambda n: best(w.rate / n) is not None)
    capacity = most(lambda r: best(r) is not None, w.rate / gpus) if gpus else 0.0
    if gpus is None:
        idle = [state(w.rate / MAX_GPUS, b) for b in (BUDGETS[0], BUDGETS[-1])]
        why = "; ".join(f"budget {s.budget}: {', '.join(s.misses(w))}" for s in idle)
        return Colocated(None, None, None, f"no GPU count meets the SLOs ({why})", capacity)
    chosen = best(w.rate / gpus)
    return Colocated(gpus, chosen, state(w.rate / gpus, DEFAULT_BUDGET),
                     _bound(gpus, lambda n: best(w.rate / n) or state(w.rate / n, chosen.budget), w, ""), capacity)


@dataclass(frozen=True)
class Disaggregated:
    prefill_gpus: int | None
    decode_gpus: int | None
    prefill: PrefillState | None
    decode: DecodeState | None
    prefill_bound: str
    decode_bound: str
    prefill_capacity: float  # the most requests/s one prefill GPU carries within TTFT
    decode_capacity: float  # the most requests/s one decode GPU carries within TPOT

    @property
    def capacity(self) -> float:
        """Requests/s per GPU of the two pools together (their GPUs per request/s add up)."""
        if not (self.prefill_capacity and self.decode_capacity):
            return 0.0
        return 1 / (1 / self.prefill_capacity + 1 / self.decode_capacity)

    @property
    def gpus(self) -> int | None:
        return None if self.prefill_gpus is None or self.decode_gpus is None else self.prefill_gpus + self.decode_gpus


def size_disaggregated(cost: IterationCost, w: Workload, max_sequences: float, kv_bytes: float, link: float,
                       prefill_fits: bool) -> Disaggregated:
    def prefill(n: int, rate: float | None = None) -> PrefillState:
        return prefill_state(cost, rate or w.rate / n, w.prompt_tokens, kv_bytes, link)

    def decode(n: int, rate: float | None = None) -> DecodeState:
        return decode_state(cost, rate or w.rate / n, w.prompt_tokens, w.output_tokens, max_sequences, kv_bytes, link)

    n_p = fewest(lambda n: not prefill(n).misses(w)) if prefill_fits else None
    n_d = fewest(lambda n: not decode(n).misses(w))
    p_capacity = most(lambda r: not prefill(1, r).misses(w), w.rate / n_p) if n_p else 0.0
    d_capacity = most(lambda r: not decode(1, r).misses(w), w.rate / n_d) if n_d else 0.0
    idle_p, idle_d = prefill(MAX_GPUS), decode(MAX_GPUS)
    p_none = ("a prompt's KV does not fit one GPU" if not prefill_fits else
              f"no GPU count meets TTFT: prefill {duration(idle_p.service)} + KV transfer "
              f"{duration(idle_p.transfer)} > {duration(w.ttft_slo)}")
    d_none = f"no GPU count meets TPOT: {', '.join(idle_d.misses(w))}"
    return Disaggregated(n_p, n_d, prefill(n_p) if n_p else None, decode(n_d) if n_d else None,
                         _bound(n_p, prefill, w, p_none), _bound(n_d, decode, w, d_none), p_capacity, d_capacity)
