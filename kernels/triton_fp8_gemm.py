"""FP8 W8A8 GEMM: E4M3 activations x E4M3 weights, fp32 accumulation, both scales in the epilogue.

    out[m, n] = (sum_k qx[m, k] * qw[n, k]) * sx[m] * sw[n]
        qx, sx: the activation, quantized per token (dynamic, sx [M]) or per tensor (static, one sx)
        qw, sw: the weight as kernels/fp8.py stores it, with a per-channel [N, 1] or per-tensor 0-dim scale

    grid: (M / BLOCK_M * N / BLOCK_N, SPLIT_K); each program walks its share of K in BLOCK_K steps:
        acc += dot(qx[tile], qw[tile]^T)          # fp8 x fp8 -> fp32 accumulation
        out[tile] (+)= acc * sx * sw              # split-K partials are added atomically into fp32

Compiled for sm_90, BLOCK_M >= 64 runs FP8 wgmma (e4m3 x e4m3); decode's BLOCK_M = 16 is below wgmma's 64
rows, so Triton widens the tiles to fp16 (exactly) for mma.sync, which costs nothing a memory-bound decode
GEMM would notice (tests/kernels/test_triton_compile.py checks the instructions). An E4M3 x E4M3 product is
exact in fp32 (4 x 4 significant bits), so the kernel differs from its reference (kernels/torch_refs.py
`fp8_gemm_ref`, `fp8_linear_ref`: dequantize both operands, matmul in fp32) only by the order of the fp32
sums and by applying the two scales to the sum rather than to each operand: within 1e-4 of the output's
largest magnitude (tests/kernels/test_triton_fp8_gemm.py). Under TRITON_INTERPRET=1 the fp8 tiles are
widened to fp32 before `tl.dot`.

The library to compare with on a GPU is `torch._scaled_mm(qx, qw.t(), scale_a=sx [M, 1], scale_b=sw [1, N])`
(cuBLASLt's FP8 GEMM, row-wise scales on Hopper since torch 2.5); it needs CUDA, so only
benchmarks/gpu_check.py calls it. vLLM serves the same product with CUTLASS (`cutlass_scaled_mm`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.fp8 import FP8_DTYPE
from kiln.kernels.triton_codecs import check_device, interpreting
from kiln.kernels.triton_quant import quantize_fp8


@triton.jit
def fp8_gemm_kernel(
    a_ptr, b_ptr, a_scale_ptr, b_scale_ptr, c_ptr, M, N, K,
    stride_am, stride_bn, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // tiles_n
    pid_n = pid % tiles_n
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    first = pid_k * per_split
    last = tl.minimum(first + per_split, k_tiles)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(first, last):
        k = t * BLOCK_K + rk
        a = tl.load(a_ptr + rm[:, None].to(tl.int64) * stride_am + k[None, :],
                    mask=(rm[:, None] < M) & (k[None, :] < K), other=0)
        b = tl.load(b_ptr + rn[None, :].to(tl.int64) * stride_bn + k[:, None],
                    mask=(rn[None, :] < N) & (k[:, None] < K), other=0)  # [BLOCK_K, BLOCK_N] of w [N, K]
        a = a.to(tl.float8e4nv, bitcast=True)
        b = b.to(tl.float8e4nv, bitcast=True)
        if UPCAST:
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32))
        else:
            acc = tl.dot(a, b, acc)
    a_scale = tl.load(a_scale_ptr + rm, mask=rm < M, other=0.0)
    b_scale = tl.load(b_scale_ptr + rn, mask=rn < N, other=0.0)
    out = acc * a_scale[:, None] * b_scale[None, :]
    c = c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT_K > 1:
        tl.atomic_add(c, out, mask=mask)
    else:
        tl.store(c, out.to(c_ptr.dtype.element_ty), mask=mask)


def gemm_config(m: int, n: int, k: int, block_k: int) -> dict:
    """Tile sizes for an [m, k] x [k, n] product: decode shapes (m <= 16) split K until ~2 programs per SM.

    Untuned heuristics (no GPU was available when they were written); benchmarks/gpu_check.py reports what
    they reach against the HBM bound. Under the interpreter: small tiles, split K in two (both paths run)."""
    if interpreting():
        return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": min(block_k, 64), "SPLIT_K": 2 if k >= 128 else 1,
                "num_warps": 4, "num_stages": 1}
    if m <= 16:
        block_m, block_n = 16, 64
    elif m <= 64:
        block_m, block_n = 64, 128
    else:
        block_m, block_n = 128, 128
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    k_tiles = triton.cdiv(k, block_k)
    split = 1
    while tiles * split < 264 and split * 2 <= k_tiles // 2 and split < 16:  # >= 2 K tiles per split
        split *= 2
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split,
            "num_warps": 4, "num_stages": 4}


def _per_row(scale: torch.Tensor, rows: int, name: str) -> torch.Tensor:
    scale = scale.detach().float()
    if scale.numel() == 1:
        return scale.reshape(1).expand(rows).contiguous()
    if scale.numel() != rows:
        raise ValueError(f"{name} must have one value or {rows}, got shape {tuple(scale.shape)}")
    return scale.reshape(rows).contiguous()


def fp8_gemm(qx: torch.Tensor, x_scale: torch.Tensor, qw: torch.Tensor, w_scale: torch.Tensor,
             out_dtype: torch.dtype = torch.bfloat16, config: dict | None = None) -> torch.Tensor:
    """qx float8_e4m3fn [M, K] (scale [M, 1] or 0-dim) times qw float8_e4m3fn [N, K] (scale [N, 1] or 0-dim)^T
    -> [M, N] in `out_dtype`."""
    for name, t in (("qx", qx), ("qw", qw)):
        if t.dtype != FP8_DTYPE or t.ndim != 2:
            raise TypeError(f"{name} must be a 2-D {FP8_DTYPE} tensor, got {t.dtype} of shape "
                            f"{tuple(t.shape)}")
    m, k = qx.shape
    n = qw.shape[0]
    if qw.shape[1] != k:
        raise ValueError(f"qx is [{m}, {k}] but qw is {tuple(qw.shape)}: the K dimensions differ")
    check_device(qx, qw)
    qx, qw = qx.contiguous(), qw.contiguous()
    x_scale, w_scale = _per_row(x_scale, m, "x_scale"), _per_row(w_scale, n, "w_scale")
    cfg = dict(config or gemm_config(m, n, k, block_k=256))
    split = cfg["SPLIT_K"]
    c = (torch.zeros if split > 1 else torch.empty)(m, n, device=qx.device,
                                                    dtype=torch.float32 if split > 1 else out_dtype)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]), split)
    fp8_gemm_kernel[grid](qx.view(torch.uint8), qw.view(torch.uint8), x_scale, w_scale, c, m, n, k,
                          qx.stride(0), qw.stride(0), c.stride(0), UPCAST=interpreting(), **cfg)
    return c.to(out_dtype) if c.dtype != out_dtype else c


def fp8_linear(x: torch.Tensor, qw: torch.Tensor, w_scale: torch.Tensor,
               input_scale: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N]: quantize x per token (or with the static `input_scale`), then `fp8_gemm`.
    The output has x's dtype."""
    lead = x.shape[:-1]
    act = quantize_fp8(x.reshape(-1, x.shape[-1]), input_scale=input_scale)
    out = fp8_gemm(act.data, act.scale, qw, w_scale, out_dtype=x.dtype, config=config)
    return out.reshape(*lead, qw.shape[0])
