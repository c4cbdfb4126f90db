"""Device functions the Triton kernels share: encode and decode Kiln's number formats inside a kernel.

    e4m3_encode(x)   fp32 (clamped to +-448) -> E4M3 byte, round to nearest even   (torch's float8 cast)
    e4m3_decode(b)   E4M3 byte -> fp32
    e2m1_encode(x)   fp32 -> 4-bit code, the midpoint comparisons of kernels/fp4.py (ties to the even code)
    e2m1_decode(c)   4-bit code -> fp32 (+-{0, 0.5, 1, 1.5, 2, 3, 4, 6}; code 8 is -0.0)
    e8m0_decode(e)   biased exponent 0..254 -> fp32 2^(e - 127) (code 0: the subnormal 2^-127, as in mxfp4.py)

Every encoder here is bit-exact with the torch reference it names. `e4m3_encode` has two paths: the
hardware conversion (`cvt.rn.satfinite.e4m3x2.f32` on sm_89+) and an integer one. The integer path exists
because Triton 3.9's interpreter converts fp32 -> float8e4nv wrongly (a rounding carry out of the mantissa is
dropped: 7.78 becomes 4.0, and subnormals round the wrong way); kernels pass `HW_CAST=not interpreting()`,
so the interpreter tests check the integer path and benchmarks/gpu_check.py checks both on a GPU.

Kernels keep fp8 storage behind uint8 pointers (`t.view(torch.uint8)`) and bitcast, so loads and masked
`other=` values never go through a float8 conversion.

Division is `tl.div_rn` and square root `tl.sqrt_rn` wherever a result must match torch bit for bit: Triton's
`/` on fp32 lowers to an approximate division on NVIDIA GPUs.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1, read at kernel definition)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_device(*tensors: torch.Tensor) -> None:
    """Kernels run on CUDA tensors, or on CPU tensors under the interpreter; refuse anything else clearly."""
    want_cuda = not interpreting()
    for t in tensors:
        if t.is_cuda != want_cuda:
            where = "CUDA" if want_cuda else "CPU (TRITON_INTERPRET=1 is set)"
            raise ValueError(f"Triton kernel inputs must be {where} tensors, got one on {t.device}")


@triton.jit
def e4m3_encode(x, HW_CAST: tl.constexpr):
    """fp32 in [-448, 448], no NaN -> uint8 E4M3 bits, round to nearest even (equal to torch's cast)."""
    if HW_CAST:
        out = x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        bits = x.to(tl.int32, bitcast=True)
        sign = (bits >> 31) & 1
        exp32 = (bits >> 23) & 0xFF
        mant32 = bits & 0x7FFFFF
        # Normal E4M3 (fp32 exponent above 120): exponent and top 3 mantissa bits form one 7-bit code, so a
        # rounding carry out of the mantissa moves into the exponent by itself.
        normal = ((exp32 - 120) << 3) | (mant32 >> 20)
        rest = mant32 & 0xFFFFF
        normal += ((rest > 0x80000) | ((rest == 0x80000) & ((normal & 1) == 1))).to(tl.int32)
        # Subnormal E4M3: the code is the value in units of 2^-9, rounded; code 8 is 2^-6, the least normal.
        full = tl.where(exp32 == 0, mant32, mant32 | 0x800000)
        shift = tl.minimum(141 - exp32, 31)  # value = full * 2^(exp32 - 150) = (full >> shift) * 2^-9
        sub = full >> shift
        rest_s = full - (sub << shift)
        half = 1 << (shift - 1)
        sub += ((rest_s > half) | ((rest_s == half) & ((sub & 1) == 1))).to(tl.int32)
        code = tl.minimum(tl.where(exp32 > 120, normal, sub), 0x7E)  # 0x7E = 448; 0x7F is NaN
        out = (code | (sign << 7)).to(tl.uint8)
    return out


@triton.jit
def e4m3_decode(byte):
    """uint8 E4M3 bits -> fp32 (exact)."""
    return byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def e2m1_encode(x):
    """fp32, no NaN -> int32 E2M1 code 0..15: kernels/fp4.py's comparisons, so ties go to the even code."""
    m = tl.abs(x)
    code = ((m > 0.25).to(tl.int32) + (m >= 0.75).to(tl.int32) + (m > 1.25).to(tl.int32)
            + (m >= 1.75).to(tl.int32) + (m > 2.5).to(tl.int32) + (m >= 3.5).to(tl.int32)
            + (m > 5.0).to(tl.int32))
    sign = (x.to(tl.int32, bitcast=True) >> 31) & 1  # the sign bit, so -0.0 is code 8 as in the reference
    return code | (sign << 3)


@triton.jit
def e2m1_decode(code):
    """int32 E2M1 code 0..15 -> fp32 value: 2^(e - 1) * (1 + m / 2) for exponent e > 0, m / 2 for e = 0."""
    e = (code >> 1) & 3
    m = code & 1
    normal = (((e + 126) << 23) | (m << 22)).to(tl.float32, bitcast=True)
    value = tl.where(e == 0, m.to(tl.float32) * 0.5, normal)
    return tl.where((code & 8) != 0, -value, value)


@triton.jit
def e8m0_decode(e):
    """int32 biased exponent 0..254 -> fp32 2^(e - 127), exactly (code 0 is the subnormal 2^-127)."""
    return tl.where(e == 0, 0x00400000, e << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_encode_kernel(x_ptr, out_ptr, count, HW_CAST: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < count, other=0.0)
    byte = e4m3_encode(tl.minimum(tl.maximum(x, -448.0), 448.0), HW_CAST)
    tl.store(out_ptr + offs, byte, mask=offs < count)


def e4m3_encode_tensor(x: torch.Tensor, hw_cast: bool) -> torch.Tensor:
    """fp32 tensor -> its saturating E4M3 bytes through `e4m3_encode` (gpu_check.py checks both paths)."""
    if x.dtype != torch.float32:
        raise TypeError(f"x must be float32, got {x.dtype}")
    check_device(x)
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    _e4m3_encode_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), HW_CAST=hw_cast, BLOCK=1024)
    return out
