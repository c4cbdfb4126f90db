"""Weight quantization: store chosen linears as FP8 E4M3, NVFP4 or MXFP4, optionally with activations.

Preconditions: a loaded graph; the target must run the format (Hopper: FP4 only weight-only).
What it does: for every linear whose role is selected and whose name is not kept, replace its precision
annotation with a `QuantizedWeight` holding the packed tensors (ModelOpt unified names). Source fp32/bf16
tensors stay in the graph, so a later back-off or revert can re-quantize from them.
What it does not handle: routers and norms (always kept: tiny and sensitive); embeddings.
Back-off: keep the linears with the largest relative weight error in source precision, 1, 2, 4, ... of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from kernels import fp8
from kernels.errors import KilnError
from kernels.targets import Target
from passes.base import Pass, PassContext, PassResult
from passes.graph import Linear, ModelGraph, QuantizedWeight

WEIGHT_FORMATS = ("fp8", "nvfp4", "mxfp4")
ACTIVATION_MODES = ("none", "dynamic", "static")
GRANULARITIES = ("per_channel", "per_tensor")
QUANTIZABLE_ROLES = ("q", "k", "v", "o", "q_a", "q_b", "kv_a", "kv_b", "gate", "up", "down", "expert", "lm_head")
DEFAULT_ROLES = tuple(r for r in QUANTIZABLE_ROLES if r != "lm_head")


def _choice(field_name: str, value, allowed) -> None:
    if value not in allowed:
        raise KilnError(f"{field_name}={value!r} is not allowed; choose one of {', '.join(map(str, allowed))}")


def quantize_linear_weight(w: torch.Tensor, fmt: str, granularity: str = "per_channel",
                           activation: str = "none") -> QuantizedWeight:
    """Round-to-nearest quantization of one [out, in] weight to `fmt` (what every calibration refines)."""
    w = w.float()
    if fmt == "fp8":
        if granularity == "per_channel":
            q, scale = fp8.fp8_quantize_per_channel(w)
        else:
            q, scale = fp8.fp8_quantize_per_tensor(w)
        return QuantizedWeight("fp8_e4m3", {"weight": q, "weight_scale": scale}, activation)
    if fmt == "nvfp4":
        from kernels.nvfp4 import nvfp4_quantize

        q = nvfp4_quantize(w)
        return QuantizedWeight("nvfp4", q.tensors(), activation, in_features=w.shape[1])
    if fmt == "mxfp4":
        from kernels.mxfp4 import mxfp4_quantize

        q = mxfp4_quantize(w)
        return QuantizedWeight("mxfp4", q.tensors(), activation, in_features=w.shape[1])
    raise KilnError(f"unknown weight format {fmt!r}; choose one of {', '.join(WEIGHT_FORMATS)}")


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    """fp32 values of a QuantizedWeight (same arithmetic as the runtime's loader)."""
    if qw.format == "fp8_e4m3":
        return fp8.fp8_dequantize(qw.tensors["weight"], qw.tensors["weight_scale"])
    if qw.format == "nvfp4":
        from kernels.nvfp4 import Nvfp4Weight, nvfp4_dequantize

        return nvfp4_dequantize(Nvfp4Weight.from_tensors(qw.tensors, in_features=qw.in_features))
    if qw.format == "mxfp4":
        from kernels.mxfp4 import Mxfp4Weight, mxfp4_dequantize

        return mxfp4_dequantize(Mxfp4Weight.from_tensors(qw.tensors, in_features=qw.in_features))
    raise KilnError(f"unknown stored format {qw.format!r}")


def activation_format(fmt: str, mode: str) -> str:
    if mode == "none":
        return "none"
    if fmt == "fp8":
        return "fp8_dynamic_per_token" if mode == "dynamic" else "fp8_static_per_tensor"
    return fmt  # nvfp4 / mxfp4 activations: dynamic block scales


@dataclass(frozen=True)
class WeightQuantization(Pass):
    """Quantize the weights of selected linears to one format.

    Fields:
        format       "fp8" (E4M3), "nvfp4" or "mxfp4"
        activations  "none" (weight-only), "dynamic" (per-token FP8 / dynamic FP4 blocks) or "static"
        granularity  FP8 weight scales: "per_channel" (one per output row) or "per_tensor"
        roles        which linear roles to quantize (routers are never quantized)
        keep         module names kept in source precision
        max_back_offs how many back-off steps to try before reverting
    """

    format: str = "fp8"
    activations: str = "none"
    granularity: str = "per_channel"
    roles: tuple[str, ...] = DEFAULT_ROLES
    keep: tuple[str, ...] = ()
    max_back_offs: int = 4

    name: ClassVar[str] = "weight-quant"
    default_floor: ClassVar[float] = 0.98

    def __post_init__(self):
        _choice("format", self.format, WEIGHT_FORMATS)
        _choice("activations", self.activations, ACTIVATION_MODES)
        _choice("granularity", self.granularity, GRANULARITIES)
        object.__setattr__(self, "roles", tuple(self.roles))
        object.__setattr__(self, "keep", tuple(sorted(self.keep)))
        for role in self.roles:
            _choice("roles entry", role, QUANTIZABLE_ROLES)
        if not self.roles:
            raise KilnError("roles is empty: the pass would quantize nothing")
        if self.activations == "static":
            raise KilnError("activations='static' needs calibrated input scales, which this pass does not "
                            "collect yet; use 'dynamic' or 'none'")
        if not isinstance(self.max_back_offs, int) or self.max_back_offs < 0:
            raise KilnError(f"max_back_offs must be a non-negative integer, got {self.max_back_offs!r}")

    def check(self, graph: ModelGraph, target: Target) -> None:
        if self.activations == "none":
            target.check_weight_only(self.format)
        else:
            target.check_weight_activation(self.format)
        unknown = sorted(set(self.keep) - set(graph.linears))
        if unknown:
            raise KilnError(f"keep names modules that do not exist: {', '.join(unknown[:5])}")

    def _selected(self, graph: ModelGraph) -> tuple[list[Linear], dict[str, str]]:
        chosen, skipped = [], {}
        for lin in graph.iter_linears():
            if lin.role == "router":
                skipped[lin.name] = "router: kept in high precision"
            elif lin.role not in self.roles:
                skipped[lin.name] = f"role {lin.role!r} not selected"
            elif lin.name in self.keep:
                skipped[lin.name] = "kept in source precision (keep list / back-off)"
            elif lin.quant is not None:
                skipped[lin.name] = f"already quantized ({lin.quant.format})"
            else:
                chosen.append(lin)
        return chosen, skipped

    def apply(self, graph: ModelGraph, ctx: PassContext) -> PassResult:
        result = PassResult(self.name)
        chosen, result.skipped = self._selected(graph)
        act = activation_format(self.format, self.activations)
        for lin in chosen:
            w = graph.weight(lin).float()
            qw = quantize_linear_weight(w, self.format, self.granularity, act)
            err = (dequantize(qw) - w).pow(2).sum() / w.pow(2).sum().clamp_min(1e-30)
            lin.quant = qw
            result.changed[lin.name] = f"{qw.format}" + (f" + {act} activations" if act != "none" else "")
            result.metrics[lin.name] = float(err)
        return result

    def back_offs(self, graph: ModelGraph, result: PassResult) -> Iterator[Pass]:
        worst = sorted(result.metrics, key=lambda name: -result.metrics[name])
        count = 1
        for _ in range(self.max_back_offs):
            if count >= len(worst):
                break
            yield replace(self, keep=tuple(sorted(set(self.keep) | set(worst[:count]))))
            count *= 2
