"""One weight -> the tensors a format stores, by the calibration methods; and what the formats do to inputs.

    quantize_weight(w, fmt, granularity, method, ...)   "rtn" (the kernels' round to nearest), "mse" (scale
                                search, scale_search) or "gptq" (gptq, on the input Hessian) -> stored tensors
    calibrated_weight(w, fmt, method, hessian, ...)     the same, with the weight-only fallbacks the precision
                                passes use for a linear that saw no calibration token
    shared_global_scales(weights, keys)                 one NVFP4 per-tensor scale per fused set
    activation_fake_quantizer / static_input_scale      what the runtime does to a linear's input
    stored_layout(fmt, tensors)                         the calibration layout (grids) of stored tensors

Formats here are the weight formats "fp8" (E4M3), "nvfp4", "mxfp4", "mxfp6"; tensors use ModelOpt's short names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from kiln.calibration.gptq import gptq_quantize
from kiln.calibration.grids import WeightLayout
from kiln.calibration.scale_search import mse_scales
from kiln.kernels.errors import KilnError, check_choice
from kiln.kernels.nvfp4 import nvfp4_global_scale
from kiln.kernels.registry import parse_weight_format, quantized_spellings, weight_format

WEIGHT_FORMATS = quantized_spellings()
METHODS = ("rtn", "mse", "gptq")


def quantize_weight(w: torch.Tensor, fmt: str, granularity: str = "per_channel", *, method: str = "rtn",
                    hessian: torch.Tensor | None = None, act_order: bool = True, damping: float = 0.01,
                    global_scale: torch.Tensor | None = None, consume_hessian: bool = False) -> dict[str, torch.Tensor]:
    """The stored tensors of one fp32 [out, in] weight in `fmt`.

    method "rtn" is the kernels' round-to-nearest (what every calibration refines); "mse" searches the
    scales (weighted by diag(hessian) when given); "gptq" needs `hessian` (E[x^T x] of the layer's inputs).
    `global_scale` pins NVFP4's per-tensor scale (fused siblings share one: `shared_global_scales`); None:
    from this weight alone. `consume_hessian`: GPTQ may overwrite `hessian` (gptq_quantize)."""
    check_choice("method", method, METHODS)
    fmt = parse_weight_format(fmt, WEIGHT_FORMATS)
    w = w.float()
    codec = weight_format(fmt)
    if not codec.takes_global_scale:
        global_scale = None
    if method == "rtn":
        return codec.quantize(w, granularity, global_scale)
    layout = WeightLayout(fmt, granularity)
    if method == "mse":
        importance = torch.diagonal(hessian).float() if hessian is not None else None
        scales = mse_scales(layout, w, importance, global_scale)
        values = layout.quantize(w, scales)
    else:
        if hessian is None:
            raise KilnError("method='gptq' needs the layer's input Hessian (calibration data)")
        result = gptq_quantize(w, hessian, layout, damping=damping, act_order=act_order, scales="mse",
                               global_scale=global_scale,
                               consume_hessian=consume_hessian)
        values, scales = result.values, result.scales
    return layout.pack(values, scales)


def calibrated_weight(w: torch.Tensor, fmt: str, method: str, hessian: torch.Tensor | None,
                      global_scale: torch.Tensor | None, act_order: bool = True) -> tuple[dict[str, torch.Tensor], str]:
    """(stored tensors, the method actually used) for one [N, K] weight in `fmt` (fp8 per channel, nvfp4,
    mxfp4, mxfp6). `global_scale` pins NVFP4's per-tensor scale. Without a Hessian (a linear that saw no calibration
    token) "gptq" falls back to "mse" on the weights alone and "mse" to unweighted MSE: weight-only
    statistics."""
    layout = WeightLayout(fmt)
    if method == "rtn":
        return dict(layout.codec.quantize(w if layout.codec.takes_global_scale else w.float(), "per_channel",
                                          global_scale)), "rtn"
    if method == "gptq" and hessian is not None:
        result = gptq_quantize(w, hessian, layout, scales="mse", global_scale=global_scale, act_order=act_order)
        return dict(layout.pack(result.values, result.scales)), "gptq"
    importance = torch.diagonal(hessian).float() if hessian is not None else None
    scales = mse_scales(layout, w, importance, global_scale)
    return dict(layout.pack(layout.quantize(w, scales), scales)), "mse" if hessian is not None or method == "mse" \
        else "mse (weight-only)"


def stored_layout(fmt: str, tensors: Mapping[str, torch.Tensor]) -> WeightLayout:
    """The calibration layout of stored tensors in stored format `fmt` (FP8 per tensor when its scale is
    0-dim)."""
    return WeightLayout(fmt, weight_format(fmt).stored_granularity(tensors))


def activation_fake_quantizer(fmt: str, mode: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What the runtime applies to a linear's input, for searches that must see it (static: from x's maximum)."""
    if mode == "none":
        return None
    return weight_format(parse_weight_format(fmt, WEIGHT_FORMATS)).activation_fake_quantizer(mode)


def static_input_scale(fmt: str, absmax: torch.Tensor) -> torch.Tensor:
    """The stored per-tensor activation scale for a calibrated input maximum."""
    return weight_format(parse_weight_format(fmt, WEIGHT_FORMATS)).static_input_scale(absmax)


def shared_global_scales(weights: dict[str, torch.Tensor], keys: dict[str, str]) -> dict[str, torch.Tensor]:
    """NVFP4 per-tensor scale per weight: amax / (6 * 448) over every weight with the same key (fused siblings;
    ModelOpt's export unifies them the same way)."""
    amax: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        m = w.abs().amax().float()
        amax[keys[name]] = torch.maximum(amax[keys[name]], m) if keys[name] in amax else m
    out = {}
    for name in weights:
        # nvfp4_global_scale of a tensor holding only the set's maximum: the same checks and zero handling
        out[name] = nvfp4_global_scale(amax[keys[name]].reshape(1))
    return out
