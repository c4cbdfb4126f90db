"""KV-cache quantization: each layer's KV cache stored as FP8 E4M3 or NVFP4 instead of BF16.

Preconditions: a loaded graph; MLA conversion, when in the pipeline, has run (the cache of an MLA layer is
its compressed latent and roped key part, and their dims decide what fits). Static scales need K/V
activations on calibration text, which the driver's runner provides (`ctx.runner.capture_kv`, optimizer.measure.runner).
What it does: annotates `graph.kv_cache[layer]` with the format the runtime stores that layer's cache in
(the artifact's manifest "kv_cache" table, runtime.kv_format) and its calibrated scales:
    fp8    E4M3 values; scales per tensor (amax / 448 over the calibration tokens), per KV head, or
           dynamic (one per token, computed as the token is written; nothing calibrated)
    nvfp4  E2M1 values in 16-value blocks along head_dim, an E4M3 scale per block and a calibrated fp32
           global scale per stream (amax / (6 * 448)). A layer whose cached dims are not multiples of 16
           backs off to FP8 with `scaling`, and the result says why.
With `center` (the default) it also stores each stream's per-channel mean over the calibration tokens
[heads, dim] as an offset taken off before quantizing and added back on reading (kernels/kv_codec.py): post-
RoPE keys carry large, nearly constant means in their slowly rotating channels, which FP8's relative
rounding would otherwise spend its precision on. It costs no bytes per token.
It measures each layer's sensitivity into `result.metrics["model.layers.{i}.kv_cache"]`: the mean per-token
KL of the final logits on calibration paragraphs with only that layer's cache quantized (`ctx.runner.logit_kl`),
or, without a runner, the relative squared error of its quantized K and V on the calibration activations
(always recorded as `...kv_cache.relative_error`).
What it does not handle: weights (weight-quant), MLA conversion (the mla pass), attention kernels.
Back-off: keep the most sensitive layers' caches in BF16, 1, 2, 4, ... of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import ClassVar

from kiln.calibration import progress
from kiln.calibration.metrics import relative_error
from kiln.kernels.errors import KilnError, check_choice
from kiln.kernels.formats import KvFormat
from kiln.kernels.kv_fp8 import FP8_E4M3_KV, KV_FP8_SCALINGS
from kiln.kernels.kv_quant import kv_fake_quantize
from kiln.kernels.registry import kv_format
from kiln.kernels.targets import Target
from kiln.passes.base import MAX_BACK_OFFS, MAX_PARAGRAPHS, Pass, PassContext, PassResult, check_range
from kiln.passes.graph import ModelGraph
from kiln.runtime.spec import AttentionSpec

KV_FORMATS = ("fp8", "nvfp4")


def layer_key(layer: int) -> str:
    return f"model.layers.{layer}.kv_cache"


@dataclass(frozen=True)
class KvCacheQuantization(Pass):
    """Store the KV cache of every layer not kept in FP8 E4M3 or NVFP4.

    Fields:
        format        "fp8" (E4M3) or "nvfp4" (16-value blocks along head_dim; FP8 where dims do not allow)
        scaling       FP8 scales: "per_tensor" or "per_head" (calibrated), or "dynamic" (one per token)
        center        subtract a calibrated per-channel offset (the calibration mean) before quantizing
        keep          layer indices whose cache stays BF16
        max_back_offs how many back-off steps (BF16 for the 1, 2, 4, ... most sensitive layers) to try
        sensitivity_paragraphs  calibration paragraphs the per-layer logit-KL sensitivity is measured on
    """

    format: str = "fp8"
    scaling: str = "per_tensor"
    center: bool = True
    keep: tuple[int, ...] = ()
    max_back_offs: int = 3
    sensitivity_paragraphs: int = 32

    name: ClassVar[str] = "kv-cache"
    default_floor: ClassVar[float] = 0.99
    # a ceiling of twice the KL fp8-kv costs on stories260K, a floor allowing 1.5 times its disagreement
    # (benchmarks/results/kv_cache.md). NVFP4 KV shares the recovery floor, and so these: it backs off (BF16
    # layers) until it costs what FP8 does (stories260K's 8-wide heads keep FP8)
    default_max_kl: ClassVar[float] = 0.02
    default_min_top1: ClassVar[float] = 0.93
    runs_after: ClassVar[frozenset[str]] = frozenset({"mla"})
    exclusive: ClassVar[str | None] = "KV cache's format"  # fp8-kv,nvfp4-kv: one would silently win

    def __post_init__(self):
        check_choice("format", self.format, KV_FORMATS)
        check_choice("scaling", self.scaling, KV_FP8_SCALINGS)
        check_choice("center", self.center, (True, False))
        keep = tuple(self.keep)
        for layer in keep:
            check_range("keep entry (a layer index)", layer, 0, integer=True)
        object.__setattr__(self, "keep", tuple(sorted(set(keep))))
        check_range("max_back_offs", self.max_back_offs, 0, MAX_BACK_OFFS, integer=True, why="each is a gate run")
        check_range("sensitivity_paragraphs", self.sensitivity_paragraphs, 1, MAX_PARAGRAPHS, integer=True,
                    why="each layer's probe runs on them")

    def check(self, graph: ModelGraph, target: Target) -> None:
        layers = {b.index for b in graph.blocks}
        unknown = sorted(set(self.keep) - layers)
        if unknown:
            raise KilnError(f"keep names layers this model does not have: {unknown[:5]} "
                            f"(it has layers 0..{len(layers) - 1})")

    def _layer_format(self, attention: AttentionSpec) -> tuple[KvFormat, str, str | None]:
        """(stored format, scaling, why it differs from the requested format or None)."""
        codec = kv_format(self.format)
        bad = codec.unaligned_dims(attention.kv_streams())
        if not bad:
            return codec.name, self.scaling if self.scaling in codec.scalings else codec.scalings[0], None
        dims = "head_dim" if attention.kind != "mla" else "cached dims"
        fallback = FP8_E4M3_KV  # every cached dim fits it
        return fallback.name, self.scaling, (f"{codec.label} needs {dims} in multiples of {codec.dim_multiple} "
                                             f"({', '.join(bad)}): {fallback.label} instead")

    def apply(self, graph: ModelGraph, ctx: PassContext) -> PassResult:
        result = PassResult(self.name)
        plans = {}
        for block in graph.blocks:
            if block.index in self.keep:
                result.skipped[layer_key(block.index)] = "kept in BF16 (keep list / back-off)"
            else:
                plans[block.index] = self._layer_format(block.attention)
        needs_calibration = self.center or any(kv_format(fmt).static_scale(scaling)
                                               for fmt, scaling, _ in plans.values())
        if ctx.runner is None and needs_calibration:
            raise KilnError("kv-cache: static KV scales need K/V activations on calibration text, and the pass "
                            "context has no runner (pass calibration data, e.g. optimize build --calib-data, "
                            "or use format='fp8', scaling='dynamic', center=False)")
        activations = ctx.runner.capture_kv(graph) if (ctx.runner is not None and plans) else None
        if activations is None and ctx.runner is None:
            result.notes.append("no calibration activations: sensitivity not measured, so no back-off")
        backed_off = []
        previous = dict(graph.kv_cache)  # what earlier passes left; the sensitivity probe starts from it
        for block in graph.blocks:
            if block.index not in plans:
                continue
            fmt, scaling, note = plans[block.index]
            streams = block.attention.kv_streams()
            scales, offsets, error = {}, {}, 0.0
            for s, (stream, _, _) in enumerate(streams):
                x = activations[block.index][s] if activations is not None else None
                offset = x.mean(dim=0) if (self.center and x is not None) else None
                centered = x if offset is None else x - offset
                stored, compute = kv_format(fmt).calibrated_scale(centered, scaling) if x is not None else (None, None)
                if stored is not None:
                    scales[stream] = stored
                if offset is not None:
                    offsets[stream] = offset
                if x is not None:
                    error += relative_error(kv_fake_quantize(x, fmt, scaling, compute, offset), x)
            graph.kv_cache[block.index] = {"format": fmt, "scaling": scaling, "streams": [n for n, _, _ in streams],
                                           "scales": scales, "offsets": offsets, **({"note": note} if note else {})}
            described = f"{fmt} ({scaling}{', centered' if offsets else ''})"
            result.changed[layer_key(block.index)] = described + (f": {note}" if note else "")
            if activations is not None:
                result.metrics[layer_key(block.index)] = error
                result.metrics[layer_key(block.index) + ".relative_error"] = error
            if note:
                backed_off.append(block.index)
        if backed_off:
            result.notes.append(f"layers {backed_off}: {plans[backed_off[0]][2]}")
        if ctx.runner is not None and len(plans) > 1:
            self._logit_kl_sensitivity(graph, ctx, previous, list(plans), result)
        return result

    def _logit_kl_sensitivity(self, graph: ModelGraph, ctx: PassContext, previous: dict, layers: list[int],
                              result: PassResult) -> None:
        """Per layer: logit KL against the source with only that layer's new cache format applied."""
        annotated = graph.kv_cache
        try:
            for layer in progress.track(layers, f"{self.name}: sensitivity probes", unit="layers"):
                graph.kv_cache = {**previous, layer: annotated[layer]}
                result.metrics[layer_key(layer)] = ctx.runner.logit_kl(graph, self.sensitivity_paragraphs)
        finally:
            graph.kv_cache = annotated
        result.notes.append(f"sensitivity: logit KL on {self.sensitivity_paragraphs} calibration paragraphs with "
                            "one layer's cache quantized at a time")

    def back_offs(self, graph: ModelGraph, result: PassResult) -> Iterator[Pass]:
        worst = sorted((k for k in result.metrics if k.endswith(".kv_cache")), key=lambda k: -result.metrics[k])
        layers = [int(key.split(".")[2]) for key in worst]
        count = 1
        for _ in range(self.max_back_offs):
            if count >= len(layers):
                break
            yield replace(self, keep=tuple(sorted(set(self.keep) | set(layers[:count]))))
            count *= 2
