"""NVFP4: E2M1 values, one float8 E4M3 scale per 16 values along K, one float32 scale per tensor.

Storage is NVIDIA ModelOpt's unified Hugging Face export, which vLLM, SGLang and TensorRT-LLM load:
`weight` uint8 [N, Kp/2] (two E2M1 codes a byte, see kernels/fp4.py), `weight_scale` float8_e4m3fn
[N, Kp/16], `weight_scale_2` float32 0-dim, where Kp is K rounded up to a multiple of 16 with zeros.

    quantize(w [N, K]):                                        # all arithmetic in float32
        w = pad K with zeros to Kp
        g = amax(|w|) / (6 * 448)                              # weight_scale_2 (1.0 for an all-zero w)
        for each block b of 16:
            s = amax(|w_b|) / (6 * g)
            s = 1.0 if s == 0 else clamp(s, 2^-9, 448)          # 2^-9: smallest E4M3 subnormal
            s = cast_e4m3(s)                                   # weight_scale, round to nearest even
            codes_b = e2m1_encode(w_b / (float32(s) * g))      # saturates at +-6
        return pack(codes), s, g
    dequantize: value = e2m1 * (float32(s) * g), padding columns dropped

This is ModelOpt's `NVFP4QTensor` arithmetic, operation for operation, except that -0.0 keeps its sign
(code 8, see kernels/fp4.py) and an all-zero weight gets g = 1.0 where ModelOpt would divide by 0.
torchao's `NVFP4Tensor` with per_tensor_scale = g stores the same bytes and dequantizes to the same
floats, except that (a) it floors block scales at 2^-6 (the smallest E4M3 *normal*), so all-zero blocks
get 2^-6 rather than 1.0 and blocks needing a scale below 2^-6 get 2^-6; (b) it computes the block scale
as amax / 6 / g and the element scaling as w * ((1 / g) / s), which round differently from
amax / (6 * g) and w / (s * g) within an ulp of a rounding midpoint. For float32 weights that is rare;
bfloat16 weights often scale to exactly a midpoint (1.75, 3.5, ...), where w / (s * g) ties to the even
code and torchao's reciprocal, an ulp off, picks the odd neighbour. tests/kernels/test_nvfp4.py checks
all of these.

Dequantization rounds s * g once and multiplies by the E2M1 value, as ModelOpt and torchao do; a GEMM
that applies g in its epilogue, after the exact product e2m1 * s, can differ from that by one ulp.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from kiln.kernels.formats import ActivationFormat, WeightFormat
from kiln.kernels.fp4 import (
    E2M1_MAX,
    abs_max,
    blocks_of,
    check_finite_amax,
    check_float_input,
    check_packed_layout,
    check_scale_shape,
    check_tensor,
    check_whole_blocks,
    drop_padding,
    e2m1_decode,
    e2m1_encode,
    pack_fp4,
    pad_last_dim,
    round_up,
    unpack_fp4,
)
from kiln.kernels.weight_codec import StoredTensor, WeightCodec

NVFP4_BLOCK_SIZE = 16
"""Values per E4M3 block scale, along the last (K) dimension."""

E4M3_MAX = 448.0
"""Largest float8_e4m3fn value."""

E4M3_MIN_SUBNORMAL = 2.0**-9
"""Smallest positive float8_e4m3fn value; block scales are floored here so they never round to 0."""

NVFP4_TENSOR_NAMES = ("weight", "weight_scale", "weight_scale_2")
"""Keys of `Nvfp4Weight.tensors()`, as in ModelOpt's export."""


@dataclass(frozen=True)
class Nvfp4Weight:
    """A linear weight [N, K] in NVFP4.

    Attributes:
        packed: uint8 [N, Kp / 2], two E2M1 codes a byte, element 2i in the low nibble.
        block_scale: float8_e4m3fn [N, Kp / 16], non-negative, no NaN.
        global_scale: float32 0-dim, positive and finite.
        in_features: K before padding; Kp = in_features rounded up to a multiple of 16.
    """

    packed: Tensor
    block_scale: Tensor
    global_scale: Tensor
    in_features: int

    def __post_init__(self) -> None:
        padded = padded_in_features(self.in_features) if isinstance(self.in_features, int) else 0
        check_packed_layout(self.packed, self.in_features, padded)
        check_tensor("block_scale", self.block_scale, torch.float8_e4m3fn)
        check_tensor("global_scale", self.global_scale, torch.float32)
        check_scale_shape("block_scale", self.block_scale, (self.packed.shape[0], padded // NVFP4_BLOCK_SIZE))
        _check_block_scale_values(self.block_scale)
        if self.global_scale.ndim != 0:
            raise ValueError(f"global_scale must be 0-dim, got shape {tuple(self.global_scale.shape)}")
        _check_global_scale_value(self.global_scale)

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]

    @property
    def padded_in_features(self) -> int:
        return padded_in_features(self.in_features)

    def tensors(self) -> dict[str, Tensor]:
        """The tensors under ModelOpt's export names: weight, weight_scale, weight_scale_2."""
        return {"weight": self.packed, "weight_scale": self.block_scale, "weight_scale_2": self.global_scale}

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, Tensor], in_features: int) -> Nvfp4Weight:
        """Rebuild from exactly the keys of `tensors()`; a weight_scale_2 of shape [1] is accepted too."""
        keys = set(tensors)
        if keys != set(NVFP4_TENSOR_NAMES):
            raise ValueError(
                f"NVFP4 tensors must have exactly the keys {NVFP4_TENSOR_NAMES}; "
                f"missing {sorted(set(NVFP4_TENSOR_NAMES) - keys)}, "
                f"unexpected {sorted(keys - set(NVFP4_TENSOR_NAMES))}"
            )
        global_scale = tensors["weight_scale_2"]
        if isinstance(global_scale, Tensor) and tuple(global_scale.shape) == (1,):
            global_scale = global_scale.reshape(())
        return cls(
            packed=tensors["weight"],
            block_scale=tensors["weight_scale"],
            global_scale=global_scale,
            in_features=in_features,
        )


def padded_in_features(in_features: int) -> int:
    """`in_features` rounded up to a multiple of the NVFP4 block size (16)."""
    return round_up(in_features, NVFP4_BLOCK_SIZE)


def nvfp4_global_scale(w: Tensor) -> Tensor:
    """Per-tensor scale amax(|w|) / (6 * 448) as a float32 0-dim tensor; 1.0 when w is all zero.

    An all-zero tensor has no natural scale; any positive one gives all-zero codes, and 1.0 keeps
    quantize from dividing by zero.
    """
    check_float_input("w", w, min_ndim=1)
    amax = abs_max(w).float()
    check_finite_amax("w", amax)
    if amax == 0:
        return torch.ones((), dtype=torch.float32, device=w.device)
    return amax / (E2M1_MAX * E4M3_MAX)


def nvfp4_block_scales(w_padded: Tensor, global_scale: Tensor | float) -> Tensor:
    """E4M3 block scales [..., Kp / 16] for `w_padded` [..., Kp] (Kp a multiple of 16) and `global_scale`."""
    check_float_input("w_padded", w_padded, min_ndim=1)
    check_whole_blocks("w_padded", w_padded, NVFP4_BLOCK_SIZE)
    g = _as_global_scale(global_scale, w_padded.device)
    block_amax = abs_max(blocks_of(w_padded.float(), NVFP4_BLOCK_SIZE), dim=-1)
    check_finite_amax("w_padded", block_amax.amax())
    scale = block_amax / (E2M1_MAX * g)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return scale.clamp(min=E4M3_MIN_SUBNORMAL, max=E4M3_MAX).to(torch.float8_e4m3fn)


def nvfp4_quantize(
    w: Tensor, global_scale: Tensor | float | None = None, block_scale: Tensor | None = None
) -> Nvfp4Weight:
    """Quantize a weight [N, K] to NVFP4 (K is padded to a multiple of 16 with zeros).

    Args:
        w: float32/bfloat16/float16 [N, K], finite.
        global_scale: the per-tensor scale g; None computes `nvfp4_global_scale(w)`.
        block_scale: float8_e4m3fn [N, Kp / 16], positive; None computes `nvfp4_block_scales`.
            Explicit scales let a calibration algorithm (e.g. an MSE search) choose them.
    """
    check_float_input("w", w, min_ndim=2)
    if w.ndim != 2:
        raise ValueError(f"w must be a 2-D weight [N, K], got shape {tuple(w.shape)}")
    in_features = w.shape[1]
    w_padded = pad_last_dim(w.float(), padded_in_features(in_features))
    g = nvfp4_global_scale(w) if global_scale is None else _as_global_scale(global_scale, w.device)
    if block_scale is None:
        block_scale = nvfp4_block_scales(w_padded, g)
    else:
        check_tensor("block_scale", block_scale, torch.float8_e4m3fn)
        check_scale_shape("block_scale", block_scale, (w.shape[0], w_padded.shape[1] // NVFP4_BLOCK_SIZE),
                          f" for w of shape {tuple(w.shape)}")
        _check_block_scale_values(block_scale, strictly_positive=True)
        check_finite_amax("w", abs_max(w_padded))
    codes = _encode_blocks(w_padded, block_scale, g)
    return Nvfp4Weight(
        packed=pack_fp4(codes), block_scale=block_scale, global_scale=g, in_features=in_features
    )


def nvfp4_dequantize(q: Nvfp4Weight) -> Tensor:
    """float32 [N, K] (padding columns removed): e2m1 * (float32(block_scale) * global_scale)."""
    if not isinstance(q, Nvfp4Weight):
        raise TypeError(f"q must be an Nvfp4Weight, got {type(q).__name__}")
    values = e2m1_decode(unpack_fp4(q.packed))
    return drop_padding(_scale_blocks(values, q.block_scale, q.global_scale), q.in_features)


def nvfp4_fake_quantize(x: Tensor, global_scale: Tensor | float | None = None) -> Tensor:
    """Quantize `x` [..., K] to NVFP4 along its last dimension and dequantize again, in float32.

    Blocks of 16 run along the last dimension (padded with zeros, then dropped); all leading dimensions
    share one per-tensor scale: `global_scale` when given, else `nvfp4_global_scale(x)`. Equal to
    `nvfp4_dequantize(nvfp4_quantize(x))` for a 2-D x.
    """
    check_float_input("x", x, min_ndim=1)
    in_features = x.shape[-1]
    x_padded = pad_last_dim(x.float(), padded_in_features(in_features))
    g = nvfp4_global_scale(x) if global_scale is None else _as_global_scale(global_scale, x.device)
    block_scale = nvfp4_block_scales(x_padded, g)
    values = e2m1_decode(_encode_blocks(x_padded, block_scale, g))
    return drop_padding(_scale_blocks(values, block_scale, g), in_features)


def _encode_blocks(w_padded: Tensor, block_scale: Tensor, g: Tensor) -> Tensor:
    blocks = blocks_of(w_padded, NVFP4_BLOCK_SIZE)  # [..., Kp/16, 16]
    scaled = blocks / (block_scale.float() * g).unsqueeze(-1)
    return e2m1_encode(scaled).reshape(w_padded.shape)


def _scale_blocks(values: Tensor, block_scale: Tensor, g: Tensor) -> Tensor:
    blocks = blocks_of(values, NVFP4_BLOCK_SIZE)  # [..., Kp/16, 16]
    return (blocks * (block_scale.float() * g).unsqueeze(-1)).reshape(values.shape)


def _as_global_scale(global_scale: Tensor | float, device: torch.device) -> Tensor:
    if isinstance(global_scale, Tensor):
        if global_scale.numel() != 1:
            raise ValueError(f"global_scale must be a scalar, got shape {tuple(global_scale.shape)}")
        if not global_scale.dtype.is_floating_point:
            raise TypeError(f"global_scale must be a float tensor, got {global_scale.dtype}")
        g = global_scale.detach().reshape(()).to(device=device, dtype=torch.float32)
    elif isinstance(global_scale, (int, float)) and not isinstance(global_scale, bool):
        g = torch.tensor(float(global_scale), dtype=torch.float32, device=device)
    else:
        raise TypeError(f"global_scale must be a float or a scalar tensor, got {type(global_scale).__name__}")
    _check_global_scale_value(g)
    return g


def _check_global_scale_value(g: Tensor) -> None:
    value = float(g)
    if not (value > 0 and value != float("inf")):
        raise ValueError(f"global_scale must be positive and finite, got {value}")


def _check_block_scale_values(block_scale: Tensor, strictly_positive: bool = False) -> None:
    scale = block_scale.float()
    if torch.isnan(scale).any():
        raise ValueError("block_scale contains NaN")
    smallest = float(scale.min()) if scale.numel() else 1.0
    if smallest < 0 or (strictly_positive and smallest == 0):
        allowed = "positive" if strictly_positive else "non-negative"
        raise ValueError(f"block_scale must be {allowed}, got a minimum of {smallest}")


# --- the format object ---------------------------------------------------------------------------------------------

class Nvfp4Format(WeightCodec):
    """NVFP4 weights (E2M1 codes, E4M3 scale per 16, fp32 per tensor); W4A16, or W4A4 with NVFP4 activations."""

    name = WeightFormat.NVFP4
    spellings = ("nvfp4",)
    recipe_name = "nvfp4"
    tensor_names = NVFP4_TENSOR_NAMES
    blocked = True
    bits_per_weight = 4.5
    activations = (ActivationFormat.NONE, ActivationFormat.NVFP4)
    takes_global_scale = True
    weight_only_targets = ("hopper", "blackwell")  # Hopper: no FP4 tensor cores, decoded in the GEMM
    weight_activation_targets = ("blackwell",)

    def quantize(self, w, granularity="per_channel", global_scale=None):
        return nvfp4_quantize(w, global_scale=global_scale).tensors()

    def dequantize(self, tensors, in_features=None):
        return nvfp4_dequantize(Nvfp4Weight.from_tensors({k: tensors[k] for k in NVFP4_TENSOR_NAMES},
                                                         in_features=in_features))

    def stored_tensors(self, out, in_features, weight_shape):
        if out is None:
            return tuple(StoredTensor(k) for k in NVFP4_TENSOR_NAMES)
        padded = padded_in_features(in_features)
        return (StoredTensor("weight", "packed FP4 codes", (torch.uint8,), ((out, padded // 2),), shape_first=True),
                StoredTensor("weight_scale", "its block scales", (torch.float8_e4m3fn,),
                             ((out, padded // NVFP4_BLOCK_SIZE),), shape_first=True),
                StoredTensor("weight_scale_2", "its global scale", (torch.float32,), ((), (1,)), shape_first=True))

    def stored_bytes(self, out, in_features, recorded_in_features=None):
        padded = max(recorded_in_features or 0, padded_in_features(in_features))
        return out * padded // 2 + out * padded // NVFP4_BLOCK_SIZE + 4  # codes, E4M3 per 16, fp32 global scale

    def activation_format(self, mode):
        # block scales are always dynamic; "static" calibrates the per-tensor activation scale
        return ActivationFormat.NONE if mode == "none" else ActivationFormat.NVFP4

    def activation_fake_quantizer(self, mode):
        return nvfp4_fake_quantize

    def static_input_scale(self, absmax):
        scale = absmax.float() / (E2M1_MAX * E4M3_MAX)
        return torch.where(scale > 0, scale, torch.ones_like(scale)).reshape(())

    def packed_weight(self, tensors, in_features):
        return Nvfp4Weight.from_tensors(tensors, in_features)

    gpu_kernel = "fp4"

    def grid_block_size(self, in_features):
        return NVFP4_BLOCK_SIZE

    def grid_round_(self, scaled):
        return scaled.copy_(e2m1_decode(e2m1_encode(scaled)))

    def grid_absmax_scales(self, w, w_padded, granularity, global_scale):
        g = nvfp4_global_scale(w) if global_scale is None else global_scale.float().reshape(())
        return self.grid_scales({"weight_scale": nvfp4_block_scales(w_padded, g), "weight_scale_2": g},
                                granularity, None)

    def grid_scales(self, stored, granularity, rows):
        g = stored["weight_scale_2"].float().reshape(())
        return stored["weight_scale"].float() * g, {"weight_scale": stored["weight_scale"], "weight_scale_2": g}

    def grid_pack(self, values, stored_scales):
        return nvfp4_quantize(values, global_scale=stored_scales["weight_scale_2"],
                              block_scale=stored_scales["weight_scale"]).tensors()

    gptq_act_order_default = False
    coarse_grid = True
    element_bits = 4
    scaled_activations = (ActivationFormat.NVFP4,)  # the global scale (optional: else from each activation)
    export_names: ClassVar[dict] = {"compressed-tensors": "nvfp4",
                    "hf-modelopt": {"none": "W4A16_NVFP4", "nvfp4+input_scale": "NVFP4"},
                    "onnx": "FLOAT4E2M1+FLOAT8E4M3FN"}


NVFP4_FORMAT = Nvfp4Format()
