"""Speculative decoding inside the continuous-batching scheduler (`Scheduler(drafter=...)`): greedy requests
get exactly the tokens plain decoding gives them alone, whatever joins, chunks or preempts around them; sampled
requests get the target's distribution (chi-square); the counters add up; blocks all come back."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.kernels.errors import KilnError
from kiln.optimizer.loader import load_checkpoint
from kiln.optimizer.measure.gate import engine_from_graph
from kiln.runtime.request import SamplingParams
from kiln.runtime.scheduler import Scheduler
from tests.conftest import EVAL_TEXT, STORIES
from tests.runtime.test_speculative import P_FLOOR, Oracle, _chi_square_p, _exact_marginals, with_random_head

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def stories():
    if not (STORIES / "config.json").is_file():
        pytest.skip("../shared/models absent")
    from kiln.calibration.data import load_token_lists
    from kiln.runtime.engine import load_tokenizer

    engine = engine_from_graph(with_random_head(load_checkpoint(STORIES), architecture="eagle3"))
    texts = [t for t in load_token_lists(load_tokenizer(STORIES), EVAL_TEXT, 60, 256) if len(t) >= 48]
    return engine, texts


def _drain(scheduler):
    while scheduler.has_work():
        scheduler.step()


@pytest.mark.parametrize("drafter", ["head", "head tree of 3", "prompt lookup", "oracle"])
def test_greedy_requests_get_plain_decodings_tokens(stories, drafter):
    """Eight prompts of 5 to 40 tokens, four joining after the first steps, max_tokens 6 to 30 and EOS stops,
    a budget of 24 tokens (prompts chunk; decoders draft fewer when the budget is short), a repetition
    penalty on two, and a pool small enough to preempt: each output is what plain decoding gives it alone."""
    engine, texts = stories
    prompts = [t[:n] for t, n in zip(texts, (5, 12, 40, 20, 33, 7, 26, 18), strict=False)]
    params = [SamplingParams(max_tokens=m, repetition_penalty=1.3 if i in (2, 5) else 1.0)
              for i, m in enumerate((30, 6, 24, 17, 30, 12, 28, 9))]
    expected = [engine.generate_ids([p], s.max_tokens, stop_ids=engine.spec.eos_token_ids,
                                    repetition_penalty=s.repetition_penalty)[0][0]
                for p, s in zip(prompts, params, strict=True)]
    made = {"head": lambda: engine.drafter("head", tree_width=1),
            "head tree of 3": lambda: engine.drafter("head", tree_width=3),
            "prompt lookup": lambda: engine.drafter("prompt-lookup"),
            "oracle": lambda: Oracle({tuple(p): o for p, o in zip(prompts, expected, strict=True)},
                                     engine.spec.vocab_size)}[drafter]()
    scheduler = Scheduler(engine, max_num_seqs=6, max_num_batched_tokens=24, num_blocks=160 // engine.kv_block_size,
                          drafter=made, draft_tokens=4)
    requests = [scheduler.add_request(p, s) for p, s in zip(prompts[:4], params[:4], strict=True)]
    for _ in range(3):
        scheduler.step()
    requests += [scheduler.add_request(p, s) for p, s in zip(prompts[4:], params[4:], strict=True)]
    _drain(scheduler)
    assert [r.output_ids for r in requests] == expected
    stats = scheduler.stats()
    assert stats["spec_verifications"] > 0 and stats["spec_draft_tokens"] > 0
    # every token but a request's first (sampled after its prompt) came from a verification
    firsts = sum(1 + r.preemptions for r in requests if r.output_ids)
    assert stats["spec_emitted_tokens"] >= stats["generated_tokens"] - firsts
    assert scheduler.cache.num_used_blocks == 0
    assert scheduler.num_preemptions > 0  # the pool (160 tokens) was tight enough to preempt
    if drafter == "oracle":
        assert stats["spec_accepted_tokens"] > stats["spec_verifications"]  # tau above 2


def test_sampled_requests_follow_the_target_distribution(tiny_checkpoints):
    """3000 seeded requests of one prompt at temperature 0.25, drafted by a random head: the first three tokens'
    marginals against the exact ones (chi-square)."""
    engine = engine_from_graph(with_random_head(load_checkpoint(tiny_checkpoints["llama"]), seed=3))
    prompt, temperature, n = [5, 17, 42, 9], 0.25, 3000
    exact = _exact_marginals(engine, prompt, temperature)
    scheduler = Scheduler(engine, max_num_seqs=512, max_num_batched_tokens=8192, num_blocks=4096,
                          drafter=engine.drafter("head"), draft_tokens=2)
    requests = [scheduler.add_request(prompt, SamplingParams(max_tokens=3, temperature=temperature, seed=i,
                                                             stop_ids=()), bounded=False) for i in range(n)]
    _drain(scheduler)
    stats = scheduler.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]  # both branches of the rule ran
    tokens = np.array([r.output_ids for r in requests])
    for position in range(3):
        p = _chi_square_p(tokens[:, position], exact[position])
        assert p > P_FLOOR, (position, p)
    assert _chi_square_p(tokens[:, 1], exact[0]) < P_FLOOR  # the test can tell positions apart


def test_a_feature_drafter_turns_prefix_caching_off(stories):
    engine, _ = stories
    scheduler = Scheduler(engine, drafter=engine.drafter("head"), prefix_caching=True)
    assert not scheduler.cache.prefix_caching  # a cache hit would skip the features the head reads
    with pytest.raises(KilnError, match="without prefix caching"):
        Scheduler(engine, cache=engine.new_kv_cache(64, prefix_caching=True), drafter=engine.drafter("head"))
    assert Scheduler(engine, drafter=engine.drafter("prompt-lookup")).cache.prefix_caching


def test_a_draft_head_pool_too_small_for_the_schedulers_is_refused(stories):
    """The head's own KV pool must hold the target pool's tokens and each sequence's drafts past its end (one
    more block each here): one block short is a one-line refusal, not a step that fails mid-serving."""
    engine, _ = stories
    need = 40 + 4 * 1
    with pytest.raises(KilnError, match=f"need {need}"):
        Scheduler(engine, num_blocks=40, max_num_seqs=4, drafter=engine.drafter("head", num_blocks=need - 1))
    Scheduler(engine, num_blocks=40, max_num_seqs=4, drafter=engine.drafter("head", num_blocks=need))
    Scheduler(engine, drafter=engine.drafter("head"))  # the defaults fit each other
