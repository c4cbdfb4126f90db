"""MLA attention's two paths: absorbed decode (W_uk folded into the query, W_uv after the latent mix) and the
expanded reference, on a tiny DeepSeek-V3 checkpoint, against each other and against transformers."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from kiln.optimizer.loader import load_checkpoint
from kiln.runtime.attention import MlaAttention
from kiln.runtime.engine import Engine
from tests.runtime.contiguous_kv_cache import ContiguousKVCache


def _engine(ckpt) -> Engine:
    return Engine(load_checkpoint(ckpt).spec, load_file(ckpt / "model.safetensors"), {})


def _mla_modules(engine: Engine) -> list[MlaAttention]:
    return [b.attention for b in engine.model.blocks if isinstance(b.attention, MlaAttention)]


def _decode(engine: Engine, tokens: torch.Tensor, prompt: int) -> torch.Tensor:
    """Logits of a prefill of `prompt` tokens, then one token at a time through the cache."""
    B, T = tokens.shape
    cache = ContiguousKVCache(engine.model.stream_shapes(), B, T + 4)
    parts = [engine.model(tokens[:, :prompt], torch.arange(prompt).expand(B, -1), cache)]
    parts += [engine.model(tokens[:, t:t + 1], torch.full((B, 1), t), cache) for t in range(prompt, T)]
    return torch.cat(parts, dim=1)


@pytest.mark.parametrize("absorb", [True, False])
def test_decode_matches_transformers_on_either_path(tiny_checkpoints, absorb):
    from transformers import AutoModelForCausalLM

    ckpt = tiny_checkpoints["deepseek_v3"]
    engine = _engine(ckpt)
    assert _mla_modules(engine)
    for module in _mla_modules(engine):
        module.absorb = absorb
    tokens = torch.randint(0, 160, (2, 14), generator=torch.Generator().manual_seed(5))
    hf = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    with torch.no_grad():
        ref = hf(tokens).logits
    torch.testing.assert_close(_decode(engine, tokens, 5), ref, rtol=1e-5, atol=1e-5)


def test_absorbed_and_expanded_agree_step_by_step(tiny_checkpoints):
    engine = _engine(tiny_checkpoints["deepseek_v3"])
    tokens = torch.randint(0, 160, (3, 20), generator=torch.Generator().manual_seed(6))
    outputs = {}
    for absorb in (True, False):
        for module in _mla_modules(engine):
            module.absorb = absorb
        outputs[absorb] = _decode(engine, tokens, 3)
    torch.testing.assert_close(outputs[True], outputs[False], rtol=1e-5, atol=1e-5)


def test_decode_never_expands_the_cached_latents(tiny_checkpoints):
    """By default a decode step reads kv_b_proj's weight but never runs it over the cache (S x H x (nope + v)
    values per step); prefill, whose new tokens are all the keys, expands them once."""
    engine = _engine(tiny_checkpoints["deepseek_v3"])
    rows: list[int] = []
    handles = [m.kv_b_proj.register_forward_hook(lambda _m, args, _o: rows.append(args[0].shape[1]))
               for m in _mla_modules(engine)]
    tokens = torch.randint(0, 160, (1, 10), generator=torch.Generator().manual_seed(7))
    cache = ContiguousKVCache(engine.model.stream_shapes(), 1, 16)
    engine.model(tokens[:, :6], torch.arange(6).expand(1, -1), cache)
    layers = len(handles)
    assert rows == [6] * layers  # prefill: once per layer, over its own 6 tokens
    for t in range(6, 10):
        engine.model(tokens[:, t:t + 1], torch.full((1, 1), t), cache)
    assert rows == [6] * layers  # decode: kv_b_proj never ran again
    for h in handles:
        h.remove()


def test_latent_decode_equals_sdpa_over_the_concatenated_key():
    """The decode step's two-matmul latent attention is SDPA over [latent, rotary key] with the latent as value,
    masked rows included (a row with nothing to attend gives zeros in both)."""
    from torch.nn import functional as F

    from kiln.runtime.attention import _latent_decode

    gen = torch.Generator().manual_seed(8)
    B, H, S, r, rope = 3, 4, 37, 24, 8
    q_latent, q_rot = torch.randn(B, H, r, generator=gen), torch.randn(B, H, rope, generator=gen)
    latent, k_rot = torch.randn(B, S, r, generator=gen), torch.randn(B, S, rope, generator=gen)
    mask = torch.rand(B, H, S, generator=gen) > 0.3
    mask[1, 2] = False
    for m in (None, mask):
        ref = F.scaled_dot_product_attention(torch.cat([q_latent, q_rot], -1)[:, None],
                                             torch.cat([latent, k_rot], -1)[:, None], latent[:, None],
                                             attn_mask=None if m is None else m[:, None], scale=0.3)[:, 0]
        torch.testing.assert_close(_latent_decode(q_latent, q_rot, latent, k_rot, m, 0.3), ref, rtol=1e-5, atol=1e-6)
    assert not _latent_decode(q_latent, q_rot, latent, k_rot, mask, 0.3)[1, 2].any()
