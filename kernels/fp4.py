"""FP4 E2M1: the 4-bit element format shared by NVFP4 and MXFP4, and its two-per-byte packing.

A code is 4 bits, sign | exponent (2 bits, bias 1) | mantissa (1 bit); there is no inf and no NaN:

    code & 7:  0    1    2    3    4    5    6    7
    value:     0    0.5  1    1.5  2    3    4    6        (code & 8 is the sign)

    e2m1_encode(x):                      # round to nearest, ties to even code, saturate at 6
        m = |x|
        code = (m > 0.25) + (m >= 0.75) + (m > 1.25) + (m >= 1.75) + (m > 2.5) + (m >= 3.5) + (m > 5)
        code |= signbit(x) << 3          # -0.0 and small negatives keep their sign: code 8 (-0)
    e2m1_decode(code) = VALUES[code]
    pack_fp4(codes[..., K]) -> bytes[..., K/2]:  byte i = codes[2i] | codes[2i+1] << 4

Each midpoint between two neighbours rounds to the one with the even code, which is what IEEE round-to-
nearest-even gives; ">" keeps a tie on the lower neighbour, ">=" moves it up. This is bit-exact with
torchao's `f32_to_f4_unpacked` for every non-NaN float32 (checked in tests/kernels/test_fp4.py), and with
NVIDIA ModelOpt's `NVFP4QTensor._cast_fp4` except for -0.0, which ModelOpt encodes as +0 (code 0) and
torchao and Kiln as -0 (code 8); both decode to zero. The nibble order (element 2i in the low nibble) is
torchao's `pack_uint4` and ModelOpt's export layout.

NaN has no E2M1 encoding: torchao turns it into an arbitrary code and ModelOpt into +6, so a NaN input
raises ValueError here instead of being silently quantized. +-inf saturates to +-6 like any value above 6.
"""

from __future__ import annotations

import torch
from torch import Tensor

E2M1_MAX = 6.0
"""Largest E2M1 magnitude."""

# The value of each 4-bit code, indexed by code.
# fmt: off
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                                  -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# fmt: on

# (midpoint between neighbouring magnitudes, whether a value exactly on it rounds up).
# A tie goes to the even code: the midpoint between codes c and c+1 rounds up exactly when c is odd.
# fmt: off
_ROUNDING_MIDPOINTS: tuple[tuple[float, bool], ...] = (
    (0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False),
)
# fmt: on

_FLOAT_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def e2m1_encode(x: Tensor) -> Tensor:
    """Round each element of `x` to the nearest E2M1 value (ties to even, saturating at +-6).

    Args:
        x: float32, bfloat16 or float16 tensor of any shape; no NaN.

    Returns:
        uint8 tensor of codes (0..15) with the shape of `x`.
    """
    _check_float_tensor("x", x)
    x = x.float()
    if x.numel() and torch.isnan(x.amax()):  # amax propagates NaN; cheaper than isnan(x).any()
        raise ValueError(
            f"e2m1_encode: x contains {int(torch.isnan(x).sum())} NaN value(s); E2M1 has no NaN encoding"
        )
    magnitude = x.abs()
    codes = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for midpoint, tie_rounds_up in _ROUNDING_MIDPOINTS:
        above = (magnitude >= midpoint) if tie_rounds_up else (magnitude > midpoint)
        codes += above.view(torch.uint8)  # a bool is stored as one byte 0/1: no conversion pass
    codes |= torch.signbit(x).view(torch.uint8) << 3
    return codes


def e2m1_decode(codes: Tensor) -> Tensor:
    """Map uint8 E2M1 codes (0..15, one per element) to their float32 values."""
    _check_codes("codes", codes)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return torch.take(table, codes.long())


def pack_fp4(codes: Tensor) -> Tensor:
    """Pack uint8 codes [..., K] (K even) two per byte: [..., K // 2], element 2i in the low nibble."""
    _check_codes("codes", codes)
    if codes.ndim == 0 or codes.shape[-1] % 2 != 0:
        raise ValueError(f"pack_fp4: the last dimension must be even, got shape {tuple(codes.shape)}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: Tensor) -> Tensor:
    """Inverse of `pack_fp4`: uint8 [..., K // 2] -> uint8 codes [..., K]."""
    if not isinstance(packed, Tensor):
        raise TypeError(f"unpack_fp4: packed must be a torch.Tensor, got {type(packed).__name__}")
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_fp4: packed must be uint8, got {packed.dtype}")
    if packed.ndim == 0:
        raise ValueError("unpack_fp4: packed must have at least one dimension, got a 0-dim tensor")
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _check_float_tensor(name: str, x: object) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_INPUT_DTYPES:
        raise TypeError(f"{name} must have dtype in {_FLOAT_INPUT_DTYPES}, got {x.dtype}")


def _check_codes(name: str, codes: object) -> None:
    if not isinstance(codes, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(codes).__name__}")
    if codes.dtype != torch.uint8:
        raise TypeError(f"{name} must be uint8 E2M1 codes, got {codes.dtype}")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"{name} must hold 4-bit codes 0..15, got a maximum of {int(codes.max())}")


# --- shared by the block formats (NVFP4, MXFP4): input checks and padding along K ---------------------------


def check_tensor(name: str, t: object, dtype: torch.dtype) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")


def check_float_input(name: str, x: object, min_ndim: int) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_INPUT_DTYPES:
        raise TypeError(f"{name} must have dtype in {_FLOAT_INPUT_DTYPES}, got {x.dtype}")
    if x.ndim < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimension(s), got shape {tuple(x.shape)}")
    if x.numel() == 0:
        raise ValueError(f"{name} must not be empty, got shape {tuple(x.shape)}")


def check_packed_layout(packed: object, in_features: object, padded: int, element_bits: int = 4) -> None:
    """`in_features` a positive int and `packed` uint8 [N, padded * element_bits / 8] (FP4: 2 codes a byte;
    MXFP6: 4 codes in 3 bytes)."""
    if isinstance(in_features, bool) or not isinstance(in_features, int):
        raise TypeError(f"in_features must be an int, got {type(in_features).__name__}")
    if in_features <= 0:
        raise ValueError(f"in_features must be positive, got {in_features}")
    check_tensor("packed", packed, torch.uint8)
    width = padded * element_bits // 8
    if packed.ndim != 2 or packed.shape[1] != width:
        raise ValueError(f"packed must be [N, {width}] for in_features={in_features}, got {tuple(packed.shape)}")


def round_up(in_features: int, block: int) -> int:
    return -(-in_features // block) * block


def pad_last_dim(x: Tensor, padded: int) -> Tensor:
    if x.shape[-1] == padded:
        return x
    return torch.nn.functional.pad(x, (0, padded - x.shape[-1]))


def drop_padding(x: Tensor, in_features: int) -> Tensor:
    if x.shape[-1] == in_features:
        return x
    return x[..., :in_features].contiguous()


def blocks_of(x: Tensor, block: int) -> Tensor:
    """x [..., Kp] (Kp a multiple of `block`) viewed as [..., Kp / block, block]."""
    return x.reshape(*x.shape[:-1], -1, block)


def check_whole_blocks(name: str, x: Tensor, block: int) -> None:
    if x.shape[-1] % block != 0:
        raise ValueError(f"{name}'s last dimension must be a multiple of {block}, got shape {tuple(x.shape)}")


def check_scale_shape(name: str, scale: Tensor, expected: tuple[int, ...], context: str = "") -> None:
    """A block-scale tensor's shape; `context` (e.g. " for w of shape ...") goes into the message."""
    if tuple(scale.shape) != expected:
        raise ValueError(f"{name} must have shape {expected}{context}, got {tuple(scale.shape)}")


def abs_max(x: Tensor, dim: int | None = None) -> Tensor:
    """max(|x|) over `dim` (all of x when None), exactly; NaN if any element is NaN.

    max(-min, max) reads x once and allocates nothing the size of x, unlike x.abs().amax().
    """
    low, high = torch.aminmax(x) if dim is None else torch.aminmax(x, dim=dim)
    return torch.maximum(-low, high).abs()  # abs: an all -0.0 input gives +0.0


def check_finite_amax(name: str, amax: Tensor) -> None:
    # amax is NaN when any element is NaN, inf when any element is infinite.
    if not torch.isfinite(amax).all():
        raise ValueError(f"{name} must be finite, but contains NaN or inf")
