"""FP4 GEMMs on the packed bytes Kiln ships: W4A16 (dequantized in the kernel) and W4A4 (`tl.dot_scaled`).

Weights are kernels/nvfp4.py's `Nvfp4Weight` (uint8 [N, Kp/2] E2M1 pairs, E4M3 scales per 16, an fp32 global
scale) or kernels/mxfp4.py's `Mxfp4Weight` (E2M1 pairs, E8M0 scales per 32). A byte holds element 2i in its
low nibble and 2i + 1 in its high nibble, so a K tile of BLOCK_K elements is BLOCK_K / 2 bytes, and

    sum_k x[k] w[k] = sum_i x[2i] lo(w_byte[i]) + x[2i + 1] hi(w_byte[i])

which is what both kernels compute: two dots per tile (even and odd K), no interleaving of nibbles.

W4A16 (Hopper's FP4 path: its tensor cores have no FP4):
    for each K tile:  w_lo, w_hi = e2m1(byte & 15), e2m1(byte >> 4), times the block scale (E4M3 or 2^(e-127))
                      acc += dot(x[:, even], w_lo^T) + dot(x[:, odd], w_hi^T)   # x's dtype, fp32 sums
    out = acc * global_scale                                                    # NVFP4 only
  E2M1 x E4M3 has at most 6 significant bits, so a dequantized weight is exact in bf16 and fp16 and the
  global scale waits for the epilogue; the result differs from the reference (dequantize, fp32 matmul) only by
  the order of the sums and where g is rounded in (kernels/nvfp4.py notes the one-ulp epilogue difference).
  fp16 activations with MXFP4 weights dot in fp32, since 2^(e-127) can leave fp16's range.

W4A4 (Blackwell's FP4 tensor cores), both operands packed:
    DOT_SCALED:  acc = tl.dot_scaled(a_bytes, a_scales, "e2m1", w_bytes^T, w_scales, "e2m1", acc)
    fallback:    dequantize both tiles as above and dot them (the path the interpreter test checks for NVFP4)
    out = acc * (g_a * g_w)                                                     # NVFP4 only
  Triton 3.9's interpreter runs `tl.dot_scaled` for MXFP4 but decodes every scale as E8M0, so NVFP4's E4M3
  scales come out wrong there: the NVFP4 dot_scaled test needs a GPU (sm_100 for the native instruction).

Tolerance (tests/kernels/test_triton_fp4_gemm.py): within 1e-4 of the output's largest magnitude against
the fp32 reference (kernels/torch_refs.py `fp4_w4a16_ref`, `fp4_w4a4_ref`); all operand products are exact,
only the summation order differs. Compiled, W4A4's tl.dot_scaled is Blackwell's tcgen05 block-scaled MMA
(kind::mxf4nvf4 block16 for NVFP4, kind::mxf4 block32 for MXFP4) and a bf16 emulation on Hopper
(tests/kernels/test_triton_compile.py). Production kernels to compare with on a GPU: Marlin/Machete (vLLM)
for W4A16; CUTLASS/FlashInfer `mm_fp4` and `torch._scaled_mm` with float4_e2m1fn_x2 on Blackwell for W4A4.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.mxfp4 import MXFP4_BLOCK_SIZE, Mxfp4Weight
from kiln.kernels.nvfp4 import NVFP4_BLOCK_SIZE, Nvfp4Weight
from kiln.kernels.torch_refs import QuantizedActivation
from kiln.kernels.triton_codecs import check_device, e2m1_decode, e4m3_decode, e8m0_decode, interpreting
from kiln.kernels.triton_fp8_gemm import gemm_config
from kiln.kernels.triton_quant import quantize_mxfp4, quantize_nvfp4


@triton.jit
def _block_scales(s_ptr, rows, stride_row, cols, mask, SCALE_E4M3: tl.constexpr):
    """fp32 block scales gathered at [rows, cols] (E4M3 bytes, or E8M0 exponents)."""
    s = tl.load(s_ptr + rows.to(tl.int64) * stride_row + cols, mask=mask, other=0)
    if SCALE_E4M3:
        out = e4m3_decode(s)
    else:
        out = e8m0_decode(s.to(tl.int32))
    return out


@triton.jit
def _dot(a, b, acc, DOT_DTYPE: tl.constexpr):
    if DOT_DTYPE == tl.float32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        out = tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), acc)
    return out


@triton.jit
def fp4_w4a16_kernel(
    x_ptr, w_ptr, ws_ptr, g_ptr, c_ptr, M, N, K, KP,
    stride_xm, stride_wn, stride_wsn, stride_cm,
    GROUP: tl.constexpr, SCALE_E4M3: tl.constexpr, HAS_GLOBAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // tiles_n
    pid_n = pid % tiles_n
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ri = tl.arange(0, BLOCK_K // 2)  # byte index inside a K tile
    k_tiles = tl.cdiv(KP, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    first = pid_k * per_split
    last = tl.minimum(first + per_split, k_tiles)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(first, last):
        byte = t * (BLOCK_K // 2) + ri  # [BLOCK_K / 2]
        w_mask = (rn[None, :] < N) & (byte[:, None] < KP // 2)
        w = tl.load(w_ptr + rn[None, :].to(tl.int64) * stride_wn + byte[:, None], mask=w_mask, other=0)
        w = w.to(tl.int32)  # [BLOCK_K / 2, BLOCK_N]
        block = (2 * byte[:, None]) // GROUP
        scale = _block_scales(ws_ptr, rn[None, :], stride_wsn, block, w_mask, SCALE_E4M3)
        w_lo = e2m1_decode(w & 15) * scale
        w_hi = e2m1_decode(w >> 4) * scale
        x_row = x_ptr + rm[:, None].to(tl.int64) * stride_xm
        even = 2 * byte[None, :]
        x_even = tl.load(x_row + even, mask=(rm[:, None] < M) & (even < K), other=0.0)
        x_odd = tl.load(x_row + even + 1, mask=(rm[:, None] < M) & (even + 1 < K), other=0.0)
        acc = _dot(x_even, w_lo, acc, DOT_DTYPE)
        acc = _dot(x_odd, w_hi, acc, DOT_DTYPE)
    if HAS_GLOBAL:
        acc = acc * tl.load(g_ptr)
    c = c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT_K > 1:
        tl.atomic_add(c, acc, mask=mask)
    else:
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def fp4_w4a4_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, alpha_ptr, c_ptr, M, N, KP,
    stride_am, stride_asm, stride_wn, stride_wsn, stride_cm,
    GROUP: tl.constexpr, SCALE_E4M3: tl.constexpr, HAS_GLOBAL: tl.constexpr, DOT_SCALED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // tiles_n
    pid_n = pid % tiles_n
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ri = tl.arange(0, BLOCK_K // 2)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(tl.cdiv(KP, BLOCK_K)):
        byte = t * (BLOCK_K // 2) + ri
        a_mask = (rm[:, None] < M) & (byte[None, :] < KP // 2)
        a = tl.load(a_ptr + rm[:, None].to(tl.int64) * stride_am + byte[None, :], mask=a_mask, other=0)
        w_mask = (rn[:, None] < N) & (byte[None, :] < KP // 2)
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + byte[None, :], mask=w_mask, other=0)
        if DOT_SCALED:
            blocks = t * (BLOCK_K // GROUP) + tl.arange(0, BLOCK_K // GROUP)
            s_mask_a = (rm[:, None] < M) & (blocks[None, :] * GROUP < KP)
            s_mask_w = (rn[:, None] < N) & (blocks[None, :] * GROUP < KP)
            a_scale = tl.load(as_ptr + rm[:, None].to(tl.int64) * stride_asm + blocks[None, :], mask=s_mask_a,
                              other=0)
            w_scale = tl.load(ws_ptr + rn[:, None].to(tl.int64) * stride_wsn + blocks[None, :], mask=s_mask_w,
                              other=0)
            if SCALE_E4M3:
                a_scale = a_scale.to(tl.float8e4nv, bitcast=True)
                w_scale = w_scale.to(tl.float8e4nv, bitcast=True)
            acc = tl.dot_scaled(a, a_scale, "e2m1", w.T, w_scale, "e2m1", acc)
        else:
            block = (2 * byte[None, :]) // GROUP
            a = a.to(tl.int32)  # [BLOCK_M, BLOCK_K / 2]
            a_s = _block_scales(as_ptr, rm[:, None], stride_asm, block, a_mask, SCALE_E4M3)
            w = w.to(tl.int32)  # [BLOCK_N, BLOCK_K / 2]
            w_s = _block_scales(ws_ptr, rn[:, None], stride_wsn, block, w_mask, SCALE_E4M3)
            acc = _dot(e2m1_decode(a & 15) * a_s, (e2m1_decode(w & 15) * w_s).T, acc, DOT_DTYPE)
            acc = _dot(e2m1_decode(a >> 4) * a_s, (e2m1_decode(w >> 4) * w_s).T, acc, DOT_DTYPE)
    if HAS_GLOBAL:
        acc = acc * tl.load(alpha_ptr)
    c = c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def _weight_parts(weight):
    """(packed, scale bytes, fp32 global scale or None, group, scale_is_e4m3) of an NVFP4/MXFP4 weight."""
    if isinstance(weight, Nvfp4Weight):
        scales = weight.block_scale.view(torch.uint8)
        return weight.packed, scales, weight.global_scale, NVFP4_BLOCK_SIZE, True
    if isinstance(weight, Mxfp4Weight):
        return weight.packed, weight.scale_e8m0, None, MXFP4_BLOCK_SIZE, False
    raise TypeError(f"weight must be an Nvfp4Weight or an Mxfp4Weight, got {type(weight).__name__}")


def _dot_dtype(x_dtype: torch.dtype, scale_is_e4m3: bool):
    if interpreting() or x_dtype == torch.float32:
        return tl.float32  # the interpreter's bf16/fp16 tl.dot is wrong; fp32 inputs stay fp32 (no TF32)
    if x_dtype == torch.bfloat16:
        return tl.bfloat16
    return tl.float16 if scale_is_e4m3 else tl.float32


def fp4_w4a16_gemm(x: torch.Tensor, weight: Nvfp4Weight | Mxfp4Weight,
                   config: dict | None = None) -> torch.Tensor:
    """x [..., K] (fp32/bf16/fp16) times the dequantized FP4 weight [N, K]^T -> [..., N] in x's dtype."""
    packed, scales, g, group, e4m3 = _weight_parts(weight)
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    k = weight.in_features
    if x.shape[-1] != k:
        raise ValueError(f"x's last dimension is {x.shape[-1]}, the weight's in_features is {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    m, n, kp = x2.shape[0], packed.shape[0], packed.shape[1] * 2
    check_device(x2, packed, scales)
    cfg = dict(config or gemm_config(m, n, kp, block_k=128))
    if cfg["BLOCK_K"] % group:
        raise ValueError(f"BLOCK_K must be a multiple of the block size {group}, got {cfg['BLOCK_K']}")
    split = cfg["SPLIT_K"]
    c = (torch.zeros if split > 1 else torch.empty)(m, n, device=x.device,
                                                    dtype=torch.float32 if split > 1 else x.dtype)
    g_arg = g.reshape(1).to(x.device) if g is not None else scales
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]), split)
    fp4_w4a16_kernel[grid](x2, packed, scales, g_arg, c, m, n, k, kp, x2.stride(0), packed.stride(0),
                           scales.stride(0), c.stride(0), GROUP=group, SCALE_E4M3=e4m3,
                           HAS_GLOBAL=g is not None, DOT_DTYPE=_dot_dtype(x.dtype, e4m3), **cfg)
    return (c.to(x.dtype) if c.dtype != x.dtype else c).reshape(*lead, n)


def w4a4_config(m: int, n: int, k: int, dot_scaled: bool) -> dict:
    """Untuned tiles; Triton uses Blackwell's block-scaled MMA for dot_scaled only when BLOCK_M >= 128."""
    if interpreting():
        return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1}
    if dot_scaled:
        return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 256, "num_warps": 8, "num_stages": 3}
    return {"BLOCK_M": 16 if m <= 16 else 64, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}


def fp4_w4a4_gemm(act: QuantizedActivation, weight: Nvfp4Weight | Mxfp4Weight, out_dtype: torch.dtype,
                  dot_scaled: bool | None = None, config: dict | None = None) -> torch.Tensor:
    """A packed FP4 activation [M, Kp/2] (from kernels/triton_quant.py) times the FP4 weight -> [M, N].

    `dot_scaled`: use `tl.dot_scaled` (default: on a GPU of compute capability 10 or more, and for MXFP4 under
    the interpreter); else the dequantize-then-dot path."""
    packed, scales, g, group, e4m3 = _weight_parts(weight)
    if e4m3 != (act.global_scale is not None):
        raise ValueError("activation and weight must be the same FP4 format (NVFP4 with NVFP4, MXFP4 with "
                         "MXFP4)")
    if act.data.shape[1] != packed.shape[1]:
        raise ValueError(f"activation holds {act.data.shape[1]} bytes a row, the weight {packed.shape[1]}")
    if dot_scaled is None:
        if interpreting():
            dot_scaled = not e4m3
        else:
            dot_scaled = torch.cuda.get_device_capability(act.data.device)[0] >= 10
    a_scales = act.scale.view(torch.uint8) if e4m3 else act.scale
    check_device(act.data, a_scales, packed, scales)
    m, n, kp = act.data.shape[0], packed.shape[0], packed.shape[1] * 2
    cfg = dict(config or w4a4_config(m, n, kp, dot_scaled))
    if cfg["BLOCK_K"] % group:
        raise ValueError(f"BLOCK_K must be a multiple of the block size {group}, got {cfg['BLOCK_K']}")
    alpha = (act.global_scale * g).reshape(1).float() if e4m3 else scales
    c = torch.empty(m, n, device=act.data.device, dtype=out_dtype)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    fp4_w4a4_kernel[grid](act.data, a_scales, packed, scales, alpha, c, m, n, kp, act.data.stride(0),
                          a_scales.stride(0), packed.stride(0), scales.stride(0), c.stride(0), GROUP=group,
                          SCALE_E4M3=e4m3, HAS_GLOBAL=e4m3, DOT_SCALED=dot_scaled,
                          DOT_DTYPE=tl.float32 if interpreting() else tl.bfloat16, **cfg)
    return c


def fp4_w4a4_linear(x: torch.Tensor, weight: Nvfp4Weight | Mxfp4Weight,
                    input_scale: torch.Tensor | None = None, dot_scaled: bool | None = None,
                    config: dict | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N]: quantize x to the weight's FP4 format (NVFP4: with the calibrated `input_scale`
    as its global scale, or a dynamic one), then `fp4_w4a4_gemm`. Output in x's dtype."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if isinstance(weight, Nvfp4Weight):
        act = quantize_nvfp4(x2, global_scale=input_scale)
    else:
        if input_scale is not None:
            raise ValueError("MXFP4 activations have no per-tensor scale; input_scale must be None")
        act = quantize_mxfp4(x2)
    return fp4_w4a4_gemm(act, weight, x.dtype, dot_scaled, config).reshape(*lead, -1)
