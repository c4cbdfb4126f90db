"""MLA absorbed decode attention over a paged latent cache (BF16, FP8 E4M3, NVFP4): DeepSeek-V3's decode step.

An MLA layer caches per token the normed latent [1, r] and the roped key part [1, rope]
(runtime/kv_format.py's "latent" and "k_rope" streams), one KV head that every query head shares. Absorbed
decode folds W_uk into the query (q_latent = W_uk^T q_nope, done by the caller) and applies W_uv after the
weighted sum of latents (also the caller's), so attention runs in latent space and the cache is never
expanded per head:
    key_s = [latent_s, k_rot_s], value_s = latent_s:    out[b, h] = softmax(sm_scale * q[b, h] . key) @ value

Both pools are kernels/torch_refs.py KvPools [slots, 1, D'] with slot = block_table[b, t // block_size] *
block_size + t % block_size, in the formats kernels/triton_paged_attention.py reads (per-head FP8 scales are
[1, 1] here), with optional calibrated offsets [1, D].

    grid (B, cdiv(H, H_BLOCK)): one program per sequence and block of H_BLOCK query heads (all heads when
    H <= H_BLOCK), so each cached latent row is read once per head block, not once per head
    q_even, q_odd = q_latent[heads, 0::2], q_latent[heads, 1::2]           # [H_BLOCK, r/2] each
    qr_even, qr_odd = q_rot[heads, 0::2], q_rot[heads, 1::2]               # [H_BLOCK, rope/2] each
    m, l, acc_even, acc_odd = -inf, 0, 0, 0
    for each tile of BLOCK_N tokens t < context_len:                        # tokens may span several pages
        slot = block_table[b, t // block_size] * block_size + t % block_size
        c_even, c_odd = dequantize(latent pool at slot)                     # [BLOCK_N, r/2] each, read once
        k_even, k_odd = dequantize(rotary-key pool at slot)                 # [BLOCK_N, rope/2] each
        s = (q_even @ c_even^T + q_odd @ c_odd^T + qr_even @ k_even^T + qr_odd @ k_odd^T) * sm_scale
        online softmax update of m, l; acc_x = acc_x * alpha + p @ c_x      # the latent is also the value
    out[b, heads] = interleave(acc_even, acc_odd) / l + mu_latent           # [H_BLOCK, r]

The halves are the GQA kernel's: a packed NVFP4 byte is its two neighbouring elements. Dims need not be
powers of two (r and rope are padded to one and masked; both even). Offsets: q . mu is the same for every
key, so both key offsets are dropped (softmax is shift-invariant); the latent offset comes back once as the
value offset (the weights sum to 1).

H_BLOCK is at most 16 heads on the fp32 path and 32 with 16-bit operands: the accumulator [H_BLOCK, r] and
the query stay in registers. At r = 512, ptxas for sm_90a (8 warps, BLOCK_N = 16) fits 32 heads of bf16 q
over BF16 or NVFP4 latents without spilling (194 registers; FP8 spills 108 bytes), and 64 heads spill at 8
and at 16 warps; 32-row tiles run mma.sync, not Hopper's 64-row wgmma (FlashMLA's 64-row tiles rely on its
hand-placed warpgroup split). So DeepSeek-V3 at TP 8 (16 heads a GPU) reads each latent once per sequence,
and at H = 128 four times (the later reads likely from L2; not measured). The fp32 path is for checks: at
r = 512 its FP8 variant spills (796 bytes).
Dot operands: fp32 with IEEE products when q is fp32 or under the interpreter (whose bf16 tl.dot is wrong);
bf16/fp16 q on a GPU runs the tensor cores with q, the dequantized latents and the softmax weights rounded
to q's dtype and fp32 accumulation (FlashAttention's and FlashMLA's choice: decode at 128 heads does
~240 flops per cached byte, compute-bound on fp32 FMAs).

Reference: kernels/torch_refs.py `mla_decode_attention_ref` (gather, dequantize, softmax in fp32). The fp32
path matches it within 2e-5 absolute on unit-scale values (fp32 sums in another order; the dropped offsets'
softmax shift). The 16-bit path adds bf16's 2^-8 relative rounding of p and of FP8-dequantized latents; it
is checked on a GPU by benchmarks/gpu_check.py, not here. FlashMLA (deepseek-ai/FlashMLA) is the production
kernel on Hopper; it is not installable here. Not done here: split-KV for long contexts at small batch, tile
sizes tuned on hardware, and MTP (several query tokens per sequence).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.torch_refs import KvPool, check_mla_decode_inputs
from kiln.kernels.triton_codecs import check_device, interpreting
from kiln.kernels.triton_paged_attention import _load_kv_halves, _pool_args


@triton.jit
def _dot(a, b, DOT_16: tl.constexpr):
    if DOT_16:
        out = tl.dot(a, b)  # 16-bit operands on the tensor cores, fp32 accumulation
    else:
        out = tl.dot(a, b, input_precision="ieee")
    return out


@triton.jit
def mla_decode_kernel(
    q_ptr, q_rot_ptr, c_ptr, c_scale_ptr, c_g_ptr, c_offset_ptr, k_ptr, k_scale_ptr, k_g_ptr, table_ptr,
    lens_ptr, out_ptr,
    sm_scale, stride_qb, stride_qh, stride_rb, stride_rh, stride_tb, stride_ob, stride_oh, HEADS, PAGE,
    RANK: tl.constexpr, ROPE: tl.constexpr, RANK_HALF_PAD: tl.constexpr, ROPE_HALF_PAD: tl.constexpr,
    H_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
    C_FORMAT: tl.constexpr, C_SCALE_MODE: tl.constexpr, K_FORMAT: tl.constexpr, K_SCALE_MODE: tl.constexpr,
    HAS_OFFSET: tl.constexpr, DOT_16: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * H_BLOCK + tl.arange(0, H_BLOCK)
    head_ok = heads < HEADS
    i = tl.arange(0, RANK_HALF_PAD)
    i_ok = i < RANK // 2
    dot_ty = q_ptr.dtype.element_ty if DOT_16 else tl.float32
    q_mask = head_ok[:, None] & i_ok[None, :]
    q_row = q_ptr + b * stride_qb + heads[:, None] * stride_qh + 2 * i[None, :]
    q_even = tl.load(q_row, mask=q_mask, other=0.0).to(dot_ty)
    q_odd = tl.load(q_row + 1, mask=q_mask, other=0.0).to(dot_ty)
    j = tl.arange(0, ROPE_HALF_PAD)
    if ROPE > 0:
        r_mask = head_ok[:, None] & (j < ROPE // 2)[None, :]
        r_row = q_rot_ptr + b * stride_rb + heads[:, None] * stride_rh + 2 * j[None, :]
        qr_even = tl.load(r_row, mask=r_mask, other=0.0).to(dot_ty)
        qr_odd = tl.load(r_row + 1, mask=r_mask, other=0.0).to(dot_ty)
    length = tl.load(lens_ptr + b)
    m_i = tl.full((H_BLOCK,), float("-inf"), tl.float32)
    l_i = tl.zeros((H_BLOCK,), tl.float32)
    acc_even = tl.zeros((H_BLOCK, RANK_HALF_PAD), tl.float32)
    acc_odd = tl.zeros((H_BLOCK, RANK_HALF_PAD), tl.float32)
    for start in range(0, length, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        valid = t < length
        page = tl.load(table_ptr + b * stride_tb + t // PAGE, mask=valid, other=0)
        slot = page * PAGE + t % PAGE
        # one KV head (head 0 of 1): a per-head FP8 scale is the one head's
        c_even, c_odd = _load_kv_halves(c_ptr, c_scale_ptr, c_g_ptr, slot, valid, 0, i, 1, RANK, C_FORMAT,
                                        C_SCALE_MODE)
        c_even = c_even.to(dot_ty)
        c_odd = c_odd.to(dot_ty)
        s = _dot(q_even, tl.trans(c_even), DOT_16) + _dot(q_odd, tl.trans(c_odd), DOT_16)  # [H_BLOCK, N]
        if ROPE > 0:
            k_even, k_odd = _load_kv_halves(k_ptr, k_scale_ptr, k_g_ptr, slot, valid, 0, j, 1, ROPE, K_FORMAT,
                                            K_SCALE_MODE)
            s += _dot(qr_even, tl.trans(k_even.to(dot_ty)), DOT_16)
            s += _dot(qr_odd, tl.trans(k_odd.to(dot_ty)), DOT_16)
        s = tl.where(valid[None, :], s * sm_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p = p.to(dot_ty)
        acc_even = acc_even * alpha[:, None] + _dot(p, c_even, DOT_16)  # the latent is the value too
        acc_odd = acc_odd * alpha[:, None] + _dot(p, c_odd, DOT_16)
        m_i = m_new
    denom = tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty sequence gives zeros, not 0/0
    out_even = acc_even / denom
    out_odd = acc_odd / denom
    if HAS_OFFSET:
        offset = c_offset_ptr + 2 * i[None, :]
        has_tokens = (l_i > 0)[:, None]
        out_even += tl.where(has_tokens, tl.load(offset, mask=i_ok[None, :], other=0.0), 0.0)
        out_odd += tl.where(has_tokens, tl.load(offset + 1, mask=i_ok[None, :], other=0.0), 0.0)
    o_row = out_ptr + b * stride_ob + heads[:, None] * stride_oh + 2 * i[None, :]
    tl.store(o_row, out_even.to(out_ptr.dtype.element_ty), mask=q_mask)
    tl.store(o_row + 1, out_odd.to(out_ptr.dtype.element_ty), mask=q_mask)


def _half_pad(dim: int) -> int:
    """dim / 2 padded to a power of two of at least 16 (tl.dot's smallest K)."""
    return max(16, triton.next_power_of_2(max(1, dim // 2)))


def mla_decode_attention(q_latent: torch.Tensor, q_rot: torch.Tensor, latent_pool: KvPool, rot_pool: KvPool,
                         block_table: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                         sm_scale: float, block_n: int = 16,
                         heads_per_program: int | None = None) -> torch.Tensor:
    """One MLA decode step: q_latent [B, H, r] and q_rot [B, H, rope] attend to each sequence's first
    context_lens[b] cached tokens in latent space. Returns [B, H, r] in q_latent's dtype (W_uv not applied).

    latent_pool [slots, 1, r] and rot_pool [slots, 1, rope]: KvPools in any format (the runtime stores both
    streams of a layer in one); block_table int32 [B, max_blocks]; context_lens int32 [B]. sm_scale is the
    unabsorbed head's softmax scale (no default: r does not tell it). heads_per_program: None chooses as the
    module docstring says (tests pass a small one to run several head blocks)."""
    check_mla_decode_inputs(q_latent, q_rot, latent_pool, rot_pool, block_table, context_lens, block_size)
    for name, value in (("heads_per_program", heads_per_program), ("block_n", block_n)):
        if value is not None and (value < 16 or value & (value - 1)):  # tl.dot's smallest M and K
            raise ValueError(f"{name} must be a power of two of at least 16, got {value}")
    check_device(q_latent, q_rot, latent_pool.data, rot_pool.data, block_table, context_lens)
    pool_tensors = [t for p in (latent_pool, rot_pool) for t in (p.data, p.scale) if t is not None]
    if not all(t.is_contiguous() for t in pool_tensors):
        raise ValueError("the pools' data and scales must be contiguous (the kernel indexes them by slot)")
    batch, heads, rank = q_latent.shape
    rope = q_rot.shape[2]
    dot_16 = not interpreting() and q_latent.dtype in (torch.bfloat16, torch.float16)
    cap = heads_per_program or (32 if dot_16 else 16)
    h_block = min(cap, max(16, triton.next_power_of_2(heads)))
    q_latent = q_latent if q_latent.stride(-1) == 1 else q_latent.contiguous()
    q_rot = q_rot if q_rot.stride(-1) == 1 else q_rot.contiguous()
    block_table = block_table.contiguous()
    out = torch.empty(batch, heads, rank, dtype=q_latent.dtype, device=q_latent.device)
    c_data, c_scale, c_g, c_fmt, c_mode = _pool_args(latent_pool, out)
    k_data, k_scale, k_g, k_fmt, k_mode = _pool_args(rot_pool, out)
    offset = latent_pool.offset.float().contiguous() if latent_pool.offset is not None else out
    # rot_pool.offset is not read, nor the latent's as a key: softmax is shift-invariant (module docstring)
    mla_decode_kernel[(batch, triton.cdiv(heads, h_block))](
        q_latent, q_rot, c_data, c_scale, c_g, offset, k_data, k_scale, k_g, block_table, context_lens, out,
        float(sm_scale), q_latent.stride(0), q_latent.stride(1), q_rot.stride(0), q_rot.stride(1),
        block_table.stride(0), out.stride(0), out.stride(1), heads, block_size,
        RANK=rank, ROPE=rope, RANK_HALF_PAD=_half_pad(rank), ROPE_HALF_PAD=_half_pad(rope), H_BLOCK=h_block,
        BLOCK_N=16 if interpreting() else block_n, C_FORMAT=c_fmt, C_SCALE_MODE=c_mode, K_FORMAT=k_fmt,
        K_SCALE_MODE=k_mode, HAS_OFFSET=latent_pool.offset is not None, DOT_16=dot_16,
        num_warps=8 if rank >= 256 else 4,
    )
    return out
