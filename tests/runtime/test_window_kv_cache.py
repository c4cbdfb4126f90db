"""Sliding-window layers in the paged cache: KV-cache groups by attention type on one block allocator, the blocks
that leave a window released and reused, storage shared between groups; outputs bit-identical to a cache that
keeps every layer's whole history, through prefill, chunked prefill, prefix caching, fork and speculative
verification (chains and trees); no block leaks."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from kiln.kernels.errors import KilnError
from kiln.optimizer.loader import load_checkpoint
from kiln.runtime.drafters import Drafter, PromptLookupDrafter, Proposal
from kiln.runtime.engine import Engine
from kiln.runtime.kv_blocks import KvCacheFull
from kiln.runtime.kv_format import KvStream
from kiln.runtime.kv_pools import KvGroup, kv_groups, pool_bytes_per_token, stored_bytes_per_token
from kiln.runtime.paged_kv_cache import PagedKVCache
from kiln.runtime.request import SamplingParams
from kiln.runtime.scheduler import Scheduler
from kiln.runtime.speculative import verification_batch
from tests.tiny_models import make_tiny_checkpoint

torch.set_num_threads(1)

WINDOW, BS = 8, 4


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """A tiny random Gemma 3: three layers with an 8-token window, then one of full attention."""
    path = make_tiny_checkpoint("gemma3_text", tmp_path_factory.mktemp("gemma_window") / "g", overrides={
        "num_hidden_layers": 4, "layer_types": ["sliding_attention"] * 3 + ["full_attention"]})
    return path, Engine(load_checkpoint(path).spec, load_file(path / "model.safetensors"), {}, kv_block_size=BS)


def _full_cache(engine, num_blocks=400):
    """The reference: every layer keeps its whole history (one group, no windows)."""
    return PagedKVCache(engine.kv_streams, num_blocks, BS, engine.dtype)


def _greedy(engine, prompt, n):
    """Greedy tokens by whole uncached forwards."""
    tokens = list(prompt)
    for _ in range(n):
        logits = engine.model(torch.tensor([tokens]), torch.arange(len(tokens))[None])[0, -1]
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


def _decode(engine, cache, seq, prompt, n, forced=None):
    """Prefill `prompt` in one forward then decode n tokens (greedy, or `forced`): (tokens, [logits])."""
    positions = cache.prepare([seq], torch.arange(len(prompt))[None])
    logits = [engine.model(torch.tensor([prompt]), positions, cache)[0, -1]]
    out = []
    for i in range(n):
        out.append(forced[i] if forced is not None else int(logits[-1].argmax()))
        p = len(prompt) + i
        positions = cache.prepare([seq], torch.tensor([[p]]))
        logits.append(engine.model(torch.tensor([[out[-1]]]), positions, cache)[0, -1])
    return out, logits


def test_groups_follow_vllm_and_share_storage(gemma):
    assert kv_groups([None, None]) == (KvGroup(None, (0, 1)),)
    # Gemma 3 270M: 5 of every 6 layers windowed -> 3 full-attention layers, 15 windowed: groups of 3
    windows = ([512] * 5 + [None]) * 3
    groups = kv_groups(windows)
    assert [g.window for g in groups] == [None] + [512] * 5 and all(len(g.layers) == 3 for g in groups)
    assert groups[0].layers == (5, 11, 17) and groups[1].layers == (0, 1, 2)
    _, engine = gemma
    cache = engine.new_kv_cache(num_blocks=10)
    assert [g.window for g in cache.groups] == [None, WINDOW, WINDOW, WINDOW]
    assert all(cache.pools[layer][i].data is cache.pools[3][i].data for layer in range(3) for i in range(2))
    per_layer = 2 * 1 * 32 * 4  # K and V, one head of 32, fp32
    assert cache.nbytes == 11 * BS * per_layer  # one layer's storage for four: (blocks + null) x tokens
    assert pool_bytes_per_token(engine.kv_streams, engine.dtype, engine.kv_windows) == per_layer
    assert stored_bytes_per_token(engine.kv_streams, engine.dtype) == 4 * per_layer
    assert engine.kv_cache_blocks == 64 * 2**20 // (BS * per_layer)  # the default pool counts shared storage
    assert _full_cache(engine, 10).nbytes == 4 * cache.nbytes  # without windows: a tensor per layer


def test_layers_of_different_formats_keep_their_own_storage():
    fp8 = KvStream("k", 2, 16, "fp8_e4m3", "dynamic"), KvStream("v", 2, 16, "fp8_e4m3", "dynamic")
    bf16 = KvStream("k", 2, 16), KvStream("v", 2, 16)
    cache = PagedKVCache([fp8, bf16, bf16, bf16], 6, BS, windows=[8, None, 8, 8])
    assert cache.pools[1][0].data is cache.pools[2][0].data is cache.pools[3][0].data
    assert cache.pools[0][0].data is not cache.pools[1][0].data  # float8 bytes beside fp32: its own tensor
    assert cache.pools[0][0].data.shape[0] == 7 * BS
    with pytest.raises(KilnError, match="windows: 3 entries for 4 layers"):
        PagedKVCache([bf16] * 4, 6, BS, windows=[8, None, 8])
    with pytest.raises(KilnError, match="positive integer"):
        PagedKVCache([bf16] * 2, 6, BS, windows=[0, None])


def test_far_past_the_window_through_a_pool_too_small_for_the_history(gemma):
    """65 positions, window 8, blocks of 4: the full group needs 17 blocks and each window group at most 3
    (window - 1 + one token, and the block it starts in): 26 blocks of one layer's storage each. Every logit
    equals the reference cache's (every layer's whole history), bit for bit, and the tokens transformers'."""
    path, engine = gemma
    prompt, n = [5, 17, 3, 99, 42], 60
    cache = engine.new_kv_cache(num_blocks=26)
    assert cache.sequence_blocks(len(prompt) + n, 1) == 17 + 3 * 3
    cache.add_sequence("a")
    ref = _full_cache(engine)
    ref.add_sequence("a")
    used = set()
    tokens, logits = _decode(engine, cache, "a", prompt, n)
    for table in cache.group_tables["a"]:
        used.update(b for b in table if b != cache.null_block)
    ref_tokens, ref_logits = _decode(engine, ref, "a", prompt, n)
    assert tokens == ref_tokens == _greedy(engine, prompt, n)
    assert all(torch.equal(a, b) for a, b in zip(logits, ref_logits, strict=True))
    # each window group holds only the blocks of its last query's window: blocks came back and were reused
    for g, group in enumerate(cache.groups[1:], 1):
        table = cache.group_tables["a"][g]
        held = [b for b in table if b != cache.null_block]
        assert len(table) == 17 and len(held) == 3 and table[:14] == [cache.null_block] * 14
    assert cache.window_releases >= 3 * 13 and cache.num_used_blocks == 17 + 9
    # the same bytes without windows hold 26 / 4 blocks of every layer: far too few for 65 positions
    small = _full_cache(engine, num_blocks=cache.nbytes // (BS * stored_bytes_per_token(engine.kv_streams)) - 1)
    small.add_sequence("a")
    with pytest.raises(KvCacheFull):
        _decode(engine, small, "a", prompt, n)
    cache.free_sequence("a")
    assert cache.num_used_blocks == 0 and cache.num_free_blocks == 26

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        hf_logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:]
    ours = torch.stack(logits)
    torch.testing.assert_close(ours, hf_logits, rtol=1e-4, atol=1e-4)
    assert hf_logits.argmax(-1)[:-1].tolist() == tokens


def test_released_blocks_read_as_null_and_are_masked(gemma):
    """A window layer's read of a released position points at the null block; a query's window never reaches
    it."""
    _, engine = gemma
    cache = engine.new_kv_cache(num_blocks=40)
    cache.add_sequence(0)
    _decode(engine, cache, 0, list(range(1, 30)), 3)
    step = cache._step
    S = step.length
    for g, group in enumerate(cache.groups):
        read = step.read_slots[g].view(1, S)[0]
        released = cache._released[0][g] * BS
        assert (group.window is None) == (released == 0)
        assert bool((read[:released] // BS == cache.null_block).all())
        assert S - 1 - group.window + 1 >= released if group.window else True  # outside the last query's window


def test_scheduler_chunks_prefix_cache_and_no_leaks(gemma):
    """Four prompts past the window through the scheduler, chunked prefill and prefix caching, on a pool that
    holds the window groups' windows only: greedy tokens equal whole-forward decoding; a second pass hits the
    prefix cache (window groups keep only the cached blocks inside the hit's window); nothing leaks."""
    _, engine = gemma
    shared = [(7 * i) % 150 + 1 for i in range(30)]
    prompts = [shared + [i + 1, i + 2] for i in range(4)]
    n = 20
    expected = [_greedy(engine, p, n) for p in prompts]
    cache = engine.new_kv_cache(num_blocks=60, prefix_caching=True)
    # one sequence holds 13 full blocks + 3 x 4; four at once would need 4 x 25 without the chunk cut
    for rounds in range(2):
        scheduler = Scheduler(engine, cache, max_num_seqs=4, max_num_batched_tokens=12, max_queue=None)
        requests = [scheduler.add_request(p, SamplingParams(max_tokens=n, stop_ids=())) for p in prompts]
        scheduler.run()
        assert [r.output_ids for r in requests] == expected
        assert cache.num_used_blocks == 0 and cache.num_free_blocks == 60
    assert cache.prefix_hits > 0 and cache.window_releases > 0
    # 30 blocks: a whole 32-token prompt in one chunk needs 8 + 3 x 8, so its chunk is cut to what the pool holds
    # (one request alone is admitted on what its one-token chunks need)
    cache = engine.new_kv_cache(num_blocks=30)
    scheduler = Scheduler(engine, cache, max_num_seqs=4, max_num_batched_tokens=40, max_queue=None)
    requests = [scheduler.add_request(p, SamplingParams(max_tokens=n, stop_ids=())) for p in prompts]
    for _ in range(400):  # stepped by hand: a request preempted over and over would never finish
        if not scheduler.has_work():
            break
        scheduler.step()
    assert not scheduler.has_work() and scheduler.num_preemptions == 0
    assert [r.output_ids for r in requests] == expected and cache.num_used_blocks == 0
    # on a pool where nothing is evicted, a hit's window groups hold only the cached blocks inside the window of
    # its first query (those before it were released, and stay cached, as the sequence went past them)
    cache = engine.new_kv_cache(num_blocks=200, prefix_caching=True)
    scheduler = Scheduler(engine, cache, max_num_batched_tokens=12, max_queue=None)
    scheduler.add_request(prompts[0], SamplingParams(max_tokens=n, stop_ids=()))
    scheduler.run()
    assert cache.allocator.evictions == 0 and cache.window_releases > 0
    cache.add_sequence("hit", prompts[0] + expected[0][:10])
    hit = cache.lengths["hit"]
    assert hit >= 32
    for g, group in enumerate(cache.groups):
        table = cache.group_tables["hit"][g]
        nulls = sum(b == cache.null_block for b in table)
        assert nulls == (0 if group.window is None else (hit - WINDOW + 1) // BS)
    logits = engine.model(torch.tensor([[(prompts[0] + expected[0])[hit]]]),
                          cache.prepare(["hit"], torch.tensor([[hit]])), cache)[0, -1]
    assert int(logits.argmax()) == (prompts[0] + expected[0])[hit + 1]
    cache.free_sequence("hit")
    assert cache.num_used_blocks == 0


def test_a_request_is_refused_only_when_its_window_groups_cannot_fit(gemma):
    _, engine = gemma
    cache = engine.new_kv_cache(num_blocks=20)
    scheduler = Scheduler(engine, cache, max_queue=None)
    scheduler.add_request([1] * 30, SamplingParams(max_tokens=10))  # 10 full blocks + 3 x 3 window blocks
    with pytest.raises(KilnError, match="needs 22 KV-cache blocks"):
        scheduler.add_request([1] * 40, SamplingParams(max_tokens=10))  # 13 + 9


def test_fork_with_windows(gemma):
    _, engine = gemma
    prompt = list(range(3, 25))
    cache = engine.new_kv_cache(num_blocks=60)
    cache.add_sequence("a")
    _decode(engine, cache, "a", prompt, 1, forced=[7])
    cache.fork("a", "b")
    out = {}
    for seq, tail in (("a", [9, 11, 13, 15, 17, 19, 21, 23, 25, 27]), ("b", [10, 12, 14, 16, 18, 20, 22, 24, 26, 28])):
        logits = []
        for i, t in enumerate(tail):
            positions = cache.prepare([seq], torch.tensor([[len(prompt) + 1 + i]]))
            logits.append(engine.model(torch.tensor([[t]]), positions, cache)[0, -1])
        out[seq] = logits
    assert cache.copies_on_write > 0
    for seq, tail in (("a", [9, 11, 13, 15, 17, 19, 21, 23, 25, 27]), ("b", [10, 12, 14, 16, 18, 20, 22, 24, 26, 28])):
        ref = _full_cache(engine)
        ref.add_sequence(0)
        _, ref_logits = _decode(engine, ref, 0, prompt, len(tail) + 1, forced=[7, *tail])
        assert all(torch.equal(a, b) for a, b in zip(out[seq], ref_logits[2:], strict=True))
    for seq in ("a", "b"):
        cache.free_sequence(seq)
    assert cache.num_used_blocks == 0


def test_truncate_never_needs_a_released_block(gemma):
    _, engine = gemma
    cache = engine.new_kv_cache(num_blocks=40)
    cache.add_sequence(0)
    _decode(engine, cache, 0, list(range(1, 30)), 4)  # last forward wrote position 32
    assert cache._released[0][1] == (32 - WINDOW + 1) // BS
    with pytest.raises(KilnError, match="cannot roll back to 20"):
        cache.truncate(0, 20)
    cache.truncate(0, 31)  # within what the latest forward wrote: its blocks are all held
    lookahead = PagedKVCache(engine.kv_streams, 40, BS, windows=engine.kv_windows, lookahead=6)
    lookahead.add_sequence(0)
    _decode(engine, lookahead, 0, list(range(1, 30)), 4)
    lookahead.truncate(0, 27)  # 6 positions of rollback kept
    assert lookahead._released[0][1] == (32 - 6 - WINDOW + 1) // BS


class TreeOracle(Drafter):
    """Proposes the true greedy continuation as a chain with one wrong token whose sibling is right (so the
    accepted path leaves the chain: `move`), and a wrong last draft (a rollback: `truncate`)."""

    tree_width = 2

    def __init__(self, prompt, continuation, vocab):
        self.prompt, self.continuation, self.vocab, self.calls = prompt, continuation, vocab, 0

    def propose(self, rows, contexts, k, temperature, top_p, generator):
        drafts, siblings = [], []
        for context in contexts:
            done = len(context) - len(self.prompt)
            true = self.continuation[done:done + k]
            self.calls += 1
            chain, alternatives = list(true), [[] for _ in true]
            if len(true) >= 2 and self.calls % 2:
                chain[1] = (true[1] + 1) % self.vocab  # wrong; its sibling is right, a leaf
                alternatives[1] = [true[1]]
            elif true:
                chain[-1] = (true[-1] + 1) % self.vocab
            drafts.append(chain)
            siblings.append(alternatives)
        return Proposal(drafts, [None] * len(drafts), siblings)


@pytest.mark.parametrize("tree", [False, True])
def test_speculative_past_the_window_is_plain_greedy(gemma, tree):
    """Chain (prompt lookup) and tree verification far past the window, on a pool sized for the windows:
    every token is plain greedy decoding's. A tree node's window is counted at its depth's position."""
    _, engine = gemma
    prompt = [3, 9, 4, 9, 4, 9, 4, 1, 2, 3, 1, 2, 3]
    n = 50
    expected = _greedy(engine, prompt, n)
    drafter = TreeOracle(prompt, expected, engine.spec.vocab_size) if tree else PromptLookupDrafter()
    engine.kv_pool = engine.new_kv_cache(num_blocks=40)
    out, stats = engine.speculative_ids([prompt], n, 4, drafter, stop_ids=())
    assert out[0][0] == expected and stats.accepted > 0
    assert engine.kv_pool.window_releases > 0 and engine.kv_pool.num_used_blocks == 0


def test_tree_verification_masks_each_window_at_the_nodes_depth(gemma):
    """A tree forward past the window: each node's logits equal plain decoding of its path."""
    _, engine = gemma
    prompt = list(range(1, 21))
    cache = engine.new_kv_cache(num_blocks=40)
    cache.add_sequence(0)
    _decode(engine, cache, 0, prompt[:-1], 0)
    # node 0: the last prompt token at position 19; chain 5, 6 and a sibling 8 of 5
    nodes = {0: ([-1, 5, 8, 6], [-1, 0, 0, 1])}
    tokens, positions = verification_batch(cache, [0], nodes, {0: 19}, {0: prompt[-1]})
    logits = engine.model(tokens, positions, cache)[0]
    for node, path in ((0, []), (1, [5]), (2, [8]), (3, [5, 6])):
        ids = prompt + path
        ref = engine.model(torch.tensor([ids]), torch.arange(len(ids))[None])[0, -1]
        torch.testing.assert_close(logits[node], ref, rtol=1e-5, atol=1e-5)


def test_scoring_and_the_compile_warm_up_size_their_scratch_pools_for_every_group(gemma):
    """Engine.logits (the gate's scoring) writes a whole list in one forward, so every group holds its length;
    compile_decode's warm-up holds two short sequences in every group."""
    _, engine = gemma
    lists = [list(range(1, 40)), list(range(3, 20))]
    for ids, logits in zip(lists, engine.logits(lists), strict=True):
        whole = engine.model(torch.tensor([ids]), torch.arange(len(ids))[None])[0]
        torch.testing.assert_close(logits, whole, rtol=0, atol=1e-5)
    engine.compile_decode()
    assert engine.compiled
