"""Paged decode attention over a quantized KV cache (BF16, FP8 E4M3, NVFP4), with GQA.

The cache is read where runtime/kv_pools.py stores it: per stream one pool of token slots
[slots, kv_heads, D'] with slot = block_table[b, t // block_size] * block_size + t % block_size, in the
layer's KV format (kernels/kv_fp8.py, kernels/kv_nvfp4.py):
    bf16/dense  data [slots, KVH, D]
    fp8_e4m3    data float8_e4m3fn [slots, KVH, D]; scale 0-dim (per tensor), [KVH, 1] (per head) or
                [slots, 1, 1] (dynamic, one per token)
    nvfp4       packed uint8 [slots, KVH, D/2] (element 2i in the low nibble), block_scale float8_e4m3fn
                [slots, KVH, D/16], a 0-dim fp32 global scale
and optionally the stream's calibrated offset mu [KVH, D], which the runtime adds back on reading.

    grid (B, KVH): one program per sequence and KV head serves the G = H / KVH query heads sharing it
    q_even, q_odd = q[heads of the group, 0::2], q[..., 1::2]              # [G, D/2] each (G padded to 16)
    m, l, acc_even, acc_odd = -inf, 0, 0, 0
    for each tile of BLOCK_N tokens t < context_len:                        # tokens may span several pages
        slot = block_table[b, t // block_size] * block_size + t % block_size
        k_even, k_odd = dequantize(K pool at slot, kv head)                # [BLOCK_N, D/2] fp32 each
        s = (q_even @ k_even^T + q_odd @ k_odd^T) * sm_scale                 # [G, BLOCK_N]
        online softmax update of m, l; acc_x = acc_x * alpha + p @ v_x
    out[b, group heads] = interleave(acc_even, acc_odd) / l + mu_V          # [G, D]

Dequantizing to even and odd halves reads a packed NVFP4 byte as its two neighbouring elements without
any interleave; FP8 and dense pools use the same halves. The K offset is dropped: q . mu_K is the same for
every key, and softmax is shift-invariant per query; the V offset is added once, since the weights sum to 1.

Reference: kernels/torch_refs.py `paged_decode_attention_ref` gathers the slots, dequantizes them with
the KV formats (what the runtime's cache returns), repeats KV heads for GQA and calls torch's
scaled_dot_product_attention in fp32.
The kernel matches it within 2e-5 absolute on unit-scale values (fp32 softmax and sums in a different order;
the K offset's softmax shift). FlashInfer's `BatchDecodeWithPagedKVCacheWrapper` (FP8 KV) is the production
alternative on a GPU; it is not installable here, so the comparison is against torch. Not done here: split-KV
(flash-decoding) for long contexts at small batch. MLA's absorbed decode over the latent cache is
kernels/triton_mla_decode.py, which reads its pools through `_load_kv_halves`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kiln.kernels.torch_refs import KvPool, check_block_table
from kiln.kernels.triton_codecs import check_device, e2m1_decode, e4m3_decode, interpreting

# FORMAT: 0 dense, 1 FP8 E4M3, 2 NVFP4 (a KV format's `kernel_format`, kernels/kv_codec.py);
# SCALE_MODE: 0 per tensor, 1 per KV head, 2 per token (what its `kernel_operands` says)


@triton.jit
def _load_kv_halves(data_ptr, scale_ptr, g_ptr, slot, valid, head, i, KV_HEADS,
                    HEAD_DIM: tl.constexpr, FORMAT: tl.constexpr, SCALE_MODE: tl.constexpr):
    """K or V of tokens `slot` [BLOCK_N] at one KV head: fp32 (even, odd elements), each [BLOCK_N, len(i)],
    zero on invalid tokens and past HEAD_DIM / 2 (`i` may be padded to a power of two: MLA's latent)."""
    row = slot.to(tl.int64)[:, None] * KV_HEADS + head  # [BLOCK_N, 1] (token, head) row of the pool
    mask = valid[:, None] & (i < HEAD_DIM // 2)[None, :]
    if FORMAT == 2:  # NVFP4: one byte holds elements 2i (low nibble) and 2i + 1
        byte = tl.load(data_ptr + row * (HEAD_DIM // 2) + i[None, :], mask=mask, other=0).to(tl.int32)
        block_scale = e4m3_decode(tl.load(scale_ptr + row * (HEAD_DIM // 16) + i[None, :] // 8, mask=mask,
                                          other=0))
        scale = block_scale * tl.load(g_ptr)
        even = e2m1_decode(byte & 15) * scale
        odd = e2m1_decode(byte >> 4) * scale
    else:
        base = data_ptr + row * HEAD_DIM + 2 * i[None, :]
        if FORMAT == 1:  # FP8 bytes times a per-tensor, per-head or per-token scale
            even = e4m3_decode(tl.load(base, mask=mask, other=0))
            odd = e4m3_decode(tl.load(base + 1, mask=mask, other=0))
            if SCALE_MODE == 0:
                scale = tl.load(scale_ptr)
            elif SCALE_MODE == 1:
                scale = tl.load(scale_ptr + head)
            else:
                scale = tl.load(scale_ptr + slot, mask=valid, other=0.0)[:, None]
            even = even * scale
            odd = odd * scale
        else:
            even = tl.load(base, mask=mask, other=0.0).to(tl.float32)
            odd = tl.load(base + 1, mask=mask, other=0.0).to(tl.float32)
    return even, odd


@triton.jit
def _dot(a, b):
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def paged_decode_kernel(
    q_ptr, k_ptr, k_scale_ptr, k_g_ptr, v_ptr, v_scale_ptr, v_g_ptr, v_offset_ptr, table_ptr, lens_ptr,
    out_ptr,
    sm_scale, stride_qb, stride_qh, stride_tb, stride_ob, stride_oh, KV_HEADS, GROUP, PAGE,
    HEAD_DIM: tl.constexpr, G_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    K_FORMAT: tl.constexpr, K_SCALE_MODE: tl.constexpr, V_FORMAT: tl.constexpr, V_SCALE_MODE: tl.constexpr,
    HAS_V_OFFSET: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    g = tl.arange(0, G_PAD)
    heads = kv_head * GROUP + g
    head_ok = g < GROUP
    i = tl.arange(0, HEAD_DIM // 2)
    q_row = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + 2 * i[None, :]
    q_even = tl.load(q_row, mask=head_ok[:, None], other=0.0).to(tl.float32)
    q_odd = tl.load(q_row + 1, mask=head_ok[:, None], other=0.0).to(tl.float32)
    length = tl.load(lens_ptr + b)
    m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc_even = tl.zeros((G_PAD, HEAD_DIM // 2), tl.float32)
    acc_odd = tl.zeros((G_PAD, HEAD_DIM // 2), tl.float32)
    for start in range(0, length, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        valid = t < length
        page = tl.load(table_ptr + b.to(tl.int64) * stride_tb + t // PAGE, mask=valid, other=0)
        slot = page * PAGE + t % PAGE
        k_even, k_odd = _load_kv_halves(k_ptr, k_scale_ptr, k_g_ptr, slot, valid, kv_head, i, KV_HEADS,
                                        HEAD_DIM, K_FORMAT, K_SCALE_MODE)
        s = (_dot(q_even, tl.trans(k_even)) + _dot(q_odd, tl.trans(k_odd))) * sm_scale  # [G_PAD, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_even, v_odd = _load_kv_halves(v_ptr, v_scale_ptr, v_g_ptr, slot, valid, kv_head, i, KV_HEADS,
                                        HEAD_DIM, V_FORMAT, V_SCALE_MODE)
        acc_even = acc_even * alpha[:, None] + _dot(p, v_even)
        acc_odd = acc_odd * alpha[:, None] + _dot(p, v_odd)
        m_i = m_new
    denom = tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty sequence gives zeros, not 0/0
    out_even = acc_even / denom
    out_odd = acc_odd / denom
    if HAS_V_OFFSET:
        offset = v_offset_ptr + kv_head * HEAD_DIM + 2 * i[None, :]
        has_tokens = (l_i > 0)[:, None]
        out_even += tl.where(has_tokens, tl.load(offset), 0.0)
        out_odd += tl.where(has_tokens, tl.load(offset + 1), 0.0)
    o_row = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + 2 * i[None, :]
    tl.store(o_row, out_even.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
    tl.store(o_row + 1, out_odd.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])


def _pool_args(pool: KvPool, dummy: torch.Tensor):
    """(data, scale, global scale, format code, scale mode) pointers and flags for the kernel."""
    data, scale, global_scale, mode = pool.codec.kernel_operands(pool.data, pool.scale, pool.global_scale, dummy)
    return data, scale, global_scale, pool.codec.kernel_format, mode


def paged_decode_attention(q: torch.Tensor, k_pool: KvPool, v_pool: KvPool, block_table: torch.Tensor,
                           context_lens: torch.Tensor, block_size: int, sm_scale: float | None = None,
                           block_n: int = 64) -> torch.Tensor:
    """One decode step: q [B, H, D] attends to each sequence's first context_lens[b] cached tokens.

    block_table: int32 [B, max_blocks]; context_lens: int32 [B]; H a multiple of the pools' KV heads.
    Returns [B, H, D] in q's dtype. sm_scale defaults to 1 / sqrt(D)."""
    if q.ndim != 3:
        raise ValueError(f"q must be [B, H, D], got shape {tuple(q.shape)}")
    batch, heads, dim = q.shape
    kv_heads = k_pool.kv_heads
    if v_pool.kv_heads != kv_heads or k_pool.head_dim != dim or v_pool.head_dim != dim:
        raise ValueError(f"q is [B, {heads}, {dim}]; the K and V pools hold {k_pool.kv_heads} and "
                         f"{v_pool.kv_heads} heads of {k_pool.head_dim} and {v_pool.head_dim}")
    if heads % kv_heads:
        raise ValueError(f"GQA needs the query heads ({heads}) to be a multiple of the KV heads ({kv_heads})")
    if dim % 32 or dim & (dim - 1):
        raise ValueError(f"head dim must be a power of two and at least 32, got {dim}")
    check_block_table(block_table, context_lens, batch)
    # k_pool.offset is not read: softmax is shift-invariant per query (module docstring)
    check_device(q, k_pool.data, v_pool.data, block_table, context_lens)
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_table = block_table.contiguous()
    out = torch.empty(batch, heads, dim, dtype=q.dtype, device=q.device)
    k_data, k_scale, k_g, k_fmt, k_mode = _pool_args(k_pool, out)
    v_data, v_scale, v_g, v_fmt, v_mode = _pool_args(v_pool, out)
    v_offset = v_pool.offset.float().contiguous() if v_pool.offset is not None else out
    group = heads // kv_heads
    paged_decode_kernel[(batch, kv_heads)](
        q, k_data, k_scale, k_g, v_data, v_scale, v_g, v_offset, block_table, context_lens, out,
        float(sm_scale if sm_scale is not None else 1.0 / math.sqrt(dim)),
        q.stride(0), q.stride(1), block_table.stride(0), out.stride(0), out.stride(1), kv_heads, group,
        block_size,
        HEAD_DIM=dim, G_PAD=max(16, triton.next_power_of_2(group)), BLOCK_N=16 if interpreting() else block_n,
        K_FORMAT=k_fmt, K_SCALE_MODE=k_mode, V_FORMAT=v_fmt, V_SCALE_MODE=v_mode,
        HAS_V_OFFSET=v_pool.offset is not None, num_warps=4,
    )
    return out
