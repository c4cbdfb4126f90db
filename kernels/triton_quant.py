"""Fused RMSNorm + activation quantization (FP8 per token, NVFP4, MXFP4) in one pass over each row.

    for each row x [K] of the input (one program per row):
        y = weight * (x * 1 / sqrt(mean(x^2) + eps))    # runtime.model_weights.RMSNorm's order; y = x without a norm
        FP8, dynamic per token: s = amax(|y|) / 448 (1 where 0); q = e4m3(clamp(y / s))   -> q [K], s
        FP8, static per tensor: q = e4m3(clamp(y / s_static))                             -> q [K]
        NVFP4 (global scale g): per block of 16
            s_b = e4m3(clamp(amax_b / (6 g), 2^-9, 448)) (1 where 0)
            codes = e2m1(y / (float(s_b) * g))                       -> packed [Kp/2], s_b [Kp/16]
        MXFP4: per block of 32
            e = exponent(amax_b) - 2 (at least 0)
            codes = e2m1(y / 2^(e - 127))                            -> packed [Kp/2], e [Kp/32]

The row is read as two [blocks, GROUP / 2] tiles, its even and its odd elements: a packed byte is the even
element's code in the low nibble and the odd one's in the high nibble (kernels/fp4.py), so packing needs no
interleave. NVFP4 with no calibrated global scale takes a first pass that writes each row's amax of y; the
global scale g = amax / (6 * 448) is kernels/nvfp4.py's `nvfp4_global_scale` over the whole tensor, which a
one-pass kernel cannot know before it quantizes the first row.

Exactness (tests/kernels/test_triton_quant.py; references in kernels/torch_refs.py):
  - without the norm, the bytes and scales are bit-exact with kernels/fp8.py `fp8_quantize_per_channel` (per
    token), `fp8_quantize_per_tensor`, kernels/nvfp4.py `nvfp4_quantize` and kernels/mxfp4.py
    `mxfp4_quantize`;
  - with the norm, they are bit-exact with those quantizers applied to the kernel's own y (written when
    `return_normed=True`), and y is within a few fp32 ulps of runtime.model_weights.RMSNorm (a different summation
    order of mean(x^2), and torch's CPU sqrt is not correctly rounded): so against the quantizers applied
    to torch's y, an element may differ by one code where y sits within those ulps of a rounding midpoint,
    and a scale by one E4M3 step where a block amax does. The tests bound both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.fp8 import E4M3_MAX
from kiln.kernels.mxfp4 import MXFP4_BLOCK_SIZE
from kiln.kernels.nvfp4 import NVFP4_BLOCK_SIZE
from kiln.kernels.torch_refs import QuantizedActivation
from kiln.kernels.triton_codecs import (
    check_device,
    e2m1_encode,
    e4m3_decode,
    e4m3_encode,
    e8m0_decode,
    interpreting,
)

FP8_PER_TOKEN, FP8_STATIC, NVFP4, MXFP4 = 0, 1, 2, 3
_FP8_TILE = 32  # FP8 has no blocks: the row is tiled in 32s only to share the even/odd loads
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def rmsnorm_quantize_kernel(
    x_ptr, w_ptr, q_ptr, scale_ptr, g_ptr, y_ptr, amax_ptr,
    K, K_FLOAT, stride_x, stride_q, stride_s, stride_y, eps,
    FORMAT: tl.constexpr, NORM: tl.constexpr, WRITE_Y: tl.constexpr, AMAX_ONLY: tl.constexpr,
    GROUP: tl.constexpr, BLOCKS: tl.constexpr, HW_CAST: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = tl.arange(0, BLOCKS)[:, None]  # [BLOCKS, 1] block index along K
    j = tl.arange(0, GROUP // 2)[None, :]  # [1, GROUP / 2] byte index inside a block
    k_even = b * GROUP + 2 * j  # [BLOCKS, GROUP / 2]
    k_odd = k_even + 1
    x_even = tl.load(x_ptr + row * stride_x + k_even, mask=k_even < K, other=0.0).to(tl.float32)
    x_odd = tl.load(x_ptr + row * stride_x + k_odd, mask=k_odd < K, other=0.0).to(tl.float32)
    if NORM:
        sum_sq = tl.sum(tl.sum(x_even * x_even + x_odd * x_odd, axis=1), axis=0)
        inv_rms = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(sum_sq, K_FLOAT) + eps))
        w_even = tl.load(w_ptr + k_even, mask=k_even < K, other=0.0).to(tl.float32)
        w_odd = tl.load(w_ptr + k_odd, mask=k_odd < K, other=0.0).to(tl.float32)
        y_even = w_even * (x_even * inv_rms)
        y_odd = w_odd * (x_odd * inv_rms)
    else:
        y_even = x_even
        y_odd = x_odd
    if WRITE_Y:
        tl.store(y_ptr + row * stride_y + k_even, y_even, mask=k_even < K)
        tl.store(y_ptr + row * stride_y + k_odd, y_odd, mask=k_odd < K)
    block_amax = tl.max(tl.maximum(tl.abs(y_even), tl.abs(y_odd)), axis=1)  # [BLOCKS]
    if AMAX_ONLY:
        tl.store(amax_ptr + row, tl.max(block_amax, axis=0))
    elif FORMAT <= 1:  # FP8 per token (0), FP8 static (1)
        if FORMAT == 0:
            scale = tl.div_rn(tl.max(block_amax, axis=0), 448.0)
            scale = tl.where(scale > 0, scale, 1.0)
            tl.store(scale_ptr + row * stride_s, scale)
        else:
            scale = tl.load(g_ptr)
        q_even = e4m3_encode(tl.minimum(tl.maximum(tl.div_rn(y_even, scale), -448.0), 448.0), HW_CAST)
        q_odd = e4m3_encode(tl.minimum(tl.maximum(tl.div_rn(y_odd, scale), -448.0), 448.0), HW_CAST)
        tl.store(q_ptr + row * stride_q + k_even, q_even, mask=k_even < K)
        tl.store(q_ptr + row * stride_q + k_odd, q_odd, mask=k_odd < K)
    else:  # NVFP4 or MXFP4: blocks along K, padded with zeros to whole blocks
        if FORMAT == 2:
            g = tl.load(g_ptr)
            block_scale = tl.div_rn(block_amax, 6.0 * g)
            block_scale = tl.where(block_scale == 0, 1.0, block_scale)
            block_scale = tl.minimum(tl.maximum(block_scale, 0.001953125), 448.0)  # [2^-9, 448]
            scale_code = e4m3_encode(block_scale, HW_CAST)
            element_scale = e4m3_decode(scale_code) * g
        else:
            exponent = (block_amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # floor(log2(amax)) + 127
            exponent = tl.maximum(exponent - 2, 0)  # 2 = floor(log2(6)), E2M1's top exponent
            scale_code = exponent.to(tl.uint8)
            element_scale = e8m0_decode(exponent)
        code_even = e2m1_encode(tl.div_rn(y_even, element_scale[:, None]))
        code_odd = e2m1_encode(tl.div_rn(y_odd, element_scale[:, None]))
        padded = tl.cdiv(K, GROUP) * GROUP
        byte = b * (GROUP // 2) + j
        packed = (code_even | (code_odd << 4)).to(tl.uint8)
        tl.store(q_ptr + row * stride_q + byte, packed, mask=k_even < padded)
        blocks = tl.arange(0, BLOCKS)
        tl.store(scale_ptr + row * stride_s + blocks, scale_code, mask=blocks * GROUP < padded)


def _rows(x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"x must be a float32/bfloat16/float16 tensor, got {getattr(x, 'dtype', type(x))}")
    if x.ndim != 2 or x.numel() == 0:
        raise ValueError(f"x must be a non-empty 2-D [tokens, K] activation, got shape {tuple(x.shape)}")
    return x if x.stride(1) == 1 else x.contiguous()


def _launch(x, weight, eps, fmt, group, *, q, scale, g, return_normed, amax_only=False):
    m, k = x.shape
    norm = weight is not None
    if norm:
        if weight.shape != (k,):
            raise ValueError(f"the norm weight must be [{k}], got shape {tuple(weight.shape)}")
        check_device(weight)
    check_device(x)
    y = torch.empty(m, k, dtype=torch.float32, device=x.device) if return_normed else None
    amax = torch.empty(m, dtype=torch.float32, device=x.device) if amax_only else None
    def pointer(t):  # an argument this configuration never touches still needs a pointer
        return x if t is None else t

    blocks = triton.next_power_of_2(triton.cdiv(k, group))
    stride_q = q.stride(0) if q is not None else 0
    stride_s = scale.stride(0) if scale is not None and scale.ndim else 0
    rmsnorm_quantize_kernel[(m,)](
        x, pointer(weight), pointer(q), pointer(scale), pointer(g), pointer(y), pointer(amax),
        k, float(k), x.stride(0), stride_q, stride_s, k, float(eps),
        FORMAT=fmt, NORM=norm, WRITE_Y=return_normed, AMAX_ONLY=amax_only, GROUP=group, BLOCKS=blocks,
        HW_CAST=not interpreting(), num_warps=4 if blocks * group <= 4096 else 8,
    )
    return y, amax


def quantize_fp8(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6,
                 input_scale: torch.Tensor | None = None, return_normed: bool = False) -> QuantizedActivation:
    """[M, K] -> FP8 E4M3 with one scale per token (dynamic), or `input_scale` (static, per tensor).

    With `weight` ([K]) the row is RMS-normalized first (eps inside the square root)."""
    x = _rows(x)
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    if input_scale is None:
        scale = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
        fmt, g = FP8_PER_TOKEN, None
    else:
        scale = input_scale.detach().float().reshape(()).to(x.device)
        fmt, g = FP8_STATIC, scale
    y, _ = _launch(x, weight, eps, fmt, _FP8_TILE, q=q.view(torch.uint8),
                   scale=scale if input_scale is None else None, g=g, return_normed=return_normed)
    return QuantizedActivation(q, scale, None, y)


def quantize_nvfp4(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6,
                   global_scale: torch.Tensor | None = None,
                   return_normed: bool = False) -> QuantizedActivation:
    """[M, K] -> NVFP4 blocks of 16 along K (kernels/nvfp4.py's layout), optionally RMS-normalized first.

    `global_scale`: the calibrated activation scale (a checkpoint's `input_scale`); None computes
    `nvfp4_global_scale` of the (normalized) activation in a first pass."""
    x = _rows(x)
    m, k = x.shape
    padded = triton.cdiv(k, NVFP4_BLOCK_SIZE) * NVFP4_BLOCK_SIZE
    if global_scale is None:
        _, amax = _launch(x, weight, eps, NVFP4, NVFP4_BLOCK_SIZE, q=None, scale=None, g=None,
                          return_normed=False, amax_only=True)
        amax = amax.max()
        if not torch.isfinite(amax):
            raise ValueError("the activation contains NaN or inf; NVFP4 cannot encode it")
        g = torch.where(amax > 0, amax / (6.0 * E4M3_MAX), torch.ones_like(amax))
    else:
        g = global_scale.detach().float().reshape(()).to(x.device)
    packed = torch.empty(m, padded // 2, dtype=torch.uint8, device=x.device)
    block_scale = torch.empty(m, padded // NVFP4_BLOCK_SIZE, dtype=torch.float8_e4m3fn, device=x.device)
    y, _ = _launch(x, weight, eps, NVFP4, NVFP4_BLOCK_SIZE, q=packed, scale=block_scale.view(torch.uint8),
                   g=g, return_normed=return_normed)
    return QuantizedActivation(packed, block_scale, g, y)


def quantize_mxfp4(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6,
                   return_normed: bool = False) -> QuantizedActivation:
    """[M, K] -> MXFP4 blocks of 32 along K (kernels/mxfp4.py's layout), optionally RMS-normalized first."""
    x = _rows(x)
    m, k = x.shape
    padded = triton.cdiv(k, MXFP4_BLOCK_SIZE) * MXFP4_BLOCK_SIZE
    packed = torch.empty(m, padded // 2, dtype=torch.uint8, device=x.device)
    scale = torch.empty(m, padded // MXFP4_BLOCK_SIZE, dtype=torch.uint8, device=x.device)
    y, _ = _launch(x, weight, eps, MXFP4, MXFP4_BLOCK_SIZE, q=packed, scale=scale, g=None,
                   return_normed=return_normed)
    return QuantizedActivation(packed, scale, None, y)
