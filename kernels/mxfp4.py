"""MXFP4 (OCP Microscaling v1.0): E2M1 values, one E8M0 power-of-two scale per 32 values along K.

Storage: `weight` uint8 [N, Kp/2] (two E2M1 codes a byte, see kernels/fp4.py) and `weight_scale` uint8
[N, Kp/32] holding the biased E8M0 exponent (scale = 2^(e - 127); 255 is NaN and never produced), where
Kp is K rounded up to a multiple of 32 with zeros.

    quantize(w [N, K]):                                        # all arithmetic in float32
        w = pad K with zeros to Kp
        for each block b of 32:
            amax = max(|w_b|)
            e = floor(log2(amax)) - 2                          # 2 = floor(log2(6)), E2M1's top exponent;
                                                               #   read off amax's float32 exponent field,
                                                               #   which gives -127 for 0 and subnormals
            e = max(e, -127)                                   # weight_scale = e + 127
            codes_b = e2m1_encode(w_b / 2^e)                   # |w_b / 2^e| < 8: values in (6, 8) saturate
        return pack(codes), e + 127
    dequantize: value = e2m1 * 2^e, padding columns dropped

This is torchao's `to_mx` in its default ScaleCalculationMode.FLOOR, bit for bit, with one exception:
for scale code 0 (2^-127, a float32 subnormal; only blocks with amax < 2^-124) torchao divides by 2^-126
when quantizing while still multiplying by 2^-127 when dequantizing. Kiln uses 2^-127 both ways, so
quantize(dequantize(q)) == q holds for every block. tests/kernels/test_mxfp4.py checks both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from kiln.kernels.formats import ActivationFormat, WeightFormat
from kiln.kernels.fp4 import (
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

MXFP4_BLOCK_SIZE = 32
"""Values per E8M0 block scale, along the last (K) dimension."""

E8M0_BIAS = 127
"""A biased E8M0 code e means the scale 2^(e - 127)."""

E8M0_NAN = 255
"""The E8M0 NaN code; rejected as a scale."""

E2M1_MAX_EXPONENT = 2
"""floor(log2(6)): the exponent of E2M1's largest power of two (4)."""

MXFP4_TENSOR_NAMES = ("weight", "weight_scale")
"""Keys of `Mxfp4Weight.tensors()`."""

_FLOAT32_MANTISSA_BITS = 23
_FLOAT32_SUBNORMAL_2_POW_MINUS_127 = 0x00400000  # the float32 bit pattern of 2^-127


@dataclass(frozen=True)
class Mxfp4Weight:
    """A linear weight [N, K] in MXFP4.

    Attributes:
        packed: uint8 [N, Kp / 2], two E2M1 codes a byte, element 2i in the low nibble.
        scale_e8m0: uint8 [N, Kp / 32], biased exponents 0..254 (scale = 2^(e - 127)).
        in_features: K before padding; Kp = in_features rounded up to a multiple of 32.
    """

    packed: Tensor
    scale_e8m0: Tensor
    in_features: int

    def __post_init__(self) -> None:
        padded = padded_in_features(self.in_features) if isinstance(self.in_features, int) else 0
        check_packed_layout(self.packed, self.in_features, padded)
        check_tensor("scale_e8m0", self.scale_e8m0, torch.uint8)
        check_scale_shape("scale_e8m0", self.scale_e8m0, (self.packed.shape[0], padded // MXFP4_BLOCK_SIZE))
        check_e8m0_codes(self.scale_e8m0)

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]

    @property
    def padded_in_features(self) -> int:
        return padded_in_features(self.in_features)

    def tensors(self) -> dict[str, Tensor]:
        """The tensors under their export names: weight (packed codes), weight_scale (E8M0 as uint8)."""
        return {"weight": self.packed, "weight_scale": self.scale_e8m0}

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, Tensor], in_features: int) -> Mxfp4Weight:
        """Rebuild from exactly the keys of `tensors()`."""
        keys = set(tensors)
        if keys != set(MXFP4_TENSOR_NAMES):
            raise ValueError(
                f"MXFP4 tensors must have exactly the keys {MXFP4_TENSOR_NAMES}; "
                f"missing {sorted(set(MXFP4_TENSOR_NAMES) - keys)}, "
                f"unexpected {sorted(keys - set(MXFP4_TENSOR_NAMES))}"
            )
        return cls(packed=tensors["weight"], scale_e8m0=tensors["weight_scale"], in_features=in_features)


def padded_in_features(in_features: int) -> int:
    """`in_features` rounded up to a multiple of the MXFP4 block size (32)."""
    return round_up(in_features, MXFP4_BLOCK_SIZE)


def mxfp4_block_scales(w_padded: Tensor) -> Tensor:
    """Biased E8M0 scales uint8 [..., Kp / 32] for `w_padded` [..., Kp] (Kp a multiple of 32)."""
    check_float_input("w_padded", w_padded, min_ndim=1)
    check_whole_blocks("w_padded", w_padded, MXFP4_BLOCK_SIZE)
    block_amax = abs_max(blocks_of(w_padded.float(), MXFP4_BLOCK_SIZE), dim=-1).contiguous()
    check_finite_amax("w_padded", block_amax)
    # The float32 exponent field is floor(log2(amax)) + 127 for a normal amax, and 0 for 0 or a subnormal.
    biased_floor_log2 = (block_amax.view(torch.int32) >> _FLOAT32_MANTISSA_BITS) & 0xFF
    return (biased_floor_log2 - E2M1_MAX_EXPONENT).clamp(min=0).to(torch.uint8)


def mxfp4_quantize(w: Tensor, scale_e8m0: Tensor | None = None) -> Mxfp4Weight:
    """Quantize a weight [N, K] to MXFP4 (K is padded to a multiple of 32 with zeros).

    Args:
        w: float32/bfloat16/float16 [N, K], finite.
        scale_e8m0: uint8 [N, Kp / 32] biased exponents (0..254); None computes `mxfp4_block_scales`.
    """
    w_padded, scale_e8m0 = mx_padded_weight_and_scales(w, scale_e8m0)
    codes = _encode_blocks(w_padded, scale_e8m0)
    return Mxfp4Weight(packed=pack_fp4(codes), scale_e8m0=scale_e8m0, in_features=w.shape[1])


def mx_padded_weight_and_scales(w: Tensor, scale_e8m0: Tensor | None) -> tuple[Tensor, Tensor]:
    """The checked 2-D weight [N, K] in fp32 padded with zeros to Kp (a multiple of 32), and its E8M0 block
    scales [N, Kp / 32]: `scale_e8m0` checked, or the absmax exponents when None (every MX format: MXFP6 too)."""
    check_float_input("w", w, min_ndim=2)
    if w.ndim != 2:
        raise ValueError(f"w must be a 2-D weight [N, K], got shape {tuple(w.shape)}")
    w_padded = pad_last_dim(w.float(), padded_in_features(w.shape[1]))
    if scale_e8m0 is None:
        return w_padded, mxfp4_block_scales(w_padded)
    check_tensor("scale_e8m0", scale_e8m0, torch.uint8)
    check_scale_shape("scale_e8m0", scale_e8m0, (w.shape[0], w_padded.shape[1] // MXFP4_BLOCK_SIZE),
                      f" for w of shape {tuple(w.shape)}")
    check_e8m0_codes(scale_e8m0)
    check_finite_amax("w", abs_max(w_padded))
    return w_padded, scale_e8m0


def mxfp4_dequantize(q: Mxfp4Weight) -> Tensor:
    """float32 [N, K] (padding columns removed): e2m1 * 2^(scale_e8m0 - 127)."""
    if not isinstance(q, Mxfp4Weight):
        raise TypeError(f"q must be an Mxfp4Weight, got {type(q).__name__}")
    values = e2m1_decode(unpack_fp4(q.packed))
    return drop_padding(_scale_blocks(values, q.scale_e8m0), q.in_features)


def mxfp4_fake_quantize(x: Tensor) -> Tensor:
    """Quantize `x` [..., K] to MXFP4 along its last dimension and dequantize again, in float32.

    Equal to `mxfp4_dequantize(mxfp4_quantize(x))` for a 2-D x.
    """
    check_float_input("x", x, min_ndim=1)
    in_features = x.shape[-1]
    x_padded = pad_last_dim(x.float(), padded_in_features(in_features))
    scale_e8m0 = mxfp4_block_scales(x_padded)
    values = e2m1_decode(_encode_blocks(x_padded, scale_e8m0))
    return drop_padding(_scale_blocks(values, scale_e8m0), in_features)


def e8m0_to_float32(scale_e8m0: Tensor) -> Tensor:
    """Exact float32 2^(e - 127) for biased E8M0 codes 0..254 (code 0 is the subnormal 2^-127)."""
    check_tensor("scale_e8m0", scale_e8m0, torch.uint8)
    codes = scale_e8m0.to(torch.int32)
    bits = torch.where(codes == 0, _FLOAT32_SUBNORMAL_2_POW_MINUS_127, codes << _FLOAT32_MANTISSA_BITS)
    return bits.view(torch.float32)


def _encode_blocks(w_padded: Tensor, scale_e8m0: Tensor) -> Tensor:
    blocks = blocks_of(w_padded, MXFP4_BLOCK_SIZE)  # [..., Kp/32, 32]
    scaled = blocks / e8m0_to_float32(scale_e8m0).unsqueeze(-1)
    return e2m1_encode(scaled).reshape(w_padded.shape)


def _scale_blocks(values: Tensor, scale_e8m0: Tensor) -> Tensor:
    blocks = blocks_of(values, MXFP4_BLOCK_SIZE)  # [..., Kp/32, 32]
    return (blocks * e8m0_to_float32(scale_e8m0).unsqueeze(-1)).reshape(values.shape)


def check_e8m0_codes(scale_e8m0: Tensor) -> None:
    if scale_e8m0.numel() and int(scale_e8m0.max()) == E8M0_NAN:
        raise ValueError(f"scale_e8m0 must hold exponents 0..254; {E8M0_NAN} is the E8M0 NaN")


# --- the format object ---------------------------------------------------------------------------------------------

class Mxfp4Format(WeightCodec):
    """MXFP4 weights (E2M1 codes, E8M0 scale per 32); W4A16, or W4A4 with MXFP4 activations."""

    name = WeightFormat.MXFP4
    spellings = ("mxfp4",)
    recipe_name = "mxfp4"
    tensor_names = MXFP4_TENSOR_NAMES
    blocked = True
    bits_per_weight = 4.25
    activations = (ActivationFormat.NONE, ActivationFormat.MXFP4)
    weight_only_targets = ("hopper", "blackwell")  # Hopper: no FP4 tensor cores, decoded in the GEMM
    weight_activation_targets = ("blackwell",)
    element_bits = 4
    element_what = "packed FP4 codes"
    # the MX formats differ only in their elements: MXFP6 (kernels/mxfp6.py) subclasses this with its own
    weight_class = Mxfp4Weight
    _quantize = staticmethod(mxfp4_quantize)
    _dequantize = staticmethod(mxfp4_dequantize)

    def quantize(self, w, granularity="per_channel", global_scale=None):
        return self.grid_pack(w, {})

    def dequantize(self, tensors, in_features=None):
        return self._dequantize(self.packed_weight({k: tensors[k] for k in self.tensor_names}, in_features))

    def stored_tensors(self, out, in_features, weight_shape):
        if out is None:
            return tuple(StoredTensor(k) for k in self.tensor_names)
        padded = padded_in_features(in_features)
        return (StoredTensor("weight", self.element_what, (torch.uint8,), ((out, padded * self.element_bits // 8),),
                             shape_first=True),
                StoredTensor("weight_scale", "its block scales", (torch.uint8,), ((out, padded // MXFP4_BLOCK_SIZE),),
                             shape_first=True))

    def stored_bytes(self, out, in_features, recorded_in_features=None):
        padded = max(recorded_in_features or 0, padded_in_features(in_features))
        return out * padded * self.element_bits // 8 + out * padded // MXFP4_BLOCK_SIZE  # codes, E8M0 per 32

    def activation_format(self, mode):
        return ActivationFormat.NONE if mode == "none" else ActivationFormat.MXFP4

    def activation_fake_quantizer(self, mode):
        return mxfp4_fake_quantize

    def packed_weight(self, tensors, in_features):
        return self.weight_class.from_tensors(tensors, in_features)

    gpu_kernel = "fp4"

    def grid_block_size(self, in_features):
        return MXFP4_BLOCK_SIZE

    def grid_round_(self, scaled):
        return scaled.copy_(e2m1_decode(e2m1_encode(scaled)))

    def grid_absmax_scales(self, w, w_padded, granularity, global_scale):
        return self.grid_scales({"weight_scale": mxfp4_block_scales(w_padded)}, granularity, None)

    def grid_scales(self, stored, granularity, rows):
        return e8m0_to_float32(stored["weight_scale"]), {"weight_scale": stored["weight_scale"]}

    def grid_pack(self, values, stored_scales):
        return self._quantize(values, scale_e8m0=stored_scales.get("weight_scale")).tensors()

    static_activation_refusal = "its E8M0 block scales are always dynamic"
    coarse_grid = True
    power_of_two_block_scales = True
    export_names: ClassVar[dict] = {"compressed-tensors": "mxfp4", "hf-modelopt": {"none": "mxfp4", "mxfp4": "mxfp4"},
                    "onnx": "FLOAT4E2M1+E8M0"}


MXFP4_FORMAT = Mxfp4Format()
