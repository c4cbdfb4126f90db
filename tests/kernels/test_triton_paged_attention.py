"""Paged decode attention over BF16/FP8/NVFP4 KV pools against gather + dequantize + torch SDPA.

Tolerance: 2e-5 absolute on unit-scale values (fp32 softmax and sums in another order). One test fills the
pools through runtime/paged_kv_cache.py itself, so the kernel reads the exact layout the runtime stores."""

from __future__ import annotations

import pytest
import torch

# triton_setup first: it skips without Triton and sets TRITON_INTERPRET before any kernel is defined
# isort: off
from tests.kernels.triton_setup import DEVICE, make_pool, pool_to
from kiln.kernels.kv_nvfp4 import (
    nvfp4_kv_global_scale,
)
from kiln.kernels.torch_refs import KvPool, paged_decode_attention_ref
from kiln.kernels.triton_paged_attention import paged_decode_attention
# isort: on

torch.set_num_threads(1)
ATOL = 2e-5


def _case(batch, heads, kv_heads, dim, block_size, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks = sum(-(-n // block_size) for n in lengths) + 2
    slots = (blocks + 1) * block_size
    k = torch.randn(slots, kv_heads, dim, generator=g)
    v = torch.randn(slots, kv_heads, dim, generator=g)
    q = torch.randn(batch, heads, dim, generator=g)
    width = max(1, max(-(-n // block_size) for n in lengths))
    order = torch.randperm(blocks, generator=g).tolist()  # blocks of a sequence are not contiguous
    table = torch.full((batch, width), blocks, dtype=torch.int32)  # unused entries: the null block
    for b, n in enumerate(lengths):
        need = -(-n // block_size)
        table[b, :need] = torch.tensor(order[:need], dtype=torch.int32)
        order = order[need:]
    return q, k, v, table, torch.tensor(lengths, dtype=torch.int32)


KINDS = ["bf16", "fp8_per_tensor", "fp8_per_head", "fp8_dynamic", "nvfp4"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("heads,kv_heads,block_size", [(4, 4, 16), (8, 2, 4)])  # MHA; GQA with small pages
def test_matches_gather_dequantize_sdpa(kind, heads, kv_heads, block_size):
    q, k, v, table, lens = _case(3, heads, kv_heads, 64, block_size, [5, 0, 37])
    k_pool, v_pool = make_pool(kind, k), make_pool(kind, v)
    out = paged_decode_attention(q.to(DEVICE), pool_to(k_pool), pool_to(v_pool), table.to(DEVICE), lens.to(DEVICE),
                                 block_size)
    ref = paged_decode_attention_ref(q, k_pool, v_pool, table, lens, block_size)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.cpu(), ref, rtol=0, atol=ATOL)
    assert torch.equal(out[1].cpu(), torch.zeros_like(out[1].cpu()))  # an empty sequence attends to nothing


def test_fp8_keys_nvfp4_values_with_offsets_and_a_custom_scale():
    q, k, v, table, lens = _case(2, 8, 2, 32, 8, [19, 8], seed=1)
    mu = torch.randn(2, 32, generator=torch.Generator().manual_seed(9)) * 3
    k_pool, v_pool = make_pool("fp8_per_head", k + mu, offset=mu), make_pool("nvfp4", v + mu, offset=mu)
    out = paged_decode_attention(q.to(DEVICE), pool_to(k_pool), pool_to(v_pool), table.to(DEVICE), lens.to(DEVICE), 8,
                                 sm_scale=0.3)
    ref = paged_decode_attention_ref(q, k_pool, v_pool, table, lens, 8, sm_scale=0.3)
    torch.testing.assert_close(out.cpu(), ref, rtol=0, atol=1e-4)  # the dropped K offset moves fp32 roundings


@pytest.mark.parametrize("fmt,scaling",
                         [("fp8_e4m3", "dynamic"), ("fp8_e4m3", "per_head"), ("nvfp4", "e4m3_block16")])
def test_reads_the_runtimes_paged_cache(fmt, scaling):
    from kiln.runtime.kv_format import KvStream
    from kiln.runtime.paged_kv_cache import PagedKVCache

    kv_heads, dim, heads, block_size = 2, 32, 4, 4
    scale = {"dynamic": None, "per_head": torch.tensor([[0.01], [0.02]]),
             "e4m3_block16": nvfp4_kv_global_scale(torch.tensor(4.0))}[scaling]
    mu = torch.randn(kv_heads, dim, generator=torch.Generator().manual_seed(3))
    streams = [tuple(KvStream(name, kv_heads, dim, fmt, scaling, scale, mu) for name in ("k", "v"))]
    cache = PagedKVCache(streams, num_blocks=12, block_size=block_size)
    lengths = [7, 11]
    g = torch.Generator().manual_seed(4)
    new_k = torch.randn(2, 11, kv_heads, dim, generator=g) + mu
    new_v = torch.randn(2, 11, kv_heads, dim, generator=g) + mu
    positions = torch.arange(11).expand(2, -1)
    for seq in range(2):
        cache.add_sequence(seq)
    cache.prepare([0, 1], positions, positions < torch.tensor(lengths).unsqueeze(1))
    k_read, v_read = cache.update(0, (new_k, new_v), positions)  # fp32 [B, S, KVH, D], what attention sees

    tables = (cache.block_tables[0], cache.block_tables[1])
    table = torch.tensor([t + [cache.num_blocks] * (3 - len(t)) for t in tables], dtype=torch.int32)
    pools = [store.kernel_pool for store in cache.pools[0]]  # the runtime's pools, as the kernel reads them
    q = torch.randn(2, heads, dim, generator=g)
    lens = torch.tensor(lengths, dtype=torch.int32)
    out = paged_decode_attention(q.to(DEVICE), *(pool_to(p) for p in pools), table.to(DEVICE), lens.to(DEVICE),
                                 block_size)
    for b, n in enumerate(lengths):  # against SDPA over what the runtime's cache itself returns
        k = k_read[b, :n].repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        v = v_read[b, :n].repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        ref = torch.nn.functional.scaled_dot_product_attention(q[b].unsqueeze(1), k, v).squeeze(1)
        torch.testing.assert_close(out[b].cpu(), ref, rtol=0, atol=1e-4)


def test_bad_inputs_are_refused():
    q, k, _, table, lens = _case(2, 6, 4, 64, 16, [3, 4])
    pool = pool_to(make_pool("fp8_dynamic", k))
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        paged_decode_attention(q.to(DEVICE), pool, pool, table.to(DEVICE), lens.to(DEVICE), 16)
    with pytest.raises(TypeError, match="int32"):
        paged_decode_attention(q[:, :4].to(DEVICE), pool, pool, table.long().to(DEVICE), lens.to(DEVICE), 16)
    with pytest.raises(ValueError, match="FP8 KV scale"):
        KvPool("fp8_e4m3", pool.data, torch.ones(3))
    with pytest.raises(ValueError, match="unknown KV format"):
        KvPool("int4", pool.data)
