"""Speculative decoding: greedy output identical to plain decoding, sampled output distributed as the target's
(chi-square), rollback in the paged cache, the draft head's incremental cache against a full recomputation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from kiln.kernels.errors import KilnError
from kiln.optimizer.loader import load_checkpoint
from kiln.optimizer.measure.gate import engine_from_graph
from kiln.passes.draft_head import attach, head_module, init_tensors
from kiln.runtime.drafters import Drafter, NgramTableDrafter, Proposal
from kiln.runtime.speculative import accept_greedy, accept_tree, draft_tree
from tests.conftest import CALIB_TEXT, EVAL_TEXT, STORIES, needs_stories

P_FLOOR = 1e-3  # the chi-square tests pass when p > 0.001 (fixed seeds: deterministic)


def with_random_head(graph, seed=0, architecture="mtp"):
    """`graph` with an untrained draft head attached (its proposals are poor: most are rejected)."""
    module = head_module(graph, architecture)
    tensors = init_tensors(module, graph.spec.hidden_size, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    for name, value in tensors.items():  # a head whose layer actually changes the features
        if name.endswith(".weight") and value.dim() == 2:
            tensors[name] = value + torch.randn(value.shape, generator=gen) * 0.1
    attach(graph, module, tensors)
    return graph


# --- the paged cache rolls back ---------------------------------------------------------------------------


def test_truncate_frees_blocks_and_reads_like_a_fresh_cache(generated_checkpoint):
    engine = engine_from_graph(load_checkpoint(generated_checkpoint))
    gen = torch.Generator().manual_seed(0)
    shapes = engine.model.stream_shapes()[0]

    def values(n):
        return tuple(torch.randn(1, n, h, d, generator=gen) for h, d in shapes)

    cache = engine.new_kv_cache(num_blocks=6, block_size=4)
    cache.add_sequence("a")
    first = values(10)
    cache.prepare(["a"], torch.arange(10)[None])
    cache.update(0, first, torch.arange(10)[None])
    assert cache.num_used_blocks == 3 and cache.lengths["a"] == 10
    cache.truncate("a", 5)  # drafts at positions 5..9 rejected
    assert cache.num_used_blocks == 2 and cache.lengths["a"] == 5 and cache.num_free_blocks == 4
    second = values(3)
    positions = torch.arange(5, 8)[None]
    cache.prepare(["a"], positions)
    got = cache.update(0, second, positions)
    fresh = engine.new_kv_cache(num_blocks=6, block_size=4)
    fresh.add_sequence("b")
    whole = tuple(torch.cat([f[:, :5], s], 1) for f, s in zip(first, second, strict=True))
    fresh.prepare(["b"], torch.arange(8)[None])
    want = fresh.update(0, whole, torch.arange(8)[None])
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    with pytest.raises(KilnError, match="cannot keep 9"):
        cache.truncate("a", 9)
    cache.truncate("a", 0)
    assert cache.num_used_blocks == 0


def test_greedy_acceptance_rule():
    logits = torch.full((4, 10), -1.0)
    for i, t in enumerate([3, 5, 7, 1]):
        logits[i, t] = 1.0
    assert accept_greedy([3, 5, 2], logits) == (2, [3, 5, 7])
    assert accept_greedy([3, 5, 7], logits) == (3, [3, 5, 7, 1])
    assert accept_greedy([4], logits[:2]) == (0, [3])
    assert accept_greedy([], logits[:1]) == (0, [3])


def test_tree_layout_and_greedy_walk():
    tokens, parents = draft_tree([3, 5, 7], [[8, 9], [5, 1], [2]])  # depth 2's alternative 5 is the chain's
    assert tokens == [-1, 3, 8, 9, 5, 1, 7, 2] and parents == [-1, 0, 0, 0, 1, 1, 4, 4]
    logits = torch.zeros(8, 10)
    for node, choice in enumerate([8, 0, 4, 0, 0, 0, 0, 0]):  # the target picks sibling 8, then 4 after it
        logits[node, choice] = 1.0
    assert accept_tree(tokens, parents, logits) == ([2], 4)
    for node, choice in enumerate([3, 1, 0, 0, 0, 6, 0, 0]):  # chain's 3, then sibling 1 (leaf), then 6
        logits[node] = 0
        logits[node, choice] = 1.0
    assert accept_tree(tokens, parents, logits) == ([1, 5], 6)


def test_move_copies_stored_bytes_of_every_layer(generated_checkpoint):
    engine = engine_from_graph(load_checkpoint(generated_checkpoint))
    shapes = engine.model.stream_shapes()[0]
    cache = engine.new_kv_cache(num_blocks=4, block_size=4)
    cache.add_sequence("a")
    gen = torch.Generator().manual_seed(0)
    new = tuple(torch.randn(1, 9, h, d, generator=gen) for h, d in shapes)
    cache.prepare(["a"], torch.arange(9)[None])
    for layer in range(len(cache.pools)):
        cache.update(layer, new, torch.arange(9)[None])
    cache.move("a", [5, 8], [1, 2])  # an accepted tree path at slots 5 and 8 moves after position 0
    cache.truncate("a", 3)
    cache.prepare(["a"], torch.tensor([[3]]))
    got = cache.update(0, tuple(torch.zeros(1, 1, h, d) for h, d in shapes), torch.tensor([[3]]))
    for stream, value in zip(got, new, strict=True):
        assert torch.equal(stream[0, :3], value[0, [0, 5, 8]])


# --- greedy: identical to plain decoding -------------------------------------------------------------------


@pytest.fixture(scope="module")
def stories():
    if not (STORIES / "config.json").is_file():
        pytest.skip("../shared/models absent")
    from kiln.calibration.data import load_token_lists
    from kiln.runtime.engine import load_tokenizer

    tok = load_tokenizer(STORIES)
    prompts = [t[:16] for t in load_token_lists(tok, EVAL_TEXT, 200, 256) if len(t) >= 16]
    return tok, prompts


class Oracle(Drafter):
    """Proposes the target's own greedy continuation with every third draft wrong: acceptance and rejection
    at known places."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]], vocab: int):
        self.reference, self.vocab, self.calls = reference, vocab, 0

    def propose(self, rows, contexts, k, temperature, top_p, generator):
        out = []
        for context in contexts:
            drafts = []  # a context of no known prompt: no proposal (its row keeps its place)
            for prompt, continuation in self.reference.items():
                if tuple(context[:len(prompt)]) == prompt:
                    done = len(context) - len(prompt)
                    drafts = continuation[done:done + k]
                    self.calls += 1
                    if self.calls % 3 == 0 and drafts:
                        drafts = [*drafts[:-1], (drafts[-1] + 1) % self.vocab]
                    break
            out.append(drafts)
        return Proposal(out, [None] * len(out))


@needs_stories
def test_greedy_speculative_is_plain_decoding_on_200_prompts(stories):
    tok, prompts = stories
    assert len(prompts) == 200
    from kiln.calibration.data import load_token_lists

    graph = with_random_head(load_checkpoint(STORIES))
    engine = engine_from_graph(graph)
    plain = engine.generate_ids(prompts, 64, stop_ids=engine.spec.eos_token_ids)
    corpus = load_token_lists(tok, CALIB_TEXT, 400, 256)
    drafters = {"trigram": NgramTableDrafter.from_corpus(corpus), "random head": engine.drafter("head"),
                "random head, tree of 3": engine.drafter("head", tree_width=3),
                "oracle": Oracle({tuple(p): o for p, (o, _) in zip(prompts, plain, strict=True)},
                                 engine.spec.vocab_size)}
    for name, drafter in drafters.items():  # all 200 in one batch: rows accept independently
        spec, stats = engine.speculative_ids(prompts, 64, 4, drafter, stop_ids=engine.spec.eos_token_ids)
        assert spec == plain, name
        assert stats.steps > 0 and stats.emitted == sum(len(o) for o, _ in plain) - sum(
            1 for o, _ in plain if o)  # every token but each row's first came from a verification
        if name == "oracle":
            assert stats.tau > 3.0 and 0 < stats.accepted < stats.drafted
        if name == "trigram":
            assert stats.tau > 1.5
    assert engine.kv_pool.num_used_blocks == 0  # every row's blocks came back


@needs_stories
def test_greedy_speculative_with_an_fp8_kv_cache_and_a_repetition_penalty(stories):
    from kiln.calibration.data import load_token_lists
    from kiln.kernels.targets import get_target
    from kiln.optimizer.measure.runner import RuntimeRunner
    from kiln.passes.base import PassContext
    from kiln.passes.kv_cache import KvCacheQuantization

    tok, prompts = stories
    graph = load_checkpoint(STORIES)
    ctx = PassContext(get_target("hopper"), runner=RuntimeRunner(graph, load_token_lists(tok, CALIB_TEXT, 32)))
    KvCacheQuantization(format="fp8", scaling="per_tensor").apply(graph, ctx)
    engine = engine_from_graph(with_random_head(graph))
    assert all(s.format == "fp8_e4m3" for layer in engine.kv_streams for s in layer)
    # With FP8 storage, greedy decoding is exact only up to floating-point shape effects: the verification
    # forward computes K/V of k+1 tokens in one matmul, plain decoding one at a time, and a last-bit difference
    # can cross an FP8 rounding boundary (plain decoding of one prompt alone and in a batch of 40 parts the
    # same way). So every difference must sit at a near-tie of plain decoding's own logits.
    gaps, compared = [], 0
    for penalty in (1.0, 1.3):
        plain = engine.generate_ids(prompts[:24], 48, repetition_penalty=penalty)
        for drafter in (engine.drafter("prompt-lookup"), engine.drafter("head"), engine.drafter("head", tree_width=3)):
            spec, _ = engine.speculative_ids(prompts[:24], 48, 3, drafter, repetition_penalty=penalty)
            for prompt, (want, _), (got, _) in zip(prompts, plain, spec, strict=False):
                compared += 1
                if got == want:
                    continue
                j = next(i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b)
                logits = engine.logits([list(prompt) + want[:j]])[0][-1]
                from kiln.runtime.sampling import penalize_repeats

                logits = penalize_repeats(logits[None], [list(prompt) + want[:j]], penalty)[0]
                top = logits.topk(2).values
                assert {want[j], got[j]} <= set(logits.topk(2).indices.tolist())
                gaps.append(float(top[0] - top[1]))
    assert compared == 144 and len(gaps) <= 12 and all(g < 0.25 for g in gaps), gaps


# --- the draft head's incremental cache --------------------------------------------------------------------


class Recording(Drafter):
    def __init__(self, inner):
        self.inner, self.proposals = inner, []
        self.needs_features, self.feature_layers = inner.needs_features, inner.feature_layers

    def start(self, row, tokens, features):
        self.inner.start(row, tokens, features)

    def propose(self, rows, contexts, k, temperature, top_p, generator):
        p = self.inner.propose(rows, contexts, k, temperature, top_p, generator)
        self.proposals.append([list(t) for t in p.tokens])
        return p

    def accept(self, row, accepted, emitted, features):
        self.inner.accept(row, accepted, emitted, features)

    def finish(self, row):
        self.inner.finish(row)


class FromScratch(Drafter):
    """The draft head recomputed over the whole history at every proposal: target features by a full forward,
    the head over every position, then k autoregressive steps, without any cache."""

    def __init__(self, engine):
        self.engine, self.module = engine, engine.draft_module()

    @torch.inference_mode()
    def propose(self, rows, contexts, k, temperature, top_p, generator):
        out = []
        for context in contexts:
            tokens = torch.tensor([context])
            positions = torch.arange(len(context))[None]
            layers = self.module.aux_layers
            feats = self.engine.model.features(tokens[:, :-1], positions[:, :-1], collect=layers)  # of 0..L-1
            seq_f, seq_t = self.module.project(feats[1] if layers else feats), tokens[:, 1:]
            drafts = []
            for _ in range(k):
                pos = torch.arange(seq_f.shape[1])[None]
                head = self.module(seq_f, seq_t, pos)
                token = int(self.module.logits(head[:, -1]).argmax(-1))
                drafts.append(token)
                seq_f = torch.cat([seq_f, head[:, -1:]], 1)
                seq_t = torch.cat([seq_t, torch.tensor([[token]])], 1)
            out.append(drafts)
        return Proposal(out, [None] * len(out))


@needs_stories
@pytest.mark.parametrize("architecture", ["mtp", "eagle3"])
def test_draft_head_cache_proposes_what_a_full_recomputation_does(stories, architecture):
    _, prompts = stories
    engine = engine_from_graph(with_random_head(load_checkpoint(STORIES), architecture=architecture))
    cached, scratch = Recording(engine.drafter("head")), Recording(FromScratch(engine))
    for drafter in (cached, scratch):
        engine.speculative_ids(prompts[:1], 40, 3, drafter)
    assert len(cached.proposals) == len(scratch.proposals) > 5
    assert cached.proposals == scratch.proposals


# --- sampling: the target's distribution -------------------------------------------------------------------


def _exact_marginals(engine, prompt, temperature):
    """p(x1), p(x2), p(x3) of the target's own sampling after `prompt`, summed exactly over the vocabulary."""
    from kiln.runtime.sampling import probabilities

    V = engine.spec.vocab_size
    with torch.inference_mode():
        p1 = probabilities(engine.model(torch.tensor([prompt]), torch.arange(len(prompt))[None])[0, -1],
                           temperature, 1.0)
        seq = torch.cat([torch.tensor(prompt).expand(V, -1), torch.arange(V)[:, None]], 1)  # [V, n+1]
        logits = engine.model(seq, torch.arange(seq.shape[1]).expand(V, -1))
        p2_given = probabilities(logits[:, -1], temperature, 1.0)  # [x1, x2]
        p2 = p1 @ p2_given
        joint12 = p1[:, None] * p2_given  # [x1, x2]
        p3 = torch.zeros(V)
        for x1 in range(V):
            rows = torch.cat([seq[x1].expand(V, -1), torch.arange(V)[:, None]], 1)
            lg = engine.model(rows, torch.arange(rows.shape[1]).expand(V, -1))[:, -1]
            p3 += joint12[x1] @ probabilities(lg, temperature, 1.0)
    return p1.double().numpy(), p2.double().numpy(), p3.double().numpy()


def _chi_square_p(samples: np.ndarray, probs: np.ndarray) -> float:
    counts = np.bincount(samples, minlength=len(probs)).astype(float)
    expected = probs / probs.sum() * len(samples)
    order = np.argsort(expected)  # merge the rarest cells until each expects >= 5
    obs, exp, acc_o, acc_e = [], [], 0.0, 0.0
    for i in order:
        acc_o, acc_e = acc_o + counts[i], acc_e + expected[i]
        if acc_e >= 5:
            obs.append(acc_o)
            exp.append(acc_e)
            acc_o = acc_e = 0.0
    if acc_e:
        obs[-1] += acc_o
        exp[-1] += acc_e
    return float(chisquare(obs, exp).pvalue)


def test_sampled_speculative_tokens_follow_the_target_distribution(tiny_checkpoints):
    graph = with_random_head(load_checkpoint(tiny_checkpoints["llama"]), seed=3)
    engine = engine_from_graph(graph)
    prompt, temperature, n = [5, 17, 42, 9], 0.25, 4000
    exact = _exact_marginals(engine, prompt, temperature)
    V = engine.spec.vocab_size
    corpus = [[t, (7 * t + 3) % V] for t in range(V)]  # a bigram table that proposes after every token
    for name, drafter in (("random head (q)", engine.drafter("head")),
                          ("n-gram table (one-hot)", NgramTableDrafter.from_corpus(corpus, n=2))):
        results, stats = engine.speculative_ids([prompt] * n, 3, 2, drafter, temperature=temperature, seed=7)
        assert stats.drafted > 0 and 0 < stats.accepted < stats.drafted, name  # both branches ran
        tokens = np.array([out for out, _ in results])
        for position in range(3):
            p = _chi_square_p(tokens[:, position], exact[position])
            assert p > P_FLOOR, (name, position, p)
    # and the test has power: the second token's samples are told apart from the first token's distribution,
    # and from a draft accepted without the rejection rule (the target's p mixed half and half with uniform q)
    assert _chi_square_p(tokens[:, 1], exact[0]) < P_FLOOR
    assert _chi_square_p(tokens[:, 1], 0.5 * exact[1] + 0.5 / len(exact[1])) < P_FLOOR


@needs_stories
def test_a_tight_pool_runs_rows_in_waves_with_room_for_the_tree(stories):
    _, prompts = stories
    engine = engine_from_graph(with_random_head(load_checkpoint(STORIES), architecture="eagle3"))
    engine.kv_cache_blocks, engine.kv_pool = 3, None  # 48 slots: one row of 16 + 16 new + a 4 x 3 tree
    plain = engine.generate_ids(prompts[:2], 16)
    spec, _ = engine.speculative_ids(prompts[:2], 16, 4, engine.drafter("head", tree_width=3))
    assert spec == plain and engine.kv_pool.num_used_blocks == 0


def test_acceptance_by_draft_position_by_hand():
    from kiln.runtime.speculative import SpeculativeStats

    stats = SpeculativeStats()
    for accepted in (2, 0, 4, 1):
        stats.record(4, accepted)
    assert stats.accepted_lengths == [1, 1, 1, 0, 1]
    assert stats.accepted_by_position == [3, 2, 1, 1]  # 3 steps accepted a first draft, 1 all four
    assert (stats.steps, stats.drafted, stats.accepted) == (4, 16, 7)
