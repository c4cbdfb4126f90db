"""FP8 E4M3 (OCP "e4m3fn", max 448, no infinities) quantization references.

Weights, per output channel (rows of an [N, K] weight):
    scale[n] = max(|w[n, :]|) / 448            (1.0 where the row is all zero)
    q[n, k]  = cast_e4m3(w[n, k] / scale[n])   (round to nearest even, saturating; torch's cast)
    w'[n, k] = float(q[n, k]) * scale[n]
Per tensor is the same with one scale. Activations are quantized dynamically per token (one scale per row
of the flattened input) or statically with a calibrated per-tensor scale; both are fake-quantized here
(quantize, then dequantize to fp32), which is exactly what an FP8 GEMM with fp32 accumulation sees.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kiln.kernels.formats import ActivationFormat, WeightFormat
from kiln.kernels.weight_codec import StoredTensor, WeightCodec

E4M3_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn


def _cast_e4m3(x: torch.Tensor) -> torch.Tensor:
    # torch's cast does not saturate (overflow becomes NaN), so clamp first.
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)


def _safe_scale(amax: torch.Tensor) -> torch.Tensor:
    scale = amax.float() / E4M3_MAX
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def fp8_scale_per_channel(w: torch.Tensor) -> torch.Tensor:
    """[N, K] weight -> its per-channel fp32 scale [N, 1] (row maximum onto 448; 1.0 for an all-zero row)."""
    if w.dim() != 2:
        raise ValueError(f"fp8 per-channel quantization needs a 2-D weight, got shape {tuple(w.shape)}")
    return _safe_scale(w.float().abs().amax(dim=1, keepdim=True))


def fp8_scale_per_tensor(w: torch.Tensor) -> torch.Tensor:
    """Any-shape tensor -> its fp32 0-dim scale (maximum onto 448; 1.0 when all zero)."""
    return _safe_scale(w.float().abs().amax())


def fp8_quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] weight -> (float8_e4m3fn [N, K], fp32 scale [N, 1])."""
    scale = fp8_scale_per_channel(w)
    return _cast_e4m3(w.float() / scale), scale


def fp8_quantize_per_tensor(w: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Any-shape tensor -> (float8_e4m3fn, fp32 0-dim scale). A given scale is used as is (static)."""
    w = w.float()
    if scale is None:
        scale = fp8_scale_per_tensor(w)
    scale = scale.float().reshape(())
    return _cast_e4m3(w / scale), scale


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float8 values times their broadcastable fp32 scale -> fp32."""
    if q.dtype != FP8_DTYPE:
        raise TypeError(f"expected {FP8_DTYPE}, got {q.dtype}")
    return q.float() * scale.float()


def fp8_fake_quantize_per_token(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-token activation quantization: one scale per row of the last dim, then back to fp32."""
    scale = _safe_scale(x.abs().amax(dim=-1, keepdim=True))
    return _cast_e4m3(x.float() / scale).float() * scale


def fp8_fake_quantize_per_tensor(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Static activation quantization with a calibrated per-tensor scale, then back to fp32."""
    q, scale = fp8_quantize_per_tensor(x, scale)
    return q.float() * scale


# --- block-scaled FP8 weights (DeepSeek-V3, Qwen3-FP8, transformers' "fp8" quant_method) -------------------------
#
# One scale per [bm, bn] block of an [N, K] weight; edge blocks are partial when bm or bn does not divide N or K
# (the scale grid is [ceil(N / bm), ceil(K / bn)]). The checkpoint stores the scale as `weight_scale_inv`, the
# factor that *multiplies* the FP8 value (DeepSeek-V3's inference/kernel.py weight_dequant and transformers'
# Fp8Dequantize both compute q * s):
#     s[i, j]  = max(|w[block i, j]|) / 448     (1.0 where the block is all zero)
#     q        = cast_e4m3(w / s[block])
#     w'[n, k] = float(q[n, k]) * s[n // bm, k // bn]


def _block_args(shape: tuple[int, ...], block_size) -> tuple[int, int]:
    if len(shape) != 2:
        raise ValueError(f"block-scaled fp8 needs a 2-D weight, got shape {tuple(shape)}")
    if (not isinstance(block_size, (tuple, list)) or len(block_size) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block_size)):
        raise ValueError(f"block_size must be two positive integers, got {block_size!r}")
    return int(block_size[0]), int(block_size[1])


def fp8_block_scale_shape(shape: tuple[int, ...], block_size) -> tuple[int, int]:
    """The scale grid of an [N, K] weight in [bm, bn] blocks: (ceil(N / bm), ceil(K / bn))."""
    bm, bn = _block_args(tuple(shape), block_size)
    return -(-int(shape[0]) // bm), -(-int(shape[1]) // bn)


def fp8_quantize_blocks(w: torch.Tensor, block_size) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] weight -> (float8_e4m3fn [N, K], fp32 scale [ceil(N / bm), ceil(K / bn)]) as DeepSeek-V3 stores it."""
    bm, bn = _block_args(tuple(w.shape), block_size)
    rows, cols = fp8_block_scale_shape(tuple(w.shape), (bm, bn))
    w = w.float()
    padded = torch.zeros(rows * bm, cols * bn)  # zero padding leaves a partial block's max unchanged
    padded[: w.shape[0], : w.shape[1]] = w
    blocks = padded.reshape(rows, bm, cols, bn)
    scale = _safe_scale(blocks.abs().amax(dim=(1, 3)))
    q = _cast_e4m3(blocks / scale[:, None, :, None]).reshape(rows * bm, cols * bn)
    return q[: w.shape[0], : w.shape[1]].contiguous(), scale


def fp8_block_dequantize(q: torch.Tensor, scale: torch.Tensor, block_size) -> torch.Tensor:
    """float8_e4m3fn [N, K] times its per-block scale (any float dtype, e.g. fp32 or UE8M0) -> fp32 [N, K].

    Works one block row at a time, so the only temporary beside the result is one [bm, K] slice."""
    if q.dtype != FP8_DTYPE:
        raise TypeError(f"expected {FP8_DTYPE}, got {q.dtype}")
    bm, bn = _block_args(tuple(q.shape), block_size)
    grid = fp8_block_scale_shape(tuple(q.shape), (bm, bn))
    if not scale.is_floating_point():
        raise TypeError(f"block scales must be floating point, got {scale.dtype}")
    if tuple(scale.shape) != grid:
        raise ValueError(f"block scales of a {tuple(q.shape)} weight in {bm}x{bn} blocks must have shape {grid}, "
                         f"got {tuple(scale.shape)}")
    n, k = q.shape
    per_column = scale.float().repeat_interleave(bn, dim=1)[:, :k]  # [rows, K]: each block row's scale per column
    out = torch.empty(n, k, dtype=torch.float32, device=q.device)
    for i in range(grid[0]):
        rows = slice(i * bm, min((i + 1) * bm, n))
        torch.mul(q[rows].float(), per_column[i], out=out[rows])
    return out


# --- the format object ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Fp8Weight:
    """An FP8 E4M3 linear weight as the GEMM takes it: qweight float8_e4m3fn [N, K], weight_scale fp32 [N, 1] or
    0-dim."""

    qweight: torch.Tensor
    weight_scale: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        return fp8_dequantize(self.qweight, self.weight_scale)


class ScaledFp8Codec(WeightCodec):
    """What FP8 weights with an fp32 scale per output channel ([N, 1]) or per tensor (0-dim) share, whatever
    their element type: the stored layout, the packed weight and the calibration grid. A subclass names the
    element (`storage_dtype`, `grid_max`) and the packed weight's class (`weight_class`)."""

    tensor_names = ("weight", "weight_scale")
    bits_per_weight = 8.0
    storage_dtype: torch.dtype
    weight_class: type

    def stored_tensors(self, out, in_features, weight_shape):
        rows = out if out is not None else weight_shape[0]
        what = f"an {self.name} weight"
        weight = (StoredTensor("weight", what, (self.storage_dtype,), ((out, in_features),))
                  if out is not None else StoredTensor("weight", what, (self.storage_dtype,), ndim=2))
        return weight, StoredTensor("weight_scale", "an FP8 weight scale", (), ((), (1,), (rows, 1)))

    def stored_bytes(self, out, in_features, recorded_in_features=None):
        return in_features * out + 4 * out  # FP8 values + an fp32 scale per output channel

    def stored_granularity(self, tensors):
        return "per_tensor" if tensors["weight_scale"].ndim == 0 else "per_channel"

    def packed_weight(self, tensors, in_features):
        scale = tensors["weight_scale"].float()
        return self.weight_class(tensors["weight"], scale.reshape(()) if scale.numel() == 1 else scale)

    def grid_round_(self, scaled):
        scaled.clamp_(-self.grid_max, self.grid_max)
        return scaled.copy_(scaled.to(self.storage_dtype))

    def grid_scales(self, stored, granularity, rows):
        scale = stored["weight_scale"].float()
        if granularity == "per_tensor":
            scale = scale.reshape(())
            return scale.expand(rows if rows is not None else 1, 1).clone(), {"weight_scale": scale}
        return scale.reshape(-1, 1), {"weight_scale": scale.reshape(-1, 1)}

    def grid_pack(self, values, stored_scales):
        scale = stored_scales["weight_scale"]
        weight = (values / scale).clamp(-self.grid_max, self.grid_max).to(self.storage_dtype)
        return {"weight": weight, "weight_scale": scale}

    element_bits = 8
    per_tensor_weight_scale = True  # granularity per_tensor stores one 0-dim scale, for E4M3 and E5M2 alike


class Fp8E4M3Format(ScaledFp8Codec):
    """FP8 E4M3 weights with an fp32 scale per output channel ([N, 1]) or per tensor (0-dim); W8A16, or W8A8 with
    activations quantized per token (dynamic) or with a calibrated per-tensor scale (static)."""

    name = WeightFormat.FP8_E4M3
    spellings = ("fp8", "fp8_e4m3")
    recipe_name = "fp8"
    storage_dtype = FP8_DTYPE
    weight_class = Fp8Weight
    weight_only_targets = ("hopper", "blackwell")
    weight_activation_targets = ("hopper", "blackwell")
    activations = (ActivationFormat.NONE, ActivationFormat.FP8_DYNAMIC_PER_TOKEN,
                   ActivationFormat.FP8_STATIC_PER_TENSOR)

    def quantize(self, w: torch.Tensor, granularity: str = "per_channel",
                 global_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        q, scale = fp8_quantize_per_channel(w) if granularity == "per_channel" else fp8_quantize_per_tensor(w)
        return {"weight": q, "weight_scale": scale}

    def dequantize(self, tensors, in_features=None) -> torch.Tensor:
        return fp8_dequantize(tensors["weight"], tensors["weight_scale"])

    def activation_format(self, mode):
        if mode == "none":
            return ActivationFormat.NONE
        return ActivationFormat.FP8_DYNAMIC_PER_TOKEN if mode == "dynamic" else ActivationFormat.FP8_STATIC_PER_TENSOR

    def activation_fake_quantizer(self, mode):
        if mode == "dynamic":
            return fp8_fake_quantize_per_token
        return lambda x: fp8_fake_quantize_per_tensor(x, _positive_0dim(x.abs().amax() / E4M3_MAX))

    def static_input_scale(self, absmax):
        return _positive_0dim(absmax.float() / E4M3_MAX)

    gpu_kernel = "fp8"  # W8A8: the FP8 GEMM; W8A16: the weight dequantized for each product

    grid_max = E4M3_MAX

    def grid_absmax_scales(self, w, w_padded, granularity, global_scale):
        if granularity == "per_channel":
            scale = fp8_scale_per_channel(w)
            return scale.reshape(-1, 1), {"weight_scale": scale}
        return self.grid_scales({"weight_scale": fp8_scale_per_tensor(w)}, granularity, w.shape[0])

    absmax_ranks_like_mse = True
    scaled_activations = (ActivationFormat.FP8_STATIC_PER_TENSOR,)
    export_names: ClassVar[dict] = {
        "compressed-tensors": {"per_tensor": "fp8_tensor", "per_channel": "fp8_channel"},
        "hf-modelopt": {"fp8_static_per_tensor+per_tensor": "FP8",
                        "fp8_dynamic_per_token+per_channel": "FP8_PER_CHANNEL_PER_TOKEN"},
        "onnx": "FLOAT8E4M3FN",
    }
    export_refusals: ClassVar[dict] = {"hf-modelopt none": "FP8 weight-only (W8A16) has no ModelOpt unified-checkpoint algorithm; "
                                           "export it with --format compressed-tensors, which vLLM also loads"}


def _positive_0dim(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale > 0, scale, torch.ones_like(scale)).reshape(())


FP8_E4M3_FORMAT = Fp8E4M3Format()
