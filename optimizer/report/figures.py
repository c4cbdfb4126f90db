"""What a served model costs a decode step, as plain figures: bytes and FLOPs, no tensors (economics.py has the
model). A linear is priced by its stored format (kernels.registry) and the precision its GEMM computes in.

    cost = linear_cost(lin, "nvfp4", "nvfp4")          # LinearCost(params, bytes, compute="fp4")
    m = spec_figures(spec, cost_of, kv_bytes_per_token(spec, None), lm_head_tied=False)
    m.resident_bytes, m.read_bytes(tokens=8), m.kv_bytes(context=4096), m.active_params()
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kiln.kernels.errors import KilnError
from kiln.kernels.formats import ActivationFormat, WeightFormat
from kiln.kernels.registry import WEIGHT_FORMATS
from kiln.runtime.kv_format import kv_sequence_bytes
from kiln.runtime.spec import LinearSpec, ModelSpec

BF16, FP8, FP4 = "bf16", "fp8", "fp4"  # the precision a GEMM computes in


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
