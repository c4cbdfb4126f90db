"""The runtime's reference path against transformers, on every architecture and on the real model."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from kiln.optimizer.loader import load_checkpoint
from kiln.runtime.engine import Engine, load_tokenizer
from tests.conftest import GEMMA3, STORIES, needs_gemma3, needs_stories
from tests.runtime.contiguous_kv_cache import ContiguousKVCache
from tests.tiny_models import TINY_CONFIGS


def _engine(ckpt) -> Engine:
    return Engine(load_checkpoint(ckpt).spec, load_file(ckpt / "model.safetensors"), {})


@pytest.mark.parametrize("model_type", sorted(TINY_CONFIGS))
def test_logits_match_transformers(tiny_checkpoints, model_type):
    from transformers import AutoModelForCausalLM

    ckpt = tiny_checkpoints[model_type]
    hf = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    engine = _engine(ckpt)
    tokens = torch.randint(0, 160, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(tokens).logits
    ours = engine.model(tokens, torch.arange(12).expand(2, -1))
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "mixtral", "deepseek_v3", "gemma3_text"])
def test_cached_decode_equals_full_forward(tiny_checkpoints, model_type):
    engine = _engine(tiny_checkpoints[model_type])
    tokens = torch.randint(0, 160, (2, 12), generator=torch.Generator().manual_seed(2))
    full = engine.model(tokens, torch.arange(12).expand(2, -1))
    cache = ContiguousKVCache(engine.model.stream_shapes(), 2, 16)
    parts = [engine.model(tokens[:, :7], torch.arange(7).expand(2, -1), cache)]
    parts += [engine.model(tokens[:, t:t + 1], torch.full((2, 1), t), cache) for t in range(7, 12)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)


def test_batched_generation_of_mixed_lengths_equals_one_by_one(tiny_checkpoints):
    engine = _engine(tiny_checkpoints["qwen2"])
    prompts = [[1, 5, 9], [1, 7, 3, 8, 2, 11, 40], [1, 99]]
    batched = engine.generate_ids(prompts, max_new_tokens=12)
    for prompt, (ids, _) in zip(prompts, batched, strict=True):
        alone = engine.generate_ids([prompt], max_new_tokens=12)[0][0]
        assert ids == alone


def test_sampling_is_seeded_and_respects_top_p(tiny_checkpoints):
    engine = _engine(tiny_checkpoints["llama"])
    a = engine.generate_ids([[1, 5, 9]], max_new_tokens=10, temperature=1.0, top_p=0.9, seed=3)
    b = engine.generate_ids([[1, 5, 9]], max_new_tokens=10, temperature=1.0, top_p=0.9, seed=3)
    assert a == b
    # a tiny nucleus keeps only the top token: sampling becomes greedy
    greedy = engine.generate_ids([[1, 5, 9]], max_new_tokens=10)
    nucleus = engine.generate_ids([[1, 5, 9]], max_new_tokens=10, temperature=1.0, top_p=1e-6, seed=4)
    assert nucleus[0][0] == greedy[0][0]


@needs_stories
def test_lily_story_matches_transformers_greedy_token_for_token():
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(STORIES)
    hf = AutoModelForCausalLM.from_pretrained(STORIES).eval()
    prompt = tok("Once upon a time")["input_ids"]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=100, do_sample=False)[0, len(prompt):].tolist()
    engine = Engine(load_checkpoint(STORIES).spec, load_file(STORIES / "model.safetensors"), {}, tok)
    ours = engine.generate("Once upon a time", max_new_tokens=100)[0]
    assert ours.token_ids == ref[: len(ours.token_ids)]
    assert len(ours.token_ids) == len(ref) or ours.finish_reason == "eos"
    assert ours.text.startswith(", there was a little girl named Lily. She loved to play outside in the park.")


def test_silu_and_sigmoid_give_the_same_bits_on_one_and_two_threads():
    # torch's CPU silu / sigmoid round the elements at the end of each thread's chunk on a scalar path whose last
    # bit differs from the vector one, so F.silu followed the thread count (and with it the activations a
    # calibration observes); exp, add and divide do not
    import torch.nn.functional as F

    from kiln.runtime.activations import sigmoid, silu

    # a value whose two paths differ (as about 4% of N(0, 16) draws do), everywhere: a thread's chunk of
    # 301,000 elements leaves 8 to the scalar path, where one thread's single chunk leaves none
    x = torch.full((20, 175, 172), -1.5806301832199097)
    x.view(-1)[:100_000] = torch.randn(100_000, generator=torch.Generator().manual_seed(0)) * 4
    x[0, 0, :3] = torch.tensor([-100.0, 100.0, -1e30])
    before = torch.get_num_threads()
    found = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            found[threads] = (silu(x), sigmoid(x))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(found[1][0], found[2][0])
    assert torch.equal(found[1][1], found[2][1])
    torch.testing.assert_close(found[1][0], F.silu(x), rtol=1e-6, atol=1e-7)  # silu(-1e30): -6e-9, not -0
    torch.testing.assert_close(found[1][1], torch.sigmoid(x), rtol=1e-6, atol=1e-30)
    assert abs(found[1][0][0, 0, 0]) < 1e-36 and found[1][0][0, 0, 1] == 100 and abs(found[1][0][0, 0, 2]) < 1e-7
    y = x[0, 0, :3].clone().requires_grad_()
    silu(y).sum().backward()  # e^-x capped: no 0 * inf = NaN in the gradient far below zero
    assert torch.isfinite(y.grad).all()


@needs_gemma3
def test_gemma3_logits_equal_transformers_past_the_window():
    """The real Gemma 3 270M (window 512 on 15 of its 18 layers), 700 tokens of evaluation text with its BOS: the
    runtime's logits equal transformers' within 1e-4 of the largest, before and after position 512."""
    from transformers import AutoModelForCausalLM

    from tests.conftest import EVAL_TEXT

    tok = load_tokenizer(GEMMA3)
    ids = tok.encode(EVAL_TEXT.read_text()[:6000])[:700]
    assert ids[0] == 2 and len(ids) == 700  # <bos>
    engine = Engine(load_checkpoint(GEMMA3).spec, load_file(GEMMA3 / "model.safetensors"), {}, tok)
    hf = AutoModelForCausalLM.from_pretrained(GEMMA3, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    ours = engine.model(torch.tensor([ids]), torch.arange(len(ids))[None])[0]
    scale = ref.abs().max()
    for part in (slice(0, 512), slice(512, None)):
        assert (ours[part] - ref[part]).abs().max() <= 1e-4 * scale
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@needs_gemma3
@pytest.mark.slow
def test_gemma3_generates_2k_tokens_past_the_window_as_transformers_scores_them():
    """2,048 greedy tokens through the scheduler and the paged cache, four times the 512-token window: every one
    is transformers' own argmax at its position (teacher-forced over the whole text), or within 1e-3 nats of it
    (a near-tie fp32 rounding may break either way)."""
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(GEMMA3)
    # 294 blocks of 16 tokens, each block id 3 layers' storage (one layer of each of the six KV-cache groups: the
    # 3 full-attention layers, and 5 groups of 3 window layers): the full group's 129 blocks of the 2,061 tokens
    # written, and 33 in each window group (its 512-token window and the block it starts in). Holding every
    # window layer's whole history would take 774; the pool is 2.6 x smaller than that (and than the 129 blocks
    # of 18 layers a cache without groups needs)
    engine = Engine(load_checkpoint(GEMMA3).spec, load_file(GEMMA3 / "model.safetensors"), {}, tok,
                    kv_cache_blocks=294)
    prompt = tok.encode("Once upon a time, there was a little girl named Lily.")
    cache = engine.kv_pool
    assert len(cache.groups) == 6 and cache.sequence_blocks(len(prompt) + 2047, 1) == 294
    assert cache.nbytes == 295 * 16 * 3 * 2 * 256 * 4  # blocks + null x tokens x slots x (K, V) x dim x fp32
    (out,) = engine.generate_ids([prompt], max_new_tokens=2048, stop_ids=())  # () : EOS does not stop it
    generated = out[0]
    assert len(generated) == 2048
    assert cache.window_releases >= 5 * (129 - 33) and cache.num_used_blocks == 0
    hf = AutoModelForCausalLM.from_pretrained(GEMMA3, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        hidden = hf.model(ids).last_hidden_state[0, len(prompt) - 1: -1]  # the states that predict each token
        worst = 0.0
        for start in range(0, len(generated), 64):  # [64, 262144] log-probs at a time
            lp = torch.log_softmax(hf.lm_head(hidden[start:start + 64]).float(), dim=-1)
            chosen = lp.gather(1, torch.tensor(generated[start:start + 64])[:, None])[:, 0]
            worst = max(worst, float((lp.max(dim=-1).values - chosen).max()))
    assert worst <= 1e-3
