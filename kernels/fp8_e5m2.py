"""FP8 E5M2 weights (OCP "e5m2", max 57344, IEEE-style infinities and NaN), weight-only, one fp32 scale per output
channel.

E5M2 trades E4M3's third mantissa bit for two more binades: coarser values (relative step 2^-2 instead of 2^-3),
a range wide enough that a weight's outliers never saturate. Kiln runs it weight-only (W8A16): the product is the
dequantized weight times the activations, as for E4M3 without activation quantization.

    scale[n] = max(|w[n, :]|) / 57344          (1.0 where the row is all zero)
    q[n, k]  = cast_e5m2(w[n, k] / scale[n])   (round to nearest even, saturating: clamped to +-57344 first,
                                                since torch's cast turns an overflow into inf)
    w'[n, k] = float(q[n, k]) * scale[n]
Per tensor is the same with one 0-dim scale. Stored as `weight` float8_e5m2 [N, K] and `weight_scale` fp32 [N, 1]
(or 0-dim): the tensor names of FP8 E4M3, which the exporters' layouts do not take for E5M2 (no export writes it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.kernels.formats import ActivationFormat
from kiln.kernels.fp8 import ScaledFp8Codec

E5M2_MAX = 57344.0
FP8_E5M2_DTYPE = torch.float8_e5m2


def _cast_e5m2(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-E5M2_MAX, E5M2_MAX).to(FP8_E5M2_DTYPE)


def _safe_scale(amax: torch.Tensor) -> torch.Tensor:
    scale = amax.float() / E5M2_MAX
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def fp8_e5m2_quantize(w: torch.Tensor, granularity: str = "per_channel") -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] weight -> (float8_e5m2 [N, K], fp32 scale [N, 1] per channel or 0-dim per tensor)."""
    if w.dim() != 2:
        raise ValueError(f"fp8_e5m2 quantization needs a 2-D weight, got shape {tuple(w.shape)}")
    w = w.float()
    amax = w.abs().amax(dim=1, keepdim=True) if granularity == "per_channel" else w.abs().amax()
    scale = _safe_scale(amax)
    return _cast_e5m2(w / scale), scale


def fp8_e5m2_dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float8_e5m2 values times their broadcastable fp32 scale -> fp32."""
    if q.dtype != FP8_E5M2_DTYPE:
        raise TypeError(f"expected {FP8_E5M2_DTYPE}, got {q.dtype}")
    return q.float() * scale.float()


@dataclass(frozen=True)
class Fp8E5M2Weight:
    """An FP8 E5M2 weight as its linear takes it: qweight float8_e5m2 [N, K], weight_scale fp32 [N, 1] or 0-dim."""

    qweight: torch.Tensor
    weight_scale: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        return fp8_e5m2_dequantize(self.qweight, self.weight_scale)


class Fp8E5M2Format(ScaledFp8Codec):
    """FP8 E5M2 weights with an fp32 scale per output channel; weight-only (W8A16)."""

    name = "fp8_e5m2"
    spellings = ("fp8_e5m2",)
    recipe_name = "fp8_e5m2"
    activations = (ActivationFormat.NONE,)
    weight_only = True
    weight_only_targets = ("hopper", "blackwell")  # decoded to BF16 before the product
    grid_max = E5M2_MAX
    storage_dtype = FP8_E5M2_DTYPE
    weight_class = Fp8E5M2Weight

    def quantize(self, w, granularity="per_channel", global_scale=None):
        q, scale = fp8_e5m2_quantize(w, granularity)
        return {"weight": q, "weight_scale": scale}

    def dequantize(self, tensors, in_features=None):
        return fp8_e5m2_dequantize(tensors["weight"], tensors["weight_scale"])

    gpu_kernel = "dequantize"  # W8A16: the weight dequantized in the activations' dtype for each product

    def grid_absmax_scales(self, w, w_padded, granularity, global_scale):
        amax = w.abs().amax(dim=1, keepdim=True) if granularity == "per_channel" else w.abs().amax()
        return self.grid_scales({"weight_scale": _safe_scale(amax)}, granularity, w.shape[0])


FP8_E5M2_FORMAT = Fp8E5M2Format()
