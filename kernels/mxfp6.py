"""MXFP6 (OCP Microscaling v1.0, FP6 E2M3 elements): one E8M0 power-of-two scale per 32 values along K.

Kiln runs it weight-only (W6A16): the GEMM decodes the codes to BF16 in the kernel (kernels/triton_fp6_gemm.py),
as Hopper runs FP4 weights; Blackwell's tensor cores also take it natively (tcgen05 `kind::f8f6f4`). Between
NVFP4 (4.5 bits a weight) and FP8 (8 bits and a scale per row) it stores 6.25 bits a weight with FP8-like error
on weights: E2M3 has FP8 E4M3's three mantissa bits, and a scale per 32 values instead of per row.

E2M3 element (6 bits: sign | exponent, 2 bits, bias 1 | mantissa, 3 bits); no inf, no NaN:

    code & 31 = 8e + m:  e = 0: m / 8 (subnormal: 0, 0.125 .. 0.875)     e >= 1: 2^(e-1) (1 + m / 8)
    largest 7.5 (code 31); code & 32 is the sign

    e2m3_encode(x):                    # round to nearest, ties to even code, saturate at 7.5
        k = clamp(floor(log2 |x|), 0, 2)                # from frexp: exact
        code = min(8k + round_half_even(|x| * 2^(3 - k)), 31)
        code |= signbit(x) << 5        # -0.0 keeps its sign: code 32
A mantissa that rounds up to 8 carries into the exponent (code 8k + 8 is 2^(k+1)), and an even code is an
even mantissa, so this is IEEE round-to-nearest-even onto the E2M3 values: torchao's `f32_to_f6_e2m3_unpacked`
bit for bit (tests/kernels/test_mxfp6.py).

Storage: `weight` uint8 [N, Kp * 3/4], four codes in three bytes, least significant bits first (the codes
4i..4i+3 are the 24-bit little-endian word c0 | c1 << 6 | c2 << 12 | c3 << 18, as FP4 puts element 2i in the
low nibble); `weight_scale` uint8 [N, Kp / 32] holding the biased E8M0 exponent, as kernels/mxfp4.py (its
block scales too: e = floor(log2(amax)) - 2, 2 being E2M3's top exponent as it is E2M1's). Kp is K rounded up
to a multiple of 32 with zeros.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from kiln.kernels.formats import ActivationFormat, WeightFormat
from kiln.kernels.fp4 import (
    blocks_of,
    check_packed_layout,
    check_scale_shape,
    check_tensor,
    drop_padding,
    round_up,
)
from kiln.kernels.mxfp4 import (
    MXFP4_BLOCK_SIZE,
    Mxfp4Format,
    check_e8m0_codes,
    e8m0_to_float32,
    mx_padded_weight_and_scales,
)
from kiln.kernels.weight_codec import WeightCodec

MXFP6_BLOCK_SIZE = MXFP4_BLOCK_SIZE
"""Values per E8M0 block scale, along the last (K) dimension (32, as every MX format)."""

E2M3_MAX = 7.5
"""Largest E2M3 magnitude."""

E2M3_VALUES: tuple[float, ...] = tuple(
    s * (c / 8 if c < 8 else 2.0 ** ((c >> 3) - 1) * (1 + (c & 7) / 8)) for s in (1.0, -1.0) for c in range(32))
"""The value of each 6-bit code, indexed by code (32..63: the negatives, 32 being -0.0)."""

MXFP6_TENSOR_NAMES = ("weight", "weight_scale")
"""Keys of `Mxfp6Weight.tensors()`."""


def e2m3_encode(x: Tensor) -> Tensor:
    """uint8 codes (0..63) of `x` rounded to the nearest E2M3 value (ties to even, saturating at +-7.5).

    Args:
        x: float32, bfloat16 or float16 tensor of any shape; no NaN (E2M3 has no encoding for it).
    """
    if not isinstance(x, Tensor) or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"x must be a float32, bfloat16 or float16 tensor, got {getattr(x, 'dtype', type(x))}")
    x = x.float()
    if x.numel() and torch.isnan(x.amax()):
        raise ValueError(f"e2m3_encode: x contains {int(torch.isnan(x).sum())} NaN value(s); E2M3 has no NaN "
                         "encoding")
    magnitude = x.abs().clamp_(max=8.0)  # anything from 7.75 on saturates: no overflow in the scaling below
    exponent = torch.frexp(magnitude).exponent.sub_(1).clamp_(0, 2)  # floor(log2 |x|), 0 for |x| < 1 and 0
    steps = torch.ldexp(magnitude, (3 - exponent).float()).round_()  # round half to even; exact in fp32
    codes = steps.add_(exponent * 8).clamp_(max=31).to(torch.uint8)
    return codes | (torch.signbit(x).to(torch.uint8) << 5)


def e2m3_decode(codes: Tensor) -> Tensor:
    """float32 values of uint8 E2M3 codes (0..63)."""
    _check_codes("codes", codes)
    table = torch.tensor(E2M3_VALUES, dtype=torch.float32, device=codes.device)
    return torch.take(table, codes.long())


def pack_fp6(codes: Tensor) -> Tensor:
    """uint8 codes [..., K] (K a multiple of 4) -> bytes [..., 3K / 4]: four codes to three bytes, low bits
    first."""
    _check_codes("codes", codes)
    if codes.ndim == 0 or codes.shape[-1] % 4 != 0:
        raise ValueError(f"pack_fp6: the last dimension must be a multiple of 4, got shape {tuple(codes.shape)}")
    c = codes.reshape(*codes.shape[:-1], -1, 4)
    c0, c1, c2, c3 = c.unbind(-1)
    packed = torch.stack((c0 | (c1 << 6), (c1 >> 2) | (c2 << 4), (c2 >> 4) | (c3 << 2)), dim=-1)
    return packed.reshape(*codes.shape[:-1], -1)


def unpack_fp6(packed: Tensor) -> Tensor:
    """Inverse of `pack_fp6`: uint8 [..., 3K / 4] -> uint8 codes [..., K]."""
    check_tensor("packed", packed, torch.uint8)
    if packed.ndim == 0 or packed.shape[-1] % 3 != 0:
        raise ValueError(f"unpack_fp6: the last dimension must be a multiple of 3, got shape {tuple(packed.shape)}")
    b = packed.reshape(*packed.shape[:-1], -1, 3)
    b0, b1, b2 = b.unbind(-1)
    codes = torch.stack((b0 & 63, (b0 >> 6) | ((b1 & 15) << 2), (b1 >> 4) | ((b2 & 3) << 4), b2 >> 2), dim=-1)
    return codes.reshape(*packed.shape[:-1], -1)


@dataclass(frozen=True)
class Mxfp6Weight:
    """A linear weight [N, K] in MXFP6.

    Attributes:
        packed: uint8 [N, Kp * 3 / 4], four E2M3 codes in three bytes (`pack_fp6`).
        scale_e8m0: uint8 [N, Kp / 32], biased exponents 0..254 (scale = 2^(e - 127)).
        in_features: K before padding; Kp = in_features rounded up to a multiple of 32.
    """

    packed: Tensor
    scale_e8m0: Tensor
    in_features: int

    def __post_init__(self) -> None:
        padded = padded_in_features(self.in_features) if isinstance(self.in_features, int) else 0
        check_packed_layout(self.packed, self.in_features, padded, element_bits=6)
        check_tensor("scale_e8m0", self.scale_e8m0, torch.uint8)
        check_scale_shape("scale_e8m0", self.scale_e8m0, (self.packed.shape[0], padded // MXFP6_BLOCK_SIZE))
        check_e8m0_codes(self.scale_e8m0)

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]

    def tensors(self) -> dict[str, Tensor]:
        """The tensors under their stored names: weight (packed codes), weight_scale (E8M0 as uint8)."""
        return {"weight": self.packed, "weight_scale": self.scale_e8m0}

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, Tensor], in_features: int) -> Mxfp6Weight:
        """Rebuild from exactly the keys of `tensors()`."""
        if set(tensors) != set(MXFP6_TENSOR_NAMES):
            raise ValueError(f"MXFP6 tensors must have exactly the keys {MXFP6_TENSOR_NAMES}; got {sorted(tensors)}")
        return cls(packed=tensors["weight"], scale_e8m0=tensors["weight_scale"], in_features=in_features)


def padded_in_features(in_features: int) -> int:
    """`in_features` rounded up to a multiple of the block size (32)."""
    return round_up(in_features, MXFP6_BLOCK_SIZE)


def mxfp6_quantize(w: Tensor, scale_e8m0: Tensor | None = None) -> Mxfp6Weight:
    """Quantize a weight [N, K] to MXFP6 (K padded to a multiple of 32 with zeros).

    Args:
        w: float32/bfloat16/float16 [N, K], finite.
        scale_e8m0: uint8 [N, Kp / 32] biased exponents (0..254); None: the absmax exponents
            (`mxfp4_block_scales`: floor(log2(amax)) - 2 for E2M3 as for E2M1).
    """
    w_padded, scale_e8m0 = mx_padded_weight_and_scales(w, scale_e8m0)
    blocks = blocks_of(w_padded, MXFP6_BLOCK_SIZE) / e8m0_to_float32(scale_e8m0).unsqueeze(-1)
    codes = e2m3_encode(blocks).reshape(w_padded.shape)
    return Mxfp6Weight(packed=pack_fp6(codes), scale_e8m0=scale_e8m0, in_features=w.shape[1])


def mxfp6_dequantize(q: Mxfp6Weight) -> Tensor:
    """float32 [N, K] (padding columns removed): e2m3 * 2^(scale_e8m0 - 127)."""
    if not isinstance(q, Mxfp6Weight):
        raise TypeError(f"q must be an Mxfp6Weight, got {type(q).__name__}")
    values = blocks_of(e2m3_decode(unpack_fp6(q.packed)), MXFP6_BLOCK_SIZE)
    scaled = (values * e8m0_to_float32(q.scale_e8m0).unsqueeze(-1)).reshape(q.packed.shape[0], -1)
    return drop_padding(scaled, q.in_features)


def _check_codes(name: str, codes: object) -> None:
    check_tensor(name, codes, torch.uint8)
    if codes.numel() and int(codes.max()) > 63:
        raise ValueError(f"{name} must hold 6-bit codes 0..63, got a maximum of {int(codes.max())}")


# --- the format object ---------------------------------------------------------------------------------------------

class Mxfp6Format(Mxfp4Format):
    """MXFP6 weights (E2M3 codes, four in three bytes, E8M0 scale per 32); weight-only (W6A16)."""

    name = WeightFormat.MXFP6
    spellings = ("mxfp6",)
    recipe_name = "mxfp6"
    tensor_names = MXFP6_TENSOR_NAMES
    bits_per_weight = 6.25
    activations = (ActivationFormat.NONE,)
    weight_only = True
    weight_activation_targets = ()
    element_bits = 6
    element_what = "packed FP6 codes"
    weight_class = Mxfp6Weight
    _quantize = staticmethod(mxfp6_quantize)
    _dequantize = staticmethod(mxfp6_dequantize)

    # weight-only: not MXFP4's
    activation_format = WeightCodec.activation_format
    activation_fake_quantizer = WeightCodec.activation_fake_quantizer

    gpu_kernel = "fp6"

    def grid_round_(self, scaled):
        return scaled.copy_(e2m3_decode(e2m3_encode(scaled)))

    coarse_grid = False
    export_names: ClassVar[dict] = {}  # not MXFP4's: no serving engine's layout (nor ONNX) has a type for its elements
    export_refusals = dict.fromkeys(
        ("compressed-tensors", "hf-modelopt", "onnx"),
        "MXFP6 (W6A16), which Kiln's runtime runs but no serving engine's checkpoint layout has; for an export, "
        "rebuild without mxfp6 (an FP8 or FP4 recipe, or auto from a recipe file whose `candidates` leave it out)")


MXFP6_FORMAT = Mxfp6Format()
