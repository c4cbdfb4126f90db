"""MLA absorbed paged decode attention over BF16/FP8/NVFP4 latent pools against gather + dequantize + softmax.

Tolerance: 2e-5 absolute on unit-scale values (fp32 softmax and sums in another order), 1e-4 where large
key offsets are dropped (as in test_triton_paged_attention.py). Beside the reference: plain torch SDPA over
latents gathered here, the runtime's paged cache itself, and runtime/model.py's absorbed MLA step."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

# triton_setup first: it skips without Triton and sets TRITON_INTERPRET before any kernel is defined
# isort: off
from tests.kernels.triton_setup import DEVICE, make_pool, pool_to, INTERPRET, output_rounding, relative_max_error
from kiln.kernels import gpu
from kiln.kernels.kv_nvfp4 import (
    nvfp4_kv_global_scale,
)
from kiln.kernels.torch_refs import KvPool, mla_decode_attention_ref
from kiln.kernels.triton_mla_decode import mla_decode_attention
# isort: on

torch.set_num_threads(1)
ATOL = 2e-5
KINDS = ["fp32", "bf16", "fp8_per_tensor", "fp8_per_head", "fp8_dynamic", "nvfp4"]


def _case(batch, heads, rank, rope, block_size, lengths, seed=0):
    """q_latent [B, H, r], q_rot [B, H, rope], latent [slots, 1, r], k_rot [slots, 1, rope], a shuffled
    block table (unused entries: the null block past the last) and the context lengths."""
    g = torch.Generator().manual_seed(seed)
    blocks = sum(-(-n // block_size) for n in lengths) + 2
    slots = (blocks + 1) * block_size
    latent = torch.randn(slots, 1, rank, generator=g)
    k_rot = torch.randn(slots, 1, rope, generator=g)
    q_latent = torch.randn(batch, heads, rank, generator=g)
    q_rot = torch.randn(batch, heads, rope, generator=g)
    width = max(1, max(-(-n // block_size) for n in lengths))
    order = torch.randperm(blocks, generator=g).tolist()  # blocks of a sequence are not contiguous
    table = torch.full((batch, width), blocks, dtype=torch.int32)
    for b, n in enumerate(lengths):
        need = -(-n // block_size)
        table[b, :need] = torch.tensor(order[:need], dtype=torch.int32)
        order = order[need:]
    return q_latent, q_rot, latent, k_rot, table, torch.tensor(lengths, dtype=torch.int32)


def _run(q_latent, q_rot, latent_pool, rot_pool, table, lens, block_size, sm_scale, **kwargs):
    out = mla_decode_attention(q_latent.to(DEVICE), q_rot.to(DEVICE), pool_to(latent_pool), pool_to(rot_pool),
                               table.to(DEVICE), lens.to(DEVICE), block_size, sm_scale, **kwargs)
    return out.cpu()


def _sdpa(q_latent, q_rot, latent, k_rot, table, lens, block_size, sm_scale):
    """Independent of the reference: gather the fp32 latents token by token, one-KV-head SDPA."""
    out = torch.zeros_like(q_latent)
    for b, n in enumerate(lens.tolist()):
        if n == 0:
            continue
        slots = [int(table[b, t // block_size]) * block_size + t % block_size for t in range(n)]
        c, k = latent[slots, 0], k_rot[slots, 0]  # [n, r], [n, rope]
        q = torch.cat([q_latent[b], q_rot[b]], dim=-1)[None]  # [1, H, r + rope]: heads as query rows
        out[b] = torch.nn.functional.scaled_dot_product_attention(
            q, torch.cat([c, k], dim=-1)[None], c[None], scale=sm_scale)[0]
    return out


SHAPES = [  # heads, rank, rope, block_size, heads_per_program
    (4, 32, 16, 16, None),  # the small test shape: all heads in one program, padded to 16
    (20, 48, 16, 4, 16),    # two head blocks (the second partly masked), r/2 = 24 padded to 32, small pages
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("heads,rank,rope,block_size,per_program", SHAPES)
def test_matches_gather_dequantize_softmax(kind, heads, rank, rope, block_size, per_program):
    q_latent, q_rot, latent, k_rot, table, lens = _case(3, heads, rank, rope, block_size, [5, 0, 37])
    latent_pool, rot_pool = make_pool(kind, latent), make_pool(kind, k_rot)
    sm_scale = 1 / math.sqrt(24)
    out = _run(q_latent, q_rot, latent_pool, rot_pool, table, lens, block_size, sm_scale,
               heads_per_program=per_program)
    ref = mla_decode_attention_ref(q_latent, q_rot, latent_pool, rot_pool, table, lens, block_size, sm_scale)
    assert out.shape == q_latent.shape and out.dtype == q_latent.dtype
    torch.testing.assert_close(out, ref, rtol=0, atol=ATOL)
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # an empty sequence attends to nothing


@pytest.mark.parametrize("kind", ["fp32", "fp8_dynamic"])
def test_deepseek_v3_dims_against_sdpa(kind):
    """r = 512, rope = 64, 16 heads (DeepSeek-V3's per-GPU heads at TP 8): the kernel, the reference and SDPA
    over the gathered (for FP8: bytes times scale, decoded here) latents agree."""
    q_latent, q_rot, latent, k_rot, table, lens = _case(2, 16, 512, 64, 16, [21, 40], seed=5)
    latent_pool, rot_pool = make_pool(kind, latent), make_pool(kind, k_rot)
    if kind == "fp8_dynamic":  # what the bytes hold, decoded by torch's own float8 cast
        latent = latent_pool.data.float() * latent_pool.scale
        k_rot = rot_pool.data.float() * rot_pool.scale
    sm_scale = 1 / math.sqrt(192)  # DeepSeek-V3's qk_nope 128 + rope 64
    out = _run(q_latent, q_rot, latent_pool, rot_pool, table, lens, 16, sm_scale)
    ref = mla_decode_attention_ref(q_latent, q_rot, latent_pool, rot_pool, table, lens, 16, sm_scale)
    sdpa = _sdpa(q_latent, q_rot, latent, k_rot, table, lens, 16, sm_scale)
    torch.testing.assert_close(out, ref, rtol=0, atol=ATOL)
    torch.testing.assert_close(out, sdpa, rtol=0, atol=ATOL)


def test_a_bf16_query_gives_a_bf16_output():
    q_latent, q_rot, latent, k_rot, table, lens = _case(2, 8, 32, 16, 4, [9, 30], seed=8)
    q_latent, q_rot = q_latent.bfloat16(), q_rot.bfloat16()
    pools = (make_pool("bf16", latent), make_pool("bf16", k_rot))
    out = _run(q_latent, q_rot, *pools, table, lens, 4, 0.25)
    ref = mla_decode_attention_ref(q_latent, q_rot, *pools, table, lens, 4, 0.25)
    assert out.dtype == torch.bfloat16
    # on a GPU the 16-bit operands also round p and the latents: benchmarks/gpu_check.py's bf16 rows
    operands = 0.0 if INTERPRET else 2**-7
    assert relative_max_error(out, ref) <= 2e-5 + output_rounding(torch.bfloat16) + operands


def test_a_long_context_over_many_shuffled_blocks():
    lengths = [300, 77, 1]
    q_latent, q_rot, latent, k_rot, table, lens = _case(3, 8, 32, 16, 4, lengths, seed=2)
    assert table.shape[1] == 75 and sorted(table[0].tolist()) != table[0].tolist()  # 75 scattered pages
    sm_scale = 0.2
    out = _run(q_latent, q_rot, make_pool("fp32", latent), make_pool("fp32", k_rot), table, lens, 4, sm_scale)
    sdpa = _sdpa(q_latent, q_rot, latent, k_rot, table, lens, 4, sm_scale)
    torch.testing.assert_close(out, sdpa, rtol=0, atol=ATOL)
    last = int(table[2, 0]) * 4  # one cached token: the output is its latent, whatever the scores
    torch.testing.assert_close(out[2], latent[last, 0].expand(8, -1), rtol=0, atol=1e-6)


def test_offsets_are_dropped_from_keys_and_added_to_the_output():
    q_latent, q_rot, latent, k_rot, table, lens = _case(2, 8, 32, 16, 8, [19, 8], seed=1)
    g = torch.Generator().manual_seed(9)
    mu_latent, mu_rot = torch.randn(1, 32, generator=g) * 3, torch.randn(1, 16, generator=g) * 3
    latent_pool = make_pool("fp8_per_head", latent + mu_latent, offset=mu_latent)
    rot_pool = make_pool("nvfp4", k_rot + mu_rot, offset=mu_rot)
    out = _run(q_latent, q_rot, latent_pool, rot_pool, table, lens, 8, 0.3)
    ref = mla_decode_attention_ref(q_latent, q_rot, latent_pool, rot_pool, table, lens, 8, 0.3)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-4)  # the dropped key offsets move fp32 roundings


def test_no_rotary_part():
    q_latent, q_rot, latent, k_rot, table, lens = _case(2, 4, 32, 0, 4, [9, 3], seed=3)
    out = _run(q_latent, q_rot, make_pool("fp32", latent), make_pool("fp32", k_rot), table, lens, 4, 0.25)
    torch.testing.assert_close(out, _sdpa(q_latent, q_rot, latent, k_rot, table, lens, 4, 0.25), rtol=0,
                               atol=ATOL)


@pytest.mark.parametrize("fmt,scaling", [("fp8_e4m3", "dynamic"), ("fp8_e4m3", "per_head"),
                                         ("nvfp4", "e4m3_block16")])
def test_reads_the_runtimes_paged_cache(fmt, scaling):
    from kiln.runtime.kv_format import KvStream
    from kiln.runtime.paged_kv_cache import PagedKVCache

    rank, rope, heads, block_size = 32, 16, 4, 4
    g = torch.Generator().manual_seed(4)
    mu = {"latent": torch.randn(1, rank, generator=g), "k_rope": torch.randn(1, rope, generator=g)}
    scale = {"dynamic": None, "per_head": torch.tensor([[0.02]]),
             "e4m3_block16": nvfp4_kv_global_scale(torch.tensor(5.0))}[scaling]
    streams = [tuple(KvStream(name, 1, dim, fmt, scaling, scale, mu[name])
                     for name, dim in (("latent", rank), ("k_rope", rope)))]
    cache = PagedKVCache(streams, num_blocks=12, block_size=block_size)
    lengths = [7, 11]
    new_latent = torch.randn(2, 11, 1, rank, generator=g) + mu["latent"]
    new_rot = torch.randn(2, 11, 1, rope, generator=g) + mu["k_rope"]
    positions = torch.arange(11).expand(2, -1)
    for seq in range(2):
        cache.add_sequence(seq)
    cache.prepare([0, 1], positions, positions < torch.tensor(lengths).unsqueeze(1))
    latent_read, rot_read = cache.update(0, (new_latent, new_rot), positions)  # fp32 [B, S, 1, D]

    tables = (cache.block_tables[0], cache.block_tables[1])
    table = torch.tensor([t + [cache.num_blocks] * (3 - len(t)) for t in tables], dtype=torch.int32)
    pools = [store.kernel_pool for store in cache.pools[0]]  # the runtime's pools, as the kernel reads them
    q_latent = torch.randn(2, heads, rank, generator=g)
    q_rot = torch.randn(2, heads, rope, generator=g)
    lens = torch.tensor(lengths, dtype=torch.int32)
    out = _run(q_latent, q_rot, *pools, table, lens, block_size, 0.2)
    for b, n in enumerate(lengths):  # against SDPA over what the runtime's cache itself returns
        c, k = latent_read[b, :n, 0], rot_read[b, :n, 0]
        q = torch.cat([q_latent[b], q_rot[b]], dim=-1)[None]
        ref = torch.nn.functional.scaled_dot_product_attention(q, torch.cat([c, k], dim=-1)[None], c[None],
                                                               scale=0.2)[0]
        torch.testing.assert_close(out[b], ref, rtol=0, atol=ATOL)


def test_reference_is_the_runtimes_absorbed_step():
    """runtime/model.py MlaAttention._absorbed (W_uk into the query, W_uv after) over the same tokens."""
    from kiln.runtime.attention import MlaAttention

    heads, nope, v_dim, rank, rope, block_size = 4, 8, 6, 32, 16, 4
    g = torch.Generator().manual_seed(6)
    _, _, latent, k_rot, table, lens = _case(2, heads, rank, rope, block_size, [13, 13], seed=6)
    w = torch.randn(heads * (nope + v_dim), rank, generator=g) * 0.3  # kv_b_proj: [H * (nope + v), r]
    spec = SimpleNamespace(num_heads=heads, qk_nope_head_dim=nope, v_head_dim=v_dim, kv_lora_rank=rank,
                           softmax_scale=1 / math.sqrt(nope + rope))
    layer = SimpleNamespace(spec=spec, kv_b_proj=SimpleNamespace(weight=w, input_quantizer=None))
    q_pass = torch.randn(2, 1, heads, nope, generator=g)  # [B, T = 1, H, nope]
    q_rot = torch.randn(2, 1, heads, rope, generator=g)
    slots = [[int(table[b, t // block_size]) * block_size + t % block_size for t in range(13)]
             for b in range(2)]
    cached_latent = torch.stack([latent[s, 0] for s in slots])  # [B, S, r]
    cached_rot = torch.stack([k_rot[s, 0] for s in slots])
    runtime = MlaAttention._absorbed(layer, q_pass, q_rot, cached_latent, cached_rot, None)[:, 0]  # [B, H, v]

    w_uk, w_uv = w.view(heads, nope + v_dim, rank).split([nope, v_dim], dim=1)
    q_latent = torch.einsum("bhn,hnr->bhr", q_pass[:, 0], w_uk)
    pools = (make_pool("fp32", latent), make_pool("fp32", k_rot))
    scale = spec.softmax_scale
    mixed = mla_decode_attention_ref(q_latent, q_rot[:, 0], *pools, table, lens, block_size, scale)
    torch.testing.assert_close(torch.einsum("bhr,hvr->bhv", mixed, w_uv), runtime, rtol=0, atol=1e-5)
    out = _run(q_latent, q_rot[:, 0], *pools, table, lens, block_size, scale)
    torch.testing.assert_close(torch.einsum("bhr,hvr->bhv", out, w_uv), runtime, rtol=0, atol=1e-5)


def test_dispatch_runs_the_kernel_or_the_reference(monkeypatch):
    q_latent, q_rot, latent, k_rot, table, lens = _case(2, 4, 32, 16, 4, [6, 10], seed=7)
    pools = (make_pool("fp8_dynamic", latent), make_pool("fp8_dynamic", k_rot))
    ref = mla_decode_attention_ref(q_latent, q_rot, *pools, table, lens, 4, 0.25)
    out = gpu.mla_decode_attention(q_latent.to(DEVICE), q_rot.to(DEVICE), *(pool_to(p) for p in pools),
                                   table.to(DEVICE), lens.to(DEVICE), 4, 0.25)
    torch.testing.assert_close(out.cpu(), ref, rtol=0, atol=ATOL)
    monkeypatch.setattr(gpu, "triton_installed", lambda: False)
    q16 = q_latent.bfloat16()
    out = gpu.mla_decode_attention(q16, q_rot.bfloat16(), *pools, table, lens, 4, 0.25)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, mla_decode_attention_ref(q16, q_rot.bfloat16(), *pools, table, lens, 4, 0.25)
                       .bfloat16())


def test_bad_inputs_are_refused():
    q_latent, q_rot, latent, k_rot, table, lens = _case(2, 4, 32, 16, 4, [3, 4])
    latent_pool, rot_pool = pool_to(make_pool("fp8_dynamic", latent)), pool_to(make_pool("fp8_dynamic", k_rot))
    q_latent, q_rot, table, lens = q_latent.to(DEVICE), q_rot.to(DEVICE), table.to(DEVICE), lens.to(DEVICE)
    for fn in (mla_decode_attention, mla_decode_attention_ref):
        with pytest.raises(ValueError, match="same B and H"):
            fn(q_latent, q_rot[:, :3], latent_pool, rot_pool, table, lens, 4, 0.2)
        with pytest.raises(ValueError, match="share one float dtype"):
            fn(q_latent, q_rot.double(), latent_pool, rot_pool, table, lens, 4, 0.2)
        with pytest.raises(ValueError, match="latent of 32 and a rotary key of 16"):
            fn(q_latent[..., :16], q_rot, latent_pool, rot_pool, table, lens, 4, 0.2)
        with pytest.raises(ValueError, match="one KV head"):
            two_heads = KvPool("bf16", torch.zeros(24, 2, 32, device=DEVICE))
            fn(q_latent, q_rot, two_heads, rot_pool, table, lens, 4, 0.2)
        with pytest.raises(ValueError, match="same slots"):
            few_slots = KvPool("bf16", torch.zeros(8, 1, 16, device=DEVICE))
            fn(q_latent, q_rot, latent_pool, few_slots, table, lens, 4, 0.2)
        with pytest.raises(ValueError, match="even"):
            odd = KvPool("bf16", torch.zeros(latent.shape[0], 1, 31, device=DEVICE))
            fn(q_latent[..., :31], q_rot, odd, rot_pool, table, lens, 4, 0.2)
        with pytest.raises(TypeError, match="int32"):
            fn(q_latent, q_rot, latent_pool, rot_pool, table.long(), lens, 4, 0.2)
        with pytest.raises(ValueError, match="block_table must be"):
            fn(q_latent, q_rot, latent_pool, rot_pool, table[:1], lens, 4, 0.2)
        with pytest.raises(ValueError, match="block_size must be a positive int"):
            fn(q_latent, q_rot, latent_pool, rot_pool, table, lens, 0, 0.2)
    with pytest.raises(ValueError, match="heads_per_program must be a power of two"):
        mla_decode_attention(q_latent, q_rot, latent_pool, rot_pool, table, lens, 4, 0.2,
                             heads_per_program=24)
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        mla_decode_attention(q_latent, q_rot, latent_pool, rot_pool, table, lens, 4, 0.2, block_n=8)
