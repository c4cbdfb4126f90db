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
from kiln.kernels.weight_codec import StoredTensor, WeightCodec

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


class Fp8E5M2Format(WeightCodec):
    """FP8 E5M2 weights with an fp32 scale per output channel; weight-only (W8A16)."""

    name = "fp8_e5m2"
    spellings = ("fp8_e5m2",)
    recipe_name = "fp8_e5m2"
    tensor_names = ("weight", "weight_scale")
    bits_per_weight = 8.0
    activations = (ActivationFormat.NONE,)
    weight_only = True
    weight_only_targets = ("hopper", "blackwell")  # decoded to BF16 before the product
    grid_max = E5M2_MAX

    def quantize(self, w, granularity="per_channel", global_scale=None):
        q, scale = fp8_e5m2_quantize(w, granularity)
        return {"weight": q, "weight_scale": scale}

    def dequantize(self, tensors, in_features=None):
        return fp8_e5m2_dequantize(tensors["weight"], tensors["weight_scale"])

    def stored_tensors(self, out, in_features, weight_shape):
        rows = out if out is not None else weight_shape[0]
        weight = (StoredTensor("weight", "an fp8_e5m2 weight", (FP8_E5M2_DTYPE,), ((out, in_features),))
                  if out is not None else StoredTensor("weight", "an fp8_e5m2 weight", (FP8_E5M2_DTYPE,), ndim=2))
        return weight, StoredTensor("weight_scale", "an FP8 weight scale", (), ((), (1,), (rows, 1)))

    def stored_bytes(self, out, in_features, recorded_in_features=None):
        return in_features * out + 4 * out  # E5M2 values + an fp32 scale per output channel

    def stored_granularity(self, tensors):
        return "per_tensor" if tensors["weight_scale"].ndim == 0 else "per_channel"

    def packed_weight(self, tensors, in_features):
        scale = tensors["weight_scale"].float()
        return Fp8E5M2Weight(tensors["weight"], scale.reshape(()) if scale.numel() == 1 else scale)

    gpu_kernel = "dequantize"  # W8A16: the weight dequantized in the activations' dtype for each product

    def grid_round_(self, scaled):
        scaled.clamp_(-E5M2_MAX, E5M2_MAX)
        return scaled.copy_(scaled.to(FP8_E5M2_DTYPE))

    def grid_absmax_scales(self, w, w_padded, granularity, global_scale):
        amax = w.abs().amax(dim=1, keepdim=True) if granularity == "per_channel" else w.abs().amax()
        return self.grid_scales({"weight_scale": _safe_scale(amax)}, granularity, w.shape[0])

    def grid_scales(self, stored, granularity, rows):
        scale = stored["weight_scale"].float()
        if granularity == "per_tensor":
            scale = scale.reshape(())
            return scale.expand(rows if rows is not None else 1, 1).clone(), {"weight_scale": scale}
        return scale.reshape(-1, 1), {"weight_scale": scale.reshape(-1, 1)}

    def grid_pack(self, values, stored_scales):
        scale = stored_scales["weight_scale"]
        return {"weight": _cast_e5m2(values / scale), "weight_scale": scale}


FP8_E5M2_FORMAT = Fp8E5M2Format()
