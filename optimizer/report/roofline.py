"""The decode roofline over a model's figures (figures.py) on one GPU, and what its tokens cost.

    step = decode_step(m, GPUS["h100"], batch=64, context=4096)    # max(memory, compute) seconds, tokens
    usd_per_mtok(3.40, step.tokens_per_second)
    gpu_figures(m, GPUS["h100"], 3.40, 4096)                        # the per-GPU row of the report
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kiln.kernels.errors import KilnError
from kiln.kernels.targets import B200, H100, H200, Device
from kiln.optimizer.report.figures import FP4, FP8, ModelFigures
from kiln.runtime.kv_budget import max_concurrent_sequences

USD_PER_MTOK = 10**6 / 3600  # 277.78: $/Mtok = USD_PER_MTOK x $/h / (tokens/s)
GPUS: dict[str, Device] = {"h100": H100, "h200": H200, "b200": B200}
CONCURRENCY_CONTEXTS = (4096, 32768)
PREFILL_TOKENS = 1000
DEFAULT_DRAFT_TOKENS = 3


# --- the roofline -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Speculation:
    tau: float  # mean tokens a verification step yields per sequence (accepted drafts + the bonus token)
    draft_tokens: int = DEFAULT_DRAFT_TOKENS  # k: the step verifies k + 1 tokens a sequence
    # measured (`load_speculation`): the smallest batch at which speculation was slower than plain decoding; a
    # server turns it off from there, so a step of that batch or more decodes plainly (None: it always paid)
    break_even: int | None = None
    source: str = ""  # where tau and the break-even were measured

    def __post_init__(self):
        if isinstance(self.draft_tokens, bool) or not isinstance(self.draft_tokens, int) or self.draft_tokens < 1:
            raise KilnError(f"draft tokens must be a positive integer, got {self.draft_tokens!r}")
        tau = self.tau
        if not (isinstance(tau, int | float) and math.isfinite(tau) and 1 <= tau <= self.draft_tokens + 1):
            raise KilnError(f"tau must lie between 1 and draft tokens + 1 = {self.draft_tokens + 1}, got {self.tau!r}")


def peak_flops(device: Device, precision: str) -> float:
    """Dense peak FLOPs of a GEMM precision; FP4 without FP4 tensor cores runs weight-only, in BF16."""
    if precision == FP8:
        return device.dense_fp8_flops
    if precision == FP4 and device.dense_fp4_flops > 0:
        return device.dense_fp4_flops
    return device.dense_bf16_flops


@dataclass(frozen=True)
class DecodeStep:
    memory_seconds: float
    compute_seconds: float
    tokens: float  # tokens the step yields

    @property
    def seconds(self) -> float:
        return max(self.memory_seconds, self.compute_seconds)

    @property
    def bound(self) -> str:
        return "memory" if self.memory_seconds >= self.compute_seconds else "compute"

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


def decode_step(m: ModelFigures, device: Device, batch: int, context: int,
                speculation: Speculation | None = None) -> DecodeStep:
    """One decode step of `batch` sequences of `context` cached tokens (a verification step with speculation,
    below its measured break-even batch)."""
    if speculation is not None and speculation.break_even is not None and batch >= speculation.break_even:
        speculation = None
    per_sequence = 1 + (speculation.draft_tokens if speculation else 0)
    tokens = batch * per_sequence
    memory = (m.read_bytes(tokens) + batch * m.kv_bytes(context)) / device.hbm_bytes_per_second
    per_token = gemm_seconds_per_token(m, device)
    per_token += context * m.attended(context) * m.attention_decode_flops / device.dense_bf16_flops
    return DecodeStep(memory, tokens * per_token, batch * (speculation.tau if speculation else 1))


def max_batch(m: ModelFigures, device: Device, context: int) -> int:
    return max_concurrent_sequences(device, m.resident_bytes, m.kv_bytes_per_token, context, m.kv_bytes(context))


def prefill_seconds(m: ModelFigures, device: Device, tokens: int = PREFILL_TOKENS) -> float:
    """FLOP-bound time of a `tokens`-token prompt: its GEMMs and its causal attention."""
    return gemm_seconds_per_token(m, device) * tokens + prefill_attention_seconds(m, device, tokens)


def gemm_seconds_per_token(m: ModelFigures, device: Device) -> float:
    """Compute time of one token through every GEMM it runs (active params, each at its precision's dense peak)."""
    return sum(2 * n / peak_flops(device, p) for p, n in m.active_params().items())


def prefill_attention_seconds(m: ModelFigures, device: Device, tokens: int, offset: int = 0) -> float:
    """Compute time of the causal attention of prompt tokens offset + 1 .. offset + tokens (a chunk after `offset`
    cached ones): c x (n(n + 1) - o(o + 1)) FLOPs, n = offset + tokens; the chunks of a prompt add up to its whole."""
    n = offset + tokens
    return m.attention_prefill_flops * (n * (n + 1) - offset * (offset + 1)) / device.dense_bf16_flops


def usd_per_mtok(price_per_hour: float, tokens_per_second: float) -> float:
    return USD_PER_MTOK * price_per_hour / tokens_per_second


def replica(device: Device, gpus: int) -> Device:
    """`gpus` GPUs serving one copy of the model, added up (communication not modelled)."""
    if gpus == 1:
        return device
    return replace(device, name=f"{gpus}x {device.name}", hbm_bytes=device.hbm_bytes * gpus,
                   hbm_bytes_per_second=device.hbm_bytes_per_second * gpus,
                   dense_bf16_flops=device.dense_bf16_flops * gpus, dense_fp8_flops=device.dense_fp8_flops * gpus,
                   dense_fp4_flops=device.dense_fp4_flops * gpus)


def gpu_figures(m: ModelFigures, device: Device, price_per_hour: float, context: int,
                speculation: Speculation | None = None) -> dict:
    """The per-GPU row: bytes, concurrency, decode at batch 1 and at the largest batch, prefill, $/Mtok."""
    biggest = max_batch(m, device, context)
    row = {"weight_bytes": m.resident_bytes, "kv_bytes_per_token": m.kv_bytes_per_token,
           "max_concurrency": {str(c): max_batch(m, device, c) for c in CONCURRENCY_CONTEXTS},
           "max_batch": biggest, "prefill_seconds_per_1k_tokens": prefill_seconds(m, device)}
    for suffix, batch in (("batch1", 1), ("max_batch", biggest)):
        step = decode_step(m, device, batch, context, speculation) if biggest >= 1 else None
        row[f"decode_tokens_per_s_{suffix}"] = step.tokens_per_second if step else None
        row[f"usd_per_mtok_{suffix}"] = usd_per_mtok(price_per_hour, step.tokens_per_second) if step else None
        row[f"bound_{suffix}"] = step.bound if step else None
    return row
