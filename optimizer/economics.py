"""The economics report (`optimize report`, report.md's "Economics"): what a decoded token costs on each GPU, and
what each pass bought, priced against the honest baseline.

    $/Mtok = 277.78 x ($ per GPU-hour) / (tokens per second per GPU)        (277.78 = 10^6 / 3600)

Decode is a roofline over plain figures (bytes and FLOPs, no tensors), so an artifact's manifest and a Hugging
Face config with no weights go through the same arithmetic. One decode step of B sequences, each holding C tokens
of KV cache, takes max(memory time, compute time):

    memory  = (weight bytes read per step + B x KV bytes per sequence of C tokens) / HBM bandwidth
    compute = B x sum over GEMM precisions p of (2 x active params at p / dense peak FLOPs at p)
              + B x sum over layers of attention FLOPs per cached token x min(C, its window) / dense BF16 peak

KV bytes per sequence sum each layer's bytes per token times the tokens it keeps: the whole context, or its
sliding window (Gemma 3: 5 of every 6 layers keep 512 or 1024), as vLLM and SGLang free the blocks leaving it.

and yields B tokens (B x tau with speculation: the verification step reads and computes k + 1 tokens a sequence).

- Weight bytes in HBM: everything the model stores, BF16 (2 bytes a value) for all that is not quantized; a
  quantized linear's packed values and scales (FP8: 1 byte + an fp32 scale per output channel; NVFP4: half a
  byte + an E4M3 scale per 16 + an fp32 global scale; MXFP4: half a byte + an E8M0 scale per 32;
  MXFP6: three quarters of a byte + an E8M0 scale per 32).
- Weight bytes read per step: every linear of the decoder stack, the LM head and the norms; not the embedding
  table (one row a token) nor extra modules (MTP layers, draft heads: resident only). Of a MoE layer's routed
  experts, the fraction T tokens touch under uniform, independent routing: 1 - (1 - top_k / E)^T (top_k of E at
  batch 1, nearly all of them at large batches).
- GEMMs compute in the precision of their activations: weight-only formats dequantize to BF16; W8A8 FP8 runs on
  FP8 tensor cores; W4A4 FP4 on FP4 tensor cores where the GPU has them (Blackwell), weight-only on Hopper.
- Attention, in BF16 over the whole context: GQA/MHA 2 x heads x (head_dim + v_head_dim) FLOPs per cached token;
  MLA decodes absorbed over its latent, 2 x heads x (2 x kv_lora_rank + rope dim).
- The largest batch: `runtime.kv_budget.max_concurrent_sequences` at the decode context (10% of HBM reserved).
- Prefill of 1000 tokens, FLOP-bound: 2 x active params x 1000 + causal attention, heads x (qk dim + v dim) x
  n(n + 1) per layer.

The waterfall prices each pass on the same GPU at production concurrency (each step's own largest batch at the
decode context), in pipeline order: the source as served (BF16 weights and GEMMs, a paged BF16 KV cache of the
source's own GQA/MHA attention, no speculation; full attention on every layer) -> sliding windows (the source's
own, against full attention: applied only to a model that has them) -> MLA (against that paged GQA cache) -> weights FP8 (against
BF16) -> weights FP4 (and FP6: against FP8 on the same silicon) -> KV quantization (against a BF16 cache) -> speculation
(against none, at the max batch, where verifying k + 1 tokens a sequence can make the step compute-bound). Each
factor is the ratio of $/Mtok before and after its step; the factors multiply to the total. MLA comes first (the
issue lists it last) because it rewrites the linears the later steps quantize: the weight steps then price the
artifact's own linears and formats, with nothing guessed for linears the source had and the artifact has not.

With a workload (`--workload`), a serving section sizes co-located serving with chunked prefill against prefill and
decode pools on each GPU (serving_model), and the waterfall ends with its "disaggregation" step.
"""

from __future__ import annotations

import io
import json
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from kiln.kernels.errors import KilnError, clip
from kiln.kernels.formats import ActivationFormat, KvFormat, WeightFormat
from kiln.kernels.registry import WEIGHT_FORMATS
from kiln.kernels.targets import B200, H100, H200, Device
from kiln.runtime.kv_budget import ACTIVATION_RESERVE_FRACTION, max_concurrent_sequences
from kiln.runtime.kv_format import kv_bytes_per_token, kv_sequence_bytes
from kiln.runtime.spec import LinearSpec, ModelSpec

USD_PER_MTOK = 10**6 / 3600  # 277.78: $/Mtok = USD_PER_MTOK x $/h / (tokens/s)
GPUS: dict[str, Device] = {"h100": H100, "h200": H200, "b200": B200}
DEFAULT_PRICES: dict[str, float] = {"h100": 3.40, "h200": 3.80, "b200": 5.50}
PRICE_NOTE = ("Prices are neocloud on-demand $ per GPU-hour. Defaults: H100 $3.40, the middle of the seeds' "
              "$2.89-3.90/h; H200 $3.80 and B200 $5.50 are this report's own assumptions (the seeds quote H100 only). "
              "--price-per-hour overrides them.")
DEFAULT_CONTEXT = 4096
CONCURRENCY_CONTEXTS = (4096, 32768)
PREFILL_TOKENS = 1000
DEFAULT_DRAFT_TOKENS = 3
BF16, FP8, FP4 = "bf16", "fp8", "fp4"  # the precision a GEMM computes in
FP4_FORMATS = (WeightFormat.NVFP4, WeightFormat.MXFP4)
# what the "weights FP4" step prices against FP8 on the same linears: the formats below 8 bits a weight
BELOW_FP8_FORMATS = (*FP4_FORMATS, WeightFormat.MXFP6)
CONFIG_WEIGHTS = ("bf16", "fp8", "nvfp4")
CONFIG_KV = {"bf16": None, "fp8": {"format": KvFormat.FP8_E4M3, "scaling": "per_tensor"},
             "nvfp4": {"format": KvFormat.NVFP4, "scaling": "e4m3_block16"}}
WATERFALL_PNG = "economics_waterfall.png"

NOT_MODELLED = (
    ("routing: which replica or model a request goes to, and MoE load imbalance (experts are taken as evenly "
     "loaded)"),
    "caching at the API layer: prompt and prefix caches, cached-token discounts",
    ("utilisation: a GPU is priced as busy 100% of the hour at the modelled batch; real fleets idle, and prefill "
     "takes a share of the time (the $/Mtok is decode only)"),
    "kernel efficiency: the roofline runs at peak bandwidth and peak dense FLOPs; real kernels reach less",
    "communication between GPUs (--gpus-per-replica adds up HBM, bandwidth and FLOPs as if free)",
)
ASSUMPTIONS = (
    "every sequence holds the decode context's worth of KV cache (conservative: real sequences grow into it)",
    "MoE: uniform, independent routing; T tokens of a step read 1 - (1 - top_k/E)^T of a layer's routed experts",
    "weights read per step: the decoder stack, LM head and norms, not the embedding table nor extra modules",
    ("GEMMs compute in their activations' precision (weight-only: BF16; FP4 W4A4 weight-only where there are no FP4 "
     "tensor cores); attention in BF16 over each layer's cached tokens (the context, or its sliding window)"),
    "prefill: FLOP-bound (the weights read once are not added; a short prompt on a large MoE can be memory-bound)",
    "speculation: the draft's own forward passes are not priced; tau = mean tokens a verification step yields",
)


# --- plain figures ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LinearCost:
    params: int  # weights (+ bias), whatever their format
    bytes: int  # as deployed
    compute: str  # BF16, FP8 or FP4: the precision its GEMM asks for


def linear_cost(lin: LinearSpec, fmt: str = WeightFormat.DENSE, activation: str = ActivationFormat.NONE,
                in_features: int | None = None) -> LinearCost:
    """A linear's bytes as a deployment stores them and its GEMM precision. `in_features`: the padded input
    width a packed FP4 weight records (default: the linear's own, padded to the format's block)."""
    out = lin.out_features
    bias = out if lin.bias else 0
    params = lin.in_features * out + bias
    if fmt not in WEIGHT_FORMATS:
        raise KilnError(f"economics: unknown weight format {fmt!r}; known: {', '.join(WEIGHT_FORMATS)}")
    nbytes = WEIGHT_FORMATS[fmt].stored_bytes(out, lin.in_features, in_features) + 2 * bias
    if activation == ActivationFormat.NONE:
        compute = BF16
    elif str(activation).startswith("fp8"):
        compute = FP8
    elif activation in (ActivationFormat.NVFP4, ActivationFormat.MXFP4):
        compute = FP4
    else:
        raise KilnError(f"economics: unknown activation format {activation!r}; known: {', '.join(ActivationFormat)}")
    return LinearCost(params, nbytes, compute)


@dataclass(frozen=True)
class RoutedExperts:
    """One MoE layer's routed experts."""

    experts: int
    top_k: int
    bytes: int  # all of them
    params: Mapping[str, int]  # all of them, by GEMM precision

    def read_fraction(self, tokens: float) -> float:
        """The expected share of experts `tokens` tokens touch (uniform, independent routing)."""
        return 1.0 - (1.0 - self.top_k / self.experts) ** tokens


@dataclass(frozen=True)
class ModelFigures:
    """What a served model costs a decode step, in bytes and FLOPs."""

    resident_bytes: int  # weights in HBM
    dense_read_bytes: int  # weights every step reads, whatever the batch (all but routed experts and the embedding)
    routed: tuple[RoutedExperts, ...]
    dense_params: Mapping[str, int]  # params every token runs (all but routed experts), by GEMM precision
    kv_layers: tuple[tuple[int, int | None], ...]  # per layer: (KV bytes per token, sliding window or None)
    attention_decode_flops: int  # per token, per cached token, all layers
    attention_prefill_flops: int  # c: a causal prefill of n tokens costs c x n(n + 1)
    attention_layers: tuple[tuple[int, int | None], ...] = ()  # per layer: (decode FLOPs per cached token, window)

    @property
    def kv_bytes_per_token(self) -> int:
        return sum(n for n, _ in self.kv_layers)

    def kv_bytes(self, context: int) -> int:
        """KV bytes one sequence of `context` tokens holds: a sliding-window layer keeps its window."""
        return kv_sequence_bytes(dict(enumerate(n for n, _ in self.kv_layers)),
                                 dict(enumerate(w for _, w in self.kv_layers)), context)

    def attended(self, context: int) -> float:
        """Cached tokens a decode step attends, as a fraction of `context` weighted by the layers' attention
        FLOPs (1 without sliding windows)."""
        total = sum(f for f, _ in self.attention_layers)
        if not total:
            return 1.0
        return sum(f * min(context, w or context) for f, w in self.attention_layers) / (total * context)

    def active_params(self) -> dict[str, float]:
        """Params one token runs, by GEMM precision: the dense ones plus top_k of each layer's routed experts."""
        out = Counter({p: float(n) for p, n in self.dense_params.items()})
        for layer in self.routed:
            for p, n in layer.params.items():
                out[p] += n * layer.top_k / layer.experts
        return dict(out)

    def read_bytes(self, tokens: float) -> float:
        """Weight bytes a step of `tokens` tokens reads."""
        return self.dense_read_bytes + sum(layer.bytes * layer.read_fraction(tokens) for layer in self.routed)


def attention_flops(spec: ModelSpec) -> tuple[int, int]:
    """(decode FLOPs per token per cached token, prefill coefficient c of n(n + 1)), summed over the layers."""
    return sum(layer_decode_flops(layer) for layer in spec.layers), sum(
        layer.attention.num_heads * (layer.attention.head_dim + layer.attention.v_head_dim) for layer in spec.layers)


def layer_decode_flops(layer) -> int:
    """A layer's decode attention FLOPs per token per cached token."""
    a = layer.attention
    if a.kind == "mla":  # absorbed decode: scores over latent + rope, values over the latent
        return 2 * a.num_heads * (2 * a.kv_lora_rank + a.qk_rope_head_dim)
    return 2 * a.num_heads * (a.head_dim + a.v_head_dim)


def spec_figures(spec: ModelSpec, cost: Callable[[LinearSpec], LinearCost], kv_bytes: Mapping[int, int],
                 lm_head_tied: bool, windows: bool = True, table: LinearCost | None = None) -> ModelFigures:
    """A spec's figures, each linear priced by `cost`, its KV cache by `kv_bytes` (per layer, bytes per token);
    norms BF16, the embedding BF16 unless `table` prices it (stored quantized: passes/embedding_quant.py).
    `lm_head_tied`: the LM head reads the embedding, which is stored once (a quantized table: the head reads it in
    its format). `windows` False: every layer attends (and caches) the whole context, the sliding-window step's
    baseline."""
    norms = 2 * sum(spec.norms().values())
    resident = (2 * spec.vocab_size * spec.hidden_size if table is None else table.bytes) + norms
    read = norms
    dense = Counter()
    routed = []
    for layer in spec.layers:
        for lin in (*layer.attention.linears.values(), *layer.mlp.linears.values()):
            c = cost(lin)
            resident, read = resident + c.bytes, read + c.bytes
            dense[c.compute] += c.params
        if layer.mlp.experts:
            nbytes, params = 0, Counter()
            for expert in layer.mlp.experts:
                for lin in expert.values():
                    c = cost(lin)
                    nbytes += c.bytes
                    params[c.compute] += c.params
            resident += nbytes
            routed.append(RoutedExperts(len(layer.mlp.experts), layer.mlp.top_k, nbytes, dict(params)))
    head = table if lm_head_tied and table is not None else cost(spec.lm_head)
    read += head.bytes
    dense[head.compute] += head.params
    if not (lm_head_tied and (table is not None or head.bytes == 2 * head.params)):
        resident += head.bytes
    resident += sum(cost(lin).bytes for lin in spec.extra_linears())
    decode, prefill = attention_flops(spec)
    window = {layer.index: layer.attention.sliding_window if windows else None for layer in spec.layers}
    kv_layers = tuple((kv_bytes[layer.index], window[layer.index]) for layer in spec.layers)
    attention = tuple((layer_decode_flops(layer), window[layer.index]) for layer in spec.layers)
    return ModelFigures(resident, read, tuple(routed), dict(dense), kv_layers, decode, prefill, attention)


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


# --- the waterfall --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Step:
    """One step of the waterfall: the served model after it, or None where it does not apply (`note` says why)."""

    name: str
    label: str
    against: str
    figures: ModelFigures | None
    speculation: Speculation | None = None
    note: str = ""


def price_steps(steps: Sequence[Step], device: Device, price_per_hour: float, context: int) -> list[dict]:
    """Each step at its own largest batch on `device`; factor = $/Mtok before / after (1 where not applied)."""
    rows, current, before = [], None, None
    for step in steps:
        applied = step.figures is not None
        if applied:
            current = (step.figures, step.speculation)
        figures, speculation = current
        batch = max_batch(figures, device, context)
        cost = tps = None
        if batch >= 1:
            tps = decode_step(figures, device, batch, context, speculation).tokens_per_second
            cost = usd_per_mtok(price_per_hour, tps)
        factor = None  # the source's row, or a step whose cost or baseline does not fit
        if rows and not applied:
            factor = 1.0
        elif rows and before is not None and cost is not None:
            factor = before / cost
        rows.append({"step": step.name, "label": step.label, "against": step.against, "applied": applied,
                     "note": step.note, "batch": batch, "tokens_per_s": tps, "usd_per_mtok": cost, "factor": factor})
        before = cost
    return rows


def _format_of(formats: Mapping[str, Mapping], lin: LinearSpec) -> Mapping:
    return formats.get(lin.name) or {"format": WeightFormat.DENSE, "activation": ActivationFormat.NONE}


def _cost(formats: Mapping[str, Mapping], fp4_as_fp8: bool) -> Callable[[LinearSpec], LinearCost]:
    def cost(lin: LinearSpec) -> LinearCost:
        e = _format_of(formats, lin)
        if fp4_as_fp8 and e["format"] in BELOW_FP8_FORMATS:  # the FP8 baseline: same linears, same activation choice
            act = (ActivationFormat.NONE if e.get("activation", "none") == "none"
                   else ActivationFormat.FP8_DYNAMIC_PER_TOKEN)
            return linear_cost(lin, WeightFormat.FP8_E4M3, act)
        return linear_cost(lin, e["format"], e.get("activation", ActivationFormat.NONE), e.get("in_features"))
    return cost


def _format_summary(formats: Mapping[str, Mapping], fmts: Sequence[str]) -> str:
    counts = Counter((e["format"], e.get("activation", "none")) for e in formats.values() if e["format"] in fmts)
    return ", ".join(f"{n} linears {fmt}" + ("" if act == "none" else f" with {act} activations")
                     for (fmt, act), n in sorted(counts.items()))


@dataclass(frozen=True)
class Scenario:
    """What a report prices: the steps from the source as served to the model as served (the last applied)."""

    name: str
    kind: str  # "artifact" or "config"
    model_type: str
    steps: tuple[Step, ...]
    kv_layers: tuple[dict, ...] = ()  # per layer: KV bytes/token of the source and of the served model
    notes: tuple[str, ...] = field(default=())

    @property
    def served(self) -> Step:
        return [s for s in self.steps if s.figures is not None][-1]


def scenario(name: str, kind: str, spec: ModelSpec, source_spec: ModelSpec, formats: Mapping[str, Mapping],
             kv_table: Mapping | None, lm_head_tied: bool, speculation: Speculation | None,
             notes: Sequence[str] = ()) -> Scenario:
    """The waterfall of a model: `spec` and its per-linear `formats` and KV table, from `source_spec`."""
    bf16 = _cost({}, False)
    kv_source = kv_bytes_per_token(source_spec, None)
    kv_bf16 = kv_bytes_per_token(spec, None)
    kv_served = kv_bytes_per_token(spec, kv_table)
    windowed = any(layer.attention.sliding_window for layer in source_spec.layers)
    window_sizes = sorted({layer.attention.sliding_window for layer in source_spec.layers} - {None})
    local = sum(1 for layer in source_spec.layers if layer.attention.sliding_window)
    table_entry = formats.get(spec.embedding.removesuffix(".weight"))
    if not table_entry or table_entry.get("role") != "embedding" or table_entry["format"] == WeightFormat.DENSE:
        table_entry = None

    def table(fp4_as_fp8: bool) -> LinearCost | None:
        """The embedding table stored quantized, priced like a weight-only linear of its shape (the LM head's)."""
        if table_entry is None:
            return None
        if fp4_as_fp8 and table_entry["format"] in BELOW_FP8_FORMATS:
            return linear_cost(spec.lm_head, WeightFormat.FP8_E4M3, ActivationFormat.NONE)
        return linear_cost(spec.lm_head, table_entry["format"], ActivationFormat.NONE, table_entry.get("in_features"))

    table_note = ("" if table_entry is None else f"; the embedding table {table_entry['format']}"
                  + (" (the tied LM head reads it)" if lm_head_tied else ""))
    quantized = {k: e for k, e in formats.items() if e["format"] != WeightFormat.DENSE and e.get("role") != "embedding"}
    fp4 = {k: e for k, e in quantized.items() if e["format"] in BELOW_FP8_FORMATS}
    # the weight steps apply when only the table is quantized, too
    weights_step = bool(quantized) or table_entry is not None
    fp4_step = bool(fp4) or (table_entry is not None and table_entry["format"] in BELOW_FP8_FORMATS)
    restructured = [a.attention.kind for a in source_spec.layers] != [b.attention.kind for b in spec.layers]
    served = _cost(formats, False)
    kinds = sorted({layer.attention.kind.upper() for layer in source_spec.layers})
    steps = [
        Step("source", "source as served" + (", full attention" if windowed else ""), "",
             spec_figures(source_spec, bf16, kv_source, lm_head_tied, windows=False),
             note=(f"BF16 weights and GEMMs, paged BF16 KV cache of its own {'/'.join(kinds)} attention, "
                   "no speculation" + ("; every layer attends and caches the whole context (the sliding-window "
                                       "step's baseline)" if windowed else ""))),
        Step("window", "sliding-window attention", "full attention on every layer",
             spec_figures(source_spec, bf16, kv_source, lm_head_tied) if windowed else None,
             note=(f"{local} of {len(source_spec.layers)} layers keep only their last "
                   f"{'/'.join(map(str, window_sizes))} tokens (the serving engine frees the blocks leaving the "
                   "window, as vLLM does)" if windowed else "not applied: every layer attends the whole context")),
        Step("mla", "MLA (KV structure)", "the paged GQA source (BF16)",
             spec_figures(spec, bf16, kv_bf16, lm_head_tied) if restructured else None,
             note=(f"KV bytes/token {sum(kv_source.values())} -> {sum(kv_bf16.values())} (BF16); per layer in the MLA "
                   "table" if restructured else
                   "not applied: no MLA conversion" + (" (the source's own attention is MLA)"
                                                       if "MLA" in kinds else ""))),
        Step("fp8", "weights FP8", "BF16 weights",
             spec_figures(spec, _cost(formats, True), kv_bf16, lm_head_tied, table=table(True)) if weights_step
             else None,
             note=(("FP8 in place of the FP4/FP6 linears (the FP4 step's baseline); " if fp4_step else "")
                   + (_format_summary(quantized, (WeightFormat.FP8_E4M3,)) or "no FP8 linears of its own")
                   + table_note if weights_step else "not applied: every linear BF16")),
        Step("fp4", "weights FP4/FP6" if any(e["format"] == WeightFormat.MXFP6 for e in fp4.values())
             else "weights FP4", "FP8 on the same GPU",
             spec_figures(spec, served, kv_bf16, lm_head_tied, table=table(False)) if fp4_step else None,
             note=(_format_summary(fp4, BELOW_FP8_FORMATS) or "no FP4 linears of its own") + table_note if fp4_step
             else "not applied: no FP4 weights"),
        Step("kv", "KV-cache quantization", "a BF16 KV cache",
             spec_figures(spec, served, kv_served, lm_head_tied, table=table(False)) if kv_served != kv_bf16 else None,
             note=(f"KV bytes/token {sum(kv_bf16.values())} -> {sum(kv_served.values())}" if kv_served != kv_bf16
                   else "not applied: BF16 KV cache")),
    ]
    final = spec_figures(spec, served, kv_served, lm_head_tied, table=table(False))
    steps.append(Step("speculation", "speculation", "no speculation, at the same max batch",
                      final if speculation else None, speculation,
                      note=speculation_note(speculation)))
    layers = ()
    if restructured:
        before, after = kv_bytes_per_token(source_spec, None), kv_bytes_per_token(spec, kv_table)
        layers = tuple({"layer": i, "attention": spec.layers[i].attention.kind,
                        "source_bytes_per_token": before[i], "bytes_per_token": after[i]} for i in sorted(after))
    return Scenario(name, kind, spec.model_type, tuple(steps), layers, tuple(notes))


def speculation_note(speculation: Speculation | None) -> str:
    if speculation is None:
        return "not applied: no draft head (no tau recorded)"
    note = f"tau {speculation.tau:g} tokens per verification of {speculation.draft_tokens} drafts"
    if speculation.break_even is not None:
        note += (f", measured below the break-even batch {speculation.break_even}: from that batch on it is off and "
                 "the step decodes plainly (factor 1.00)")
    return note + (f" ({speculation.source})" if speculation.source else "")


def load_speculation(path: Path | str) -> Speculation:
    """A measured speculation (`benchmarks/speculative_serving.py --out FILE.json`): the tau measured at the
    largest concurrency below the break-even (the largest measured when it never broke even), the tokens a
    verification checks per sequence, the break-even concurrency, and where it was measured."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise KilnError(f"--speculation {path}: cannot read it ({exc.strerror or type(exc).__name__})") from None
    try:
        data = json.loads(text)
        rows = sorted(((int(r["concurrency"]), float(r["tau"])) for r in data["rows"]), key=lambda r: r[0])
        break_even = data["break_even"]
        nodes = data["verified_per_sequence"]
    except (ValueError, KeyError, TypeError) as exc:
        raise KilnError(f"--speculation {path}: not a speculative_serving.py measurement ({type(exc).__name__}: "
                        f"{exc})"[:300]) from None
    if break_even is not None and (isinstance(break_even, bool) or not isinstance(break_even, int) or break_even < 1):
        raise KilnError(f"--speculation {path}: break_even must be a positive integer or null, got {break_even!r}")
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise KilnError(f"--speculation {path}: verified_per_sequence must be a positive integer, got {nodes!r}")
    paid = [(c, tau) for c, tau in rows if break_even is None or c < break_even]
    if not paid:
        raise KilnError(f"--speculation {path}: speculation did not pay at any measured concurrency (break-even "
                        f"{break_even}); there is no tau to price")
    concurrency, tau = paid[-1]
    where = f"measured at concurrency {concurrency}" + (f", {data['machine']}" if data.get("machine") else "")
    return Speculation(tau, nodes, break_even, where)


# --- targets: an artifact, or a Hugging Face config ------------------------------------------------------------------
def _speculation_of(manifest: Mapping) -> Speculation | None:
    """A kept pass's gate metric named "tau", if the artifact records one, with the tokens a verification step
    checks per sequence: its config's draft_tokens, times its tree_width when it drafts a tree (every node of
    the tree is verified)."""
    for p in manifest.get("passes", ()):
        if p.get("decision") == "reverted" or not p.get("gate"):
            continue
        for metric in p["gate"].get("metrics", ()):
            if metric.get("name") == "tau":
                config = p.get("config") or {}
                nodes = int(config.get("draft_tokens", DEFAULT_DRAFT_TOKENS)) * int(config.get("tree_width", 1))
                return Speculation(float(metric["value"]), nodes)
    return None


def manifest_scenario(name: str, manifest: Mapping, spec: ModelSpec, source_spec: ModelSpec,
                      speculation: Speculation | None = None) -> Scenario:
    """An artifact's scenario from its manifest's formats and KV table (`speculation`: overrides its tau)."""
    formats = manifest["formats"]
    tied = bool((formats.get("lm_head") or {}).get("tied_to"))  # a dense LM head stored once, as the embedding
    return scenario(name, "artifact", spec, source_spec, formats, manifest.get("kv_cache"), tied,
                    speculation or _speculation_of(manifest))


def config_scenario(name: str, spec: ModelSpec, weights: str = "bf16", kv: str = "bf16",
                    speculation: Speculation | None = None) -> Scenario:
    """A config's scenario under assumed formats: `weights` for every linear but the LM head and routers
    (fp8: W8A8; nvfp4: W4A4, weight-only where there are no FP4 tensor cores), `kv` for every layer's cache."""
    if weights not in CONFIG_WEIGHTS:
        raise KilnError(f"--weights must be one of {', '.join(CONFIG_WEIGHTS)}, got {weights!r}")
    if kv not in CONFIG_KV:
        raise KilnError(f"--kv must be one of {', '.join(CONFIG_KV)}, got {kv!r}")
    formats = {}
    if weights != "bf16":
        fmt, act = ((WeightFormat.FP8_E4M3, ActivationFormat.FP8_DYNAMIC_PER_TOKEN) if weights == "fp8"
                    else (WeightFormat.NVFP4, ActivationFormat.NVFP4))
        for lin in spec.linears():
            if lin.role not in ("lm_head", "router"):
                formats[lin.name] = {"format": fmt, "activation": act}
    table = {str(layer.index): CONFIG_KV[kv] for layer in spec.layers} if CONFIG_KV[kv] else None
    notes = (f"assumed formats: weights {weights} (all linears but the LM head and routers"
             + (", W8A8" if weights == "fp8" else ", W4A4 where the GPU has FP4 tensor cores" if weights == "nvfp4"
                else "") + f"), KV cache {kv}; no weights read (meta figures)",)
    return scenario(name, "config", spec, spec, formats, table, spec.tie_word_embeddings, speculation, notes)


CONFIG_SIZE_LIMITS = {"num_hidden_layers": 1024, "num_nextn_predict_layers": 16, "head_dim": 4096,
                      "qk_rope_head_dim": 4096, "qk_nope_head_dim": 4096, "v_head_dim": 4096,
                      "num_local_experts": 1024, "num_experts": 1024, "n_routed_experts": 1024}
"""Most of each config.json field that sizes what a report builds (a spec per layer, per expert, rotary tables per
head dim): far above any released model (DeepSeek-V3: 61 layers, 256 experts; head dims up to 256), far below a
config whose spec would not fit in memory. A report reads no weights, so nothing else bounds them."""
MAX_LAYER_EXPERTS = 1 << 17
"""Most expert specs in all (layers x experts; Kimi K2: 61 x 384)."""


def check_config_sizes(config: Mapping, where: str) -> None:
    """Refuse, before a spec is built, a config (already type-checked by loader_config.check_config) whose sizes
    would make the spec itself huge: CONFIG_SIZE_LIMITS, the head dim hidden_size / num_attention_heads when
    head_dim is not given, and layers x experts. One line naming the field, its value and the bound."""
    def refuse(name: str, value: object, limit: int) -> None:
        raise KilnError(f"{where}: {name} = {value} is above {limit}, the most a report models (the spec it builds "
                        "grows with it)")

    for name, limit in CONFIG_SIZE_LIMITS.items():
        value = config.get(name)
        if isinstance(value, int) and value > limit:
            refuse(name, value, limit)
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    if config.get("head_dim") is None and isinstance(hidden, int) and isinstance(heads, int) and heads > 0 \
            and hidden // heads > CONFIG_SIZE_LIMITS["head_dim"]:
        refuse("hidden_size / num_attention_heads", hidden // heads, CONFIG_SIZE_LIMITS["head_dim"])
    experts = max((config.get(k) or 0 for k in ("num_local_experts", "num_experts", "n_routed_experts")
                   if isinstance(config.get(k), int)), default=0)
    layers = config.get("num_hidden_layers") or 0
    if experts * layers > MAX_LAYER_EXPERTS:
        refuse("num_hidden_layers x experts", experts * layers, MAX_LAYER_EXPERTS)


def _config_spec(config_path: Path) -> ModelSpec:
    """The spec of a Hugging Face config.json, refused in one line when it is malformed or too big to model."""
    from kiln.optimizer.loader_config import build_spec, check_config
    from kiln.runtime.artifact import clip, read_json

    data = read_json(config_path)
    if not isinstance(data, dict):
        raise KilnError(f"{clip(config_path)} must hold a JSON object")
    check_config(data)  # types and ranges, as the loader checks them
    check_config_sizes(data, clip(config_path))
    return build_spec(data)


def load_scenario(target: Path, weights: str | None = None, kv: str | None = None,
                  speculation: Speculation | None = None) -> Scenario:
    """An artifact directory (its manifest; weights are not read, so not checksummed), or a Hugging Face config:
    a config.json file or a directory holding one and no manifest."""
    from kiln.runtime.artifact import MANIFEST, clip, read_manifest
    from kiln.runtime.spec import spec_from_json

    target = Path(target)
    if not target.exists():
        raise KilnError(f"{clip(target)} does not exist (give an artifact directory or a config.json)")
    if target.is_dir() and (target / MANIFEST).exists():
        if weights is not None or kv is not None:
            raise KilnError("--weights and --kv describe a config; an artifact's manifest records its own formats")
        manifest = read_manifest(target, verify=False)
        spec = spec_from_json(manifest["architecture"])
        source_spec = spec
        if (any(layer.attention.kind == "mla" for layer in spec.layers)
                and manifest["source"]["model_type"] != "deepseek_v3" and (target / "config.json").is_file()):
            # MLA came from a pass: the source's own structure, from its config
            source_spec = _config_spec(target / "config.json")
        return manifest_scenario(str(target), manifest, spec, source_spec, speculation)
    config = target / "config.json" if target.is_dir() else target
    if not config.is_file():
        raise KilnError(f"{clip(target)} is neither a Kiln artifact nor a Hugging Face config (no manifest.json "
                        "or config.json)")
    return config_scenario(str(target), _config_spec(config), weights or "bf16", kv or "bf16", speculation)


# --- the report ------------------------------------------------------------------------------------------------
def parse_gpus(text: str) -> list[str]:
    keys = [k.strip().lower() for k in text.split(",") if k.strip()]
    unknown = [k for k in keys if k not in GPUS]
    if not keys or unknown:
        raise KilnError(f"unknown GPU {unknown[0] if unknown else text!r}; choose from {', '.join(GPUS)} "
                        "(comma-separated)")
    return list(dict.fromkeys(keys))


def _positive_price(text: str, where: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise KilnError(f"{where} must be a positive number of dollars per GPU-hour, got {text!r}")
    return value


# --- capacity tiers -------------------------------------------------------------------------------------------------
BASELINE_TIER = "on-demand"
TIER_FIELDS = ("price", "interruptions_per_hour", "restart_minutes")
MAX_TIERS = 64


@dataclass(frozen=True)
class Tier:
    """One way to rent a GPU-hour: its billed $/h; for spot capacity, the interruptions an hour and the minutes
    of capacity each costs (rescheduling, reloading the weights, refilling the caches)."""

    name: str
    price: float
    interruptions_per_hour: float = 0.0
    restart_minutes: float = 0.0

    @property
    def available(self) -> float:
        """The fraction of a billed hour that serves: 1 - interruptions/h x restart hours."""
        return 1.0 - self.interruptions_per_hour * self.restart_minutes / 60.0

    @property
    def effective_price(self) -> float:
        """$ per serving GPU-hour: the billed price over the fraction that serves."""
        return self.price / self.available


def is_tier_table(text: str | None) -> bool:
    return text is not None and text.strip().lower().endswith((".yaml", ".yml", ".json"))


def load_tiers(path: str | Path, gpus: Sequence[str]) -> dict[str, tuple[Tier, ...]]:
    """A tier table (YAML or JSON): GPU -> tier name -> a price, or {price, interruptions_per_hour,
    restart_minutes}. Every GPU priced needs an "on-demand" tier (neocloud on-demand: the baseline)."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise KilnError(f"--price-per-hour: tier table {clip(path)} is not a file")
    try:
        data = yaml.safe_load(path.read_text()[:1 << 20])
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise KilnError(f"--price-per-hour: cannot read tier table {clip(path)}: {type(exc).__name__}") from None
    if not isinstance(data, dict):
        raise KilnError(f"--price-per-hour: tier table {clip(path)} must map GPUs ({', '.join(GPUS)}) to tiers")
    unknown = [k for k in data if str(k).lower() not in GPUS]
    if unknown:
        raise KilnError(f"--price-per-hour: tier table names unknown GPU {str(unknown[0])[:40]!r}; choose from "
                        f"{', '.join(GPUS)}")
    table = {str(k).lower(): v for k, v in data.items()}
    out = {}
    for gpu in gpus:
        entries = table.get(gpu)
        if not isinstance(entries, dict) or BASELINE_TIER not in entries:
            raise KilnError(f"--price-per-hour: tier table has no {BASELINE_TIER!r} tier for {gpu} (the baseline)")
        if len(entries) > MAX_TIERS:
            raise KilnError(f"--price-per-hour: {gpu} has {len(entries)} tiers; at most {MAX_TIERS}")
        out[gpu] = tuple(_tier(gpu, str(name)[:60], entry) for name, entry in entries.items())
    return out


def _tier(gpu: str, name: str, entry) -> Tier:
    where = f"--price-per-hour: {gpu} {name}"
    fields = entry if isinstance(entry, dict) else {"price": entry}
    unknown = [k for k in fields if k not in TIER_FIELDS]
    if unknown:
        raise KilnError(f"{where}: unknown field {str(unknown[0])[:40]!r}; known: {', '.join(TIER_FIELDS)}")
    price = _positive_price(str(fields.get("price")), where)
    extra = {}
    for key in TIER_FIELDS[1:]:
        value = fields.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int | float) or not (math.isfinite(value) and value >= 0):
            raise KilnError(f"{where}: {key} must be a non-negative number, got {str(value)[:40]!r}")
        extra[key] = float(value)
    tier = Tier(name, price, **extra)
    if not tier.available > 0:
        raise KilnError(f"{where}: {extra['interruptions_per_hour']:g} interruptions an hour of "
                        f"{extra['restart_minutes']:g} minutes each leave no serving time")
    return tier


def parse_prices(text: str | None, gpus: Sequence[str]) -> dict[str, tuple[float, str]]:
    """$/h per GPU and where it came from: "3.1" for every GPU, "h100=3.1,b200=6" (others keep defaults), or a
    tier table's on-demand tier (`load_tiers`)."""
    prices = {k: (DEFAULT_PRICES[k], "default") for k in gpus}
    if text is None:
        return prices
    if is_tier_table(text):
        return {k: (next(t.price for t in tiers if t.name == BASELINE_TIER), "given")
                for k, tiers in load_tiers(text, gpus).items()}
    if "=" not in text:
        value = _positive_price(text.strip(), "--price-per-hour")
        return {k: (value, "given") for k in gpus}
    for pair in text.split(","):
        key, _, value = pair.partition("=")
        key = key.strip().lower()
        if key not in GPUS:
            raise KilnError(f"--price-per-hour: unknown GPU {key!r}; choose from {', '.join(GPUS)}")
        if key in prices:
            prices[key] = (_positive_price(value.strip(), f"--price-per-hour {key}"), "given")
    return prices


def economics_report(scn: Scenario, gpus: Sequence[str] = tuple(GPUS), prices: Mapping | None = None,
                     context: int = DEFAULT_CONTEXT, gpus_per_replica: int = 1,
                     tiers: Mapping[str, Sequence[Tier]] | None = None, workload=None,
                     link_gbps: float | None = None) -> dict:
    """The report as JSON data: per GPU, the served model's figures and the waterfall; with a `workload`
    (serving_model.Workload), the serving section (co-located against disaggregated) and the waterfall's
    disaggregation step. `link_gbps`: the KV link, gigabits/s per GPU (default serving_model.DEFAULT_LINK_GBPS)."""
    if isinstance(context, bool) or not isinstance(context, int) or context <= 0:
        raise KilnError(f"--context must be a positive number of tokens, got {context!r}")
    if isinstance(gpus_per_replica, bool) or not isinstance(gpus_per_replica, int) or gpus_per_replica <= 0:
        raise KilnError(f"--gpus-per-replica must be a positive integer, got {gpus_per_replica!r}")
    prices = prices or parse_prices(None, gpus)
    served = scn.served
    if workload is None and link_gbps is not None:
        raise KilnError("--link-gbps prices the KV transfer of a --workload; give one")
    if workload is not None:
        from kiln.optimizer import serving_model

        link_gbps = serving_model.DEFAULT_LINK_GBPS if link_gbps is None else link_gbps
        link = serving_model.link_bytes_per_second(link_gbps)
    out = {
        "target": scn.name, "kind": scn.kind, "model_type": scn.model_type, "decode_context": context,
        "gpus_per_replica": gpus_per_replica,
        "formula": "usd_per_mtok = 277.78 x price_per_hour x gpus_per_replica / tokens_per_s",
        "price_note": PRICE_NOTE, "activation_reserve_fraction": ACTIVATION_RESERVE_FRACTION,
        "assumptions": [*scn.notes, *ASSUMPTIONS], "not_modelled": list(NOT_MODELLED),
        "mla_layers": list(scn.kv_layers), "gpus": {},
    }
    for key in gpus:
        device = replica(GPUS[key], gpus_per_replica)
        price, origin = prices[key]
        hourly = price * gpus_per_replica
        row = {"device": device.name, "price_per_hour": price, "price": origin,
               **gpu_figures(served.figures, device, hourly, context, served.speculation)}
        waterfall = price_steps(scn.steps, device, hourly, context)
        row["capacity_tiers"] = tier_rows((tiers or {}).get(key, ()), waterfall[-1], price)
        waterfall.append(capacity_step(row["capacity_tiers"], waterfall[-1]))
        if workload is not None:
            row["serving"] = serving_model.serving_section(served.figures, device, hourly, workload, link)
            waterfall.append(serving_model.disaggregation_step(row["serving"], waterfall[-1]))
        first, last = waterfall[0]["usd_per_mtok"], waterfall[-1]["usd_per_mtok"]
        row["waterfall"] = waterfall
        row["total_factor"] = first / last if first is not None and last is not None else None
        out["gpus"][key] = row
    if workload is not None:
        unit = "GPU" if gpus_per_replica == 1 else f"{gpus_per_replica}-GPU replica"
        out["serving"] = {"workload": {**asdict(workload), "describe": workload.describe()}, "unit": unit,
                          "link_gbps": link_gbps, "link_bytes_per_s": link,
                          "assumptions": list(serving_model.SERVING_ASSUMPTIONS),
                          "not_modelled": list(serving_model.SERVING_NOT_MODELLED)}
    return out


def tier_rows(tiers: Sequence[Tier], served: dict, on_demand: float) -> list[dict]:
    """Each tier's $/Mtok for the served model at its largest batch: the on-demand cost x effective price /
    on-demand price (the tokens/s a GPU-hour yields do not depend on how it is rented)."""
    rows = []
    for t in tiers:
        cost = None if served["usd_per_mtok"] is None else served["usd_per_mtok"] * t.effective_price / on_demand
        rows.append({"tier": t.name, "price_per_hour": t.price, "interruptions_per_hour": t.interruptions_per_hour,
                     "restart_minutes": t.restart_minutes, "available": t.available,
                     "effective_price_per_hour": t.effective_price, "usd_per_mtok": cost,
                     "factor_vs_on_demand": on_demand / t.effective_price})
    return rows


def capacity_step(tiers: list[dict], served: dict) -> dict:
    """The waterfall's last step: the cheapest tier per serving hour against neocloud on-demand."""
    row = {"step": "capacity", "label": "capacity tier", "against": "neocloud on-demand", "batch": served["batch"],
           "tokens_per_s": served["tokens_per_s"]}
    best = min(tiers, key=lambda t: t["effective_price_per_hour"]) if tiers else None
    if best is None or best["tier"] == BASELINE_TIER or served["usd_per_mtok"] is None:
        return {**row, "applied": False, "factor": 1.0, "usd_per_mtok": served["usd_per_mtok"],
                "note": ("not applied: one price per GPU (--price-per-hour takes a tier table)" if best is None
                         else "not applied: on-demand is the cheapest tier given")}
    spot = (f", {best['interruptions_per_hour']:g} interruptions/h x {best['restart_minutes']:g} min lost "
            f"({best['available']:.1%} serving)" if best["interruptions_per_hour"] else "")
    return {**row, "label": f"capacity tier ({best['tier']})", "applied": True, "usd_per_mtok": best["usd_per_mtok"],
            "factor": best["factor_vs_on_demand"],
            "note": f"{best['tier']} at ${best['price_per_hour']:.2f}/h{spot}: ${best['effective_price_per_hour']:.2f} "
                    f"per serving hour against on-demand's; the other tiers in the capacity table"}


def _num(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "does not fit"
    return f"{value:.{digits}g}" if abs(value) < 10**digits else f"{value:,.0f}"


def _gb(n: int) -> str:
    return f"{n / 1e9:.3g} GB" if n >= 10**8 else f"{n / 1e6:.3g} MB" if n >= 10**5 else f"{n} B"


def _cost_cell(row: dict) -> str:
    if not row["applied"]:
        return "-"
    if row["usd_per_mtok"] is None:
        return "does not fit"
    factor = "" if row["factor"] is None else f" (x{row['factor']:.3g})"
    return f"${_num(row['usd_per_mtok'])} @{row['batch']}{factor}"


def summary_rows(report: dict) -> tuple[list[str], list[list[str]]]:
    """The per-GPU figures, one column a GPU."""
    gpus = list(report["gpus"].values())
    c = report["decode_context"]

    def row(name: str, cell: Callable[[dict], str]) -> list[str]:
        return [name, *[cell(g) for g in gpus]]

    rows = [
        row("$ per GPU-hour (* default)",
            lambda g: f"{g['price_per_hour']:.2f}" + ("*" if g["price"] == "default" else "")),
        row("weight bytes", lambda g: f"{g['weight_bytes']} ({_gb(g['weight_bytes'])})"),
        row("KV bytes per token", lambda g: str(g["kv_bytes_per_token"])),
        *[row(f"max sequences @{k}", lambda g, k=k: str(g["max_concurrency"][k]))
          for k in map(str, CONCURRENCY_CONTEXTS)],
        row(f"decode tok/s, batch 1 @{c}", lambda g: _num(g["decode_tokens_per_s_batch1"])),
        row("$/Mtok, batch 1", lambda g: _num(g["usd_per_mtok_batch1"])),
        row(f"max batch @{c}", lambda g: str(g["max_batch"])),
        row("decode tok/s, max batch", lambda g: _num(g["decode_tokens_per_s_max_batch"])),
        row("$/Mtok, max batch", lambda g: _num(g["usd_per_mtok_max_batch"])),
        row("bound (batch 1 / max)", lambda g: f"{g['bound_batch1'] or '-'} / {g['bound_max_batch'] or '-'}"),
        row("prefill ms per 1K tokens", lambda g: f"{g['prefill_seconds_per_1k_tokens'] * 1e3:.3g}"),
    ]
    return ["", *[g["device"] for g in gpus]], rows


def waterfall_rows(report: dict) -> tuple[list[str], list[list[str]]]:
    """The waterfall, one column a GPU: $/Mtok @ batch (factor against the step before)."""
    gpus = list(report["gpus"].values())
    rows = [[step["label"], step["against"] or "-", *[_cost_cell(g["waterfall"][i]) for g in gpus]]
            for i, step in enumerate(gpus[0]["waterfall"])]
    rows.append(["total", "the source as served", *[("x" + _num(g["total_factor"])) if g["total_factor"] else "-"
                                                    for g in gpus]])
    return ["step", "against", *[g["device"] for g in gpus]], rows


def waterfall_notes(report: dict) -> list[str]:
    return [f"{step['label']}: {step['note']}" for step in next(iter(report["gpus"].values()))["waterfall"]]


def economics_markdown(report: dict, png: str | None = WATERFALL_PNG) -> list[str]:
    """report.md's "## Economics" section."""
    n = report["gpus_per_replica"]
    per = f" per {n}-GPU replica" if n > 1 else ""
    lines = ["## Economics", "",
             (f"Decode roofline of `{report['target']}` ({report['kind']}, {report['model_type']}){per}: every "
              f"sequence holds {report['decode_context']} tokens of KV cache; $/Mtok = 277.78 x $/h"
              f"{f' x {n} GPUs' if n > 1 else ''} / tokens/s. "
              f"{report['price_note']} (* = default price.)"), ""]
    head, rows = summary_rows(report)
    lines += ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", f"### What each pass buys (at each step's largest batch, context {report['decode_context']})", "",
              "Cells: $/Mtok @ batch (factor against the step before, on the same GPU).", ""]
    head, rows = waterfall_rows(report)
    lines += ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", *[f"- {note}" for note in waterfall_notes(report)]]
    if png:
        lines += ["", f"![waterfall]({png})"]
    if any(g["capacity_tiers"] for g in report["gpus"].values()):
        lines += ["", "### Capacity tiers (the served model at its largest batch; baseline: neocloud on-demand)", "",
                  ("| GPU | tier | $/h billed | interruptions/h | restart min | serving | $/h serving | $/Mtok | "
                   "vs on-demand |"), "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {g['device']} | {t['tier']} | {t['price_per_hour']:.2f} | {t['interruptions_per_hour']:g} | "
                  f"{t['restart_minutes']:g} | {t['available']:.1%} | {t['effective_price_per_hour']:.2f} | "
                  f"{_num(t['usd_per_mtok'])} | x{t['factor_vs_on_demand']:.2f} |"
                  for g in report["gpus"].values() for t in g["capacity_tiers"]]
    if "serving" in report:
        from kiln.optimizer.serving_model import serving_markdown

        lines += serving_markdown(report)
    if report["mla_layers"]:
        lines += ["", "### MLA per layer (KV bytes/token: the source's BF16 GQA cache -> as served)", "",
                  "| layer | attention | before | after | ratio |", "|---:|---|---:|---:|---:|"]
        lines += [f"| {r['layer']} | {r['attention']} | {r['source_bytes_per_token']} | {r['bytes_per_token']} | "
                  f"{r['bytes_per_token'] / r['source_bytes_per_token']:.3f} |" for r in report["mla_layers"]]
    lines += ["", "### Assumptions", "", *[f"- {a}" for a in report["assumptions"]],
              "", "### Not modelled", "", *[f"- {a}" for a in report["not_modelled"]]]
    return lines


def economics_tables(report: dict) -> list:
    """The command's rich tables: the per-GPU figures and the waterfall."""
    from rich.table import Table

    per = f", {report['gpus_per_replica']} GPUs a replica" if report["gpus_per_replica"] > 1 else ""
    tables = []
    for title, (head, rows) in (
            (f"economics of {report['target']} (decode context {report['decode_context']}{per})", summary_rows(report)),
            ("what each pass buys: $/Mtok @ max batch (x factor against the step before)", waterfall_rows(report))):
        table = Table(title=title)
        for col in head:
            table.add_column(col, justify="left" if col in ("", "step", "against") else "right")
        for r in rows:
            table.add_row(*r)
        tables.append(table)
    if any(g["capacity_tiers"] for g in report["gpus"].values()):
        table = Table(title="capacity tiers: the served model at its largest batch (baseline: neocloud on-demand)")
        for col in ("GPU", "tier", "$/h billed", "serving", "$/h serving", "$/Mtok", "vs on-demand"):
            table.add_column(col, justify="left" if col in ("GPU", "tier") else "right")
        for g in report["gpus"].values():
            for t in g["capacity_tiers"]:
                table.add_row(g["device"], t["tier"], f"{t['price_per_hour']:.2f}", f"{t['available']:.1%}",
                              f"{t['effective_price_per_hour']:.2f}", _num(t["usd_per_mtok"]),
                              f"x{t['factor_vs_on_demand']:.2f}")
        tables.append(table)
    if "serving" in report:
        from kiln.optimizer.serving_model import serving_rows, serving_title

        head, rows = serving_rows(report)
        verdicts = "\n".join(f"{g['device']}: {g['serving']['verdict']}" for g in report["gpus"].values())
        table = Table(title=serving_title(report), caption=verdicts, caption_justify="left")
        for col in head:
            table.add_column(col, justify="left" if col in ("GPU", "deployment") else "right")
        for r in rows:
            table.add_row(*r)
        tables.append(table)
    return tables


def not_modelled_text(report: dict) -> str:
    """What the command prints under its tables."""
    serving = report.get("serving")
    return "\n".join(["Steps: " + "; ".join(waterfall_notes(report)) + ".",
                      "Not modelled: " + "; ".join(report["not_modelled"]) + ".",
                      "Assumptions: " + "; ".join(report["assumptions"]) + ".", report["price_note"],
                      *([f"Serving model assumptions: {'; '.join(serving['assumptions'])}.",
                         f"Serving model, not modelled: {'; '.join(serving['not_modelled'])}."] if serving else [])])


def waterfall_png(report: dict) -> bytes:
    """The compounding factors per GPU: $/Mtok after each applied step, each bar from the step before."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpus = report["gpus"]
    fig, axes = plt.subplots(1, len(gpus), figsize=(4.6 * len(gpus), 4.2), squeeze=False)
    for ax, g in zip(axes[0], gpus.values(), strict=True):
        rows = [r for r in g["waterfall"] if r["applied"]]
        labels, prev = [], None
        for i, r in enumerate(rows):
            labels.append(r["label"].replace(" (KV structure)", "").replace("KV-cache quantization", "KV quant"))
            cost = r["usd_per_mtok"]
            if cost is None:
                ax.text(i, 0.03, "does not fit", rotation=90, ha="center", va="bottom", fontsize=7,
                        transform=ax.get_xaxis_transform())
            elif prev is None:
                ax.bar(i, cost, color="#777777")
                ax.text(i, cost, f"${cost:.3g}", ha="center", va="bottom", fontsize=7)
            else:
                low, high = min(prev, cost), max(prev, cost)
                ax.bar(i, high - low, bottom=low, color="#2a9d8f" if cost <= prev else "#e76f51")
                ax.text(i, high, f"x{prev / cost:.3g}", ha="center", va="bottom", fontsize=7)
            prev = cost
        if rows and rows[-1]["usd_per_mtok"] is not None:
            final = rows[-1]["usd_per_mtok"]
            ax.bar(len(rows), final, color="#264653")
            total = f"x{g['total_factor']:.3g}" if g["total_factor"] else ""
            ax.text(len(rows), final, f"${final:.3g}\n{total}", ha="center", va="bottom", fontsize=7)
            labels.append("served")
        ax.set_xlim(-0.6, len(labels) - 0.4)  # a step that does not fit has no bar to widen the axis
        ax.set_xticks(range(len(labels)), labels, rotation=35, ha="right", fontsize=7)
        costs = [r["usd_per_mtok"] for r in rows if r["usd_per_mtok"] is not None]
        if costs:
            ax.set_ylim(0, 1.2 * max(costs))  # room for the labels above the bars
        ax.set_ylabel("$ per million decoded tokens")
        ax.set_title(f"{g['device']} at ${g['price_per_hour']:.2f}/h", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{report['model_type']}: compounding factors at the max batch, context {report['decode_context']}",
                 fontsize=9)
    fig.subplots_adjust(left=0.3 / len(gpus), right=0.99, bottom=0.24, top=0.86, wspace=0.3)  # tight_layout: 2x slower
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, metadata={"Software": None})  # no version stamp: reproducible bytes
    plt.close(fig)
    return buffer.getvalue()


def check_report_output(directory: Path | str, target: Path | str | None = None) -> Path:
    """`report -o DIR`, checked before the report is computed (optimizer.output_dir's policy): never an artifact or
    an export (their checksums and tables), never the input or inside it, and a directory that exists must be
    empty or Kiln's own earlier report (its kiln_report.json lists every file), which a report replaces without
    --overwrite: it is regenerated from its inputs. Anything else there (the user's own report.md) is refused."""
    from kiln.optimizer.output_dir import EXPORT_MARKER, check_output
    from kiln.runtime.artifact import MANIFEST, clip

    directory = Path(directory)
    if (directory / MANIFEST).exists():
        raise KilnError(f"{clip(directory)} is a Kiln artifact; writing there would break its checksums (the build "
                        "writes the economics into the artifact's report.md)")
    if (directory / EXPORT_MARKER).exists():
        raise KilnError(f"{clip(directory)} is a Kiln export; write the report to a directory of its own")
    if directory.exists() and not directory.is_dir():
        raise KilnError(f"{clip(directory)} exists and is not a directory")
    inputs = []
    if target is not None:
        target = Path(target)
        # a config directory's input is its config.json: a report beside it (DIR/out) is fine
        inputs.append(target / "config.json" if target.is_dir() and not (target / MANIFEST).exists() else target)
    return check_output(directory, True, inputs)


def write_report(report: dict, directory: Path, target: Path | str | None = None) -> list[Path]:
    """`-o DIR`: report.md (the economics section), the waterfall PNG and kiln_report.json (what Kiln wrote), into
    DIR atomically; never into an artifact, an export or a directory holding anything else
    (check_report_output)."""
    import json

    from kiln.optimizer import __version__
    from kiln.optimizer.output_dir import REPORT_MARKER, atomic_directory

    out = check_report_output(directory, target)
    markdown, png = "\n".join(economics_markdown(report)) + "\n", waterfall_png(report)
    check_report_output(directory, target)  # again: rendering took a while
    with atomic_directory(out, overwrite=True) as tmp:
        (tmp / "report.md").write_text(markdown)
        (tmp / WATERFALL_PNG).write_bytes(png)
        (tmp / REPORT_MARKER).write_text(json.dumps({"kiln_version": __version__, "source": str(target)}) + "\n")
    return [Path(directory) / "report.md", Path(directory) / WATERFALL_PNG]


def build_economics(manifest: Mapping, spec: ModelSpec, source_spec: ModelSpec) -> tuple[list[str], dict[str, bytes]]:
    """What a build adds to its artifact: report.md's economics lines and the waterfall PNG, on every GPU of the
    table at default prices and the default decode context."""
    report = economics_report(manifest_scenario("this artifact", manifest, spec, source_spec))
    return economics_markdown(report), {WATERFALL_PNG: waterfall_png(report)}
