"""MXFP6 W6A16 GEMM on the packed bytes Kiln ships (kernels/mxfp6.py's `Mxfp6Weight`): dequantized in the kernel.

Three bytes hold four E2M3 codes (the 24-bit little-endian word c0 | c1 << 6 | c2 << 12 | c3 << 18), so a K tile
of BLOCK_K elements is BLOCK_K / 4 byte triples, and

    sum_k x[k] w[k] = sum_j sum_i x[4i + j] c_j(w_triple[i])        j = 0..3

which is what the kernel computes: four dots per tile (K = 4i + j for each j), with no reordering of codes:
    for each K tile:  b0, b1, b2 = the triples' bytes;  c0 = b0 & 63,  c1 = b0 >> 6 | (b1 & 15) << 2,
                      c2 = b1 >> 4 | (b2 & 3) << 4,  c3 = b2 >> 2
                      w_j = e2m3(c_j) * 2^(e - 127)  (the E8M0 scale of the 32-block of K = 4i + j)
                      acc += dot(x[:, 4i + j], w_j^T)        # x's dtype (bf16) or fp32, fp32 sums
An E2M3 value times a power of two has at most 4 significant bits and bf16 has fp32's exponent range, so a
dequantized weight is exact in bf16; fp16 activations dot in fp32, since 2^(e - 127) can leave fp16's range.
The result differs from the reference (`torch_refs.fp6_w6a16_ref`: dequantize, fp32 matmul) only by the order
of the sums (tests/kernels/test_triton_fp6_gemm.py: within 1e-4 of the output's largest magnitude).

On Blackwell `tl.dot_scaled` also takes "e2m3" operands (tcgen05 kind::f8f6f4); Kiln runs MXFP6 weight-only,
so the weight is decoded here and the dot is a bf16 one on every GPU. Not yet run on a GPU (no device was lent
when it was written): benchmarks/gpu_check.py checks it against the reference there; its speed is not timed yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.mxfp6 import MXFP6_BLOCK_SIZE, Mxfp6Weight
from kiln.kernels.triton_codecs import check_device
from kiln.kernels.triton_fp4_gemm import _block_scales, _dot, _dot_dtype
from kiln.kernels.triton_fp8_gemm import gemm_config


@triton.jit
def e2m3_decode(code):
    """int32 E2M3 code 0..63 -> fp32 value: 2^(e - 1) (1 + m / 8) for exponent e > 0, m / 8 for e = 0."""
    e = (code >> 3) & 3
    m = code & 7
    normal = (((e + 126) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    value = tl.where(e == 0, m.to(tl.float32) * 0.125, normal)
    return tl.where((code & 32) != 0, -value, value)


@triton.jit
def _scaled(code, ws_ptr, rn, stride_wsn, k_index, mask, GROUP: tl.constexpr):
    """The dequantized weights [BLOCK_K / 4, BLOCK_N] of the codes at K positions `k_index`."""
    scale = _block_scales(ws_ptr, rn[None, :], stride_wsn, k_index // GROUP, mask, False)
    return e2m3_decode(code) * scale


@triton.jit
def fp6_w6a16_kernel(
    x_ptr, w_ptr, ws_ptr, c_ptr, M, N, K, KP,
    stride_xm, stride_wn, stride_wsn, stride_cm,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // tiles_n
    pid_n = pid % tiles_n
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ri = tl.arange(0, BLOCK_K // 4)  # byte-triple index inside a K tile
    k_tiles = tl.cdiv(KP, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    first = pid_k * per_split
    last = tl.minimum(first + per_split, k_tiles)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_row = x_ptr + rm[:, None].to(tl.int64) * stride_xm
    row_ok = rm[:, None] < M
    for t in range(first, last):
        triple = t * (BLOCK_K // 4) + ri  # [BLOCK_K / 4]
        w_mask = (rn[None, :] < N) & (triple[:, None] < KP // 4)
        w = w_ptr + rn[None, :].to(tl.int64) * stride_wn + 3 * triple[:, None]
        b0 = tl.load(w, mask=w_mask, other=0).to(tl.int32)
        b1 = tl.load(w + 1, mask=w_mask, other=0).to(tl.int32)
        b2 = tl.load(w + 2, mask=w_mask, other=0).to(tl.int32)
        k0 = 4 * triple[:, None]
        x0 = 4 * triple[None, :]
        w0 = _scaled(b0 & 63, ws_ptr, rn, stride_wsn, k0, w_mask, GROUP)
        acc = _dot(tl.load(x_row + x0, mask=row_ok & (x0 < K), other=0.0), w0, acc, DOT_DTYPE)
        w1 = _scaled((b0 >> 6) | ((b1 & 15) << 2), ws_ptr, rn, stride_wsn, k0 + 1, w_mask, GROUP)
        acc = _dot(tl.load(x_row + x0 + 1, mask=row_ok & (x0 + 1 < K), other=0.0), w1, acc, DOT_DTYPE)
        w2 = _scaled((b1 >> 4) | ((b2 & 3) << 4), ws_ptr, rn, stride_wsn, k0 + 2, w_mask, GROUP)
        acc = _dot(tl.load(x_row + x0 + 2, mask=row_ok & (x0 + 2 < K), other=0.0), w2, acc, DOT_DTYPE)
        w3 = _scaled(b2 >> 2, ws_ptr, rn, stride_wsn, k0 + 3, w_mask, GROUP)
        acc = _dot(tl.load(x_row + x0 + 3, mask=row_ok & (x0 + 3 < K), other=0.0), w3, acc, DOT_DTYPE)
    c = c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :]
    mask = row_ok & (rn[None, :] < N)
    if SPLIT_K > 1:
        tl.atomic_add(c, acc, mask=mask)
    else:
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=mask)


def fp6_w6a16_gemm(x: torch.Tensor, weight: Mxfp6Weight, config: dict | None = None) -> torch.Tensor:
    """x [..., K] (fp32/bf16/fp16) times the dequantized MXFP6 weight [N, K]^T -> [..., N] in x's dtype."""
    if not isinstance(weight, Mxfp6Weight):
        raise TypeError(f"weight must be an Mxfp6Weight, got {type(weight).__name__}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    k = weight.in_features
    if x.shape[-1] != k:
        raise ValueError(f"x's last dimension is {x.shape[-1]}, the weight's in_features is {k}")
    packed, scales = weight.packed, weight.scale_e8m0
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    m, n, kp = x2.shape[0], packed.shape[0], packed.shape[1] * 4 // 3
    check_device(x2, packed, scales)
    cfg = dict(config or gemm_config(m, n, kp, block_k=128))
    block_k = cfg["BLOCK_K"]
    if block_k < 64 or block_k & (block_k - 1):
        raise ValueError(f"BLOCK_K must be a power of two of at least 64 (whole 32-blocks; tl.dot needs 16 "
                         f"triples, tl.arange a power of two), got {block_k}")
    split = cfg["SPLIT_K"]
    c = (torch.zeros if split > 1 else torch.empty)(m, n, device=x.device,
                                                    dtype=torch.float32 if split > 1 else x.dtype)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]), split)
    fp6_w6a16_kernel[grid](x2, packed, scales, c, m, n, k, kp, x2.stride(0), packed.stride(0), scales.stride(0),
                           c.stride(0), GROUP=MXFP6_BLOCK_SIZE, DOT_DTYPE=_dot_dtype(x.dtype, False), **cfg)
    return (c.to(x.dtype) if c.dtype != x.dtype else c).reshape(*lead, n)
