"""The continuous-batching scheduler: requests that join mid-run, chunked prefill, preemption by recompute and
prefix caching all give the tokens each request gets decoded on its own; the queue is bounded and FCFS; stop
strings never reach a streaming client; aborted and finished requests give their blocks back."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from kiln.kernels.errors import KilnError
from kiln.optimizer.loader import load_checkpoint
from kiln.runtime.engine import Engine, load_tokenizer
from kiln.runtime.kv_blocks import BlockAllocator, KvCacheFull
from kiln.runtime.kv_format import KvStream
from kiln.runtime.paged_kv_cache import PagedKVCache
from kiln.runtime.request import QueueFull, SamplingParams
from kiln.runtime.scheduler import Scheduler
from tests.conftest import EVAL_TEXT, STORIES

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def stories():
    if not (STORIES / "config.json").is_file():
        pytest.skip("../shared/models absent")
    from kiln.calibration.data import load_token_lists

    tok = load_tokenizer(STORIES)
    engine = Engine(load_checkpoint(STORIES).spec, load_file(STORIES / "model.safetensors"), {}, tok,
                    kv_block_size=4)
    texts = [t for t in load_token_lists(tok, EVAL_TEXT, 40, 256) if len(t) >= 48]
    return engine, texts


def _alone(engine, prompt, n, **kw):
    (out, _), = engine.generate_ids([prompt], n, **kw)
    return out


def _drain(scheduler):
    events = []
    while scheduler.has_work():
        events += scheduler.step()
    return events


def test_requests_joining_mid_run_get_their_solo_tokens(stories):
    engine, texts = stories
    prompts = [t[: 5 + 7 * i] for i, t in enumerate(texts[:6])]
    expected = [_alone(engine, p, 12, stop_ids=()) for p in prompts]
    scheduler = Scheduler(engine, max_num_seqs=4, max_num_batched_tokens=64, num_blocks=128)
    requests = []
    for prompt in prompts:  # one new request every other step: the batch changes at every step
        requests.append(scheduler.add_request(prompt, SamplingParams(max_tokens=12, stop_ids=())))
        scheduler.step()
        scheduler.step()
    _drain(scheduler)
    assert [r.output_ids for r in requests] == expected
    assert all(r.finish_reason == "length" for r in requests)
    assert scheduler.cache.num_used_blocks == 0 and not scheduler.running


def test_chunked_prefill_keeps_the_budget_and_the_decoders_going(stories):
    engine, texts = stories
    short, long = texts[0][:6], texts[1][:120]
    expected = [_alone(engine, p, 10, stop_ids=()) for p in (short, long)]
    scheduler = Scheduler(engine, max_num_seqs=4, max_num_batched_tokens=16, num_blocks=128)
    a = scheduler.add_request(short, SamplingParams(max_tokens=10, stop_ids=()))
    scheduler.step()  # a prefilled: it decodes from now on
    b = scheduler.add_request(long, SamplingParams(max_tokens=10, stop_ids=()))
    computed = []
    while not b.output_ids:
        scheduler.step()
        computed.append(scheduler.last_step_tokens)
    # the 120-token prompt took 8 steps of 15 prompt tokens + a's 1 decode token: never over the budget of 16
    assert len(computed) >= 120 // 15 and max(computed) <= 16
    assert len(a.output_ids) == min(10, 1 + len(computed))  # a got a token at every one of those steps
    _drain(scheduler)
    assert [a.output_ids, b.output_ids] == expected


def test_a_prompt_chunk_cut_to_one_token_is_not_sampled(stories):
    """Six prompts of 20 under a budget of 16: at the fourth step three decoders and a chunk of 13 leave one
    token of budget, and the fourth prompt's first chunk is that one token; it is a prompt chunk (no token
    sampled after it), not a decoder."""
    engine, texts = stories
    prompts = [t[:20] for t in texts[:6]]
    expected = [_alone(engine, p, 8, stop_ids=()) for p in prompts]
    scheduler = Scheduler(engine, max_num_seqs=6, max_num_batched_tokens=16, num_blocks=60, prefix_caching=False)
    requests = [scheduler.add_request(p, SamplingParams(max_tokens=8, stop_ids=())) for p in prompts]
    chunks = []
    while scheduler.has_work():
        plan = scheduler._plan()
        chunks += [(r.id, n) for r, n, _ in plan if len(r.tokens) - r.num_computed > 1]
        scheduler.step()
    assert (3, 1) in chunks  # the case this test is for
    assert [r.output_ids for r in requests] == expected


def test_preemption_recomputes_and_continues_identically(stories):
    engine, texts = stories
    prompts = [t[:20] for t in texts[:6]]
    greedy = [_alone(engine, p, 24, stop_ids=()) for p in prompts]
    # 20 blocks of 4 tokens: six prompts of 20 (5 blocks each) fit at admission, but not as they grow
    scheduler = Scheduler(engine, max_num_seqs=6, max_num_batched_tokens=256, num_blocks=20, prefix_caching=False)
    requests = [scheduler.add_request(p, SamplingParams(max_tokens=24, stop_ids=())) for p in prompts]
    _drain(scheduler)
    assert scheduler.num_preemptions > 0 and any(r.preemptions for r in requests)
    assert [r.output_ids for r in requests] == greedy
    assert scheduler.cache.num_used_blocks == 0

    sampled = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=7, stop_ids=())
    roomy = Scheduler(engine, num_blocks=256)
    free = [roomy.add_request(p, sampled) for p in prompts]
    _drain(roomy)
    tight = Scheduler(engine, max_num_seqs=6, num_blocks=20, prefix_caching=False)
    squeezed = [tight.add_request(p, sampled) for p in prompts]
    _drain(tight)
    assert tight.num_preemptions > 0
    assert [r.output_ids for r in squeezed] == [r.output_ids for r in free]  # a seeded request keeps its draws


def test_prefix_cache_hits_and_gives_the_same_tokens(stories):
    engine, texts = stories
    system = texts[0][:40]  # a shared 40-token "system prompt": 10 full blocks of 4
    prompts = [system + t[:8] for t in texts[1:7]]
    outputs = {}
    for caching in (False, True):
        scheduler = Scheduler(engine, max_num_seqs=2, num_blocks=128, prefix_caching=caching)
        requests = [scheduler.add_request(p, SamplingParams(max_tokens=10, stop_ids=())) for p in prompts]
        _drain(scheduler)
        outputs[caching] = [r.output_ids for r in requests]
        if caching:
            # the first two ran together (nothing cached yet); each later one found the system prompt cached
            assert [r.cached_tokens for r in requests] == [0, 0, 40, 40, 40, 40]
            assert scheduler.cache.prefix_hit_rate == pytest.approx(160 / (6 * 48))
            assert scheduler.prompt_tokens_computed == 6 * 48 - 160
    assert outputs[True] == outputs[False]


def test_a_shared_block_is_never_evicted_and_eviction_is_lru(stories):
    engine, texts = stories
    system = texts[0][:16]
    scheduler = Scheduler(engine, max_num_seqs=8, max_num_batched_tokens=256, num_blocks=24)
    holder = scheduler.add_request(system + texts[1][:4], SamplingParams(max_tokens=40, stop_ids=()))
    scheduler.step()
    scheduler.step()
    shared = list(scheduler.cache.block_tables[holder.id][:4])  # the system prompt's blocks, registered
    assert all(scheduler.cache.allocator.is_registered(b) for b in shared)
    sharer = scheduler.add_request(system + texts[2][:4], SamplingParams(max_tokens=6, stop_ids=()))
    others = [scheduler.add_request(t[:24], SamplingParams(max_tokens=6, stop_ids=())) for t in texts[3:12]]
    _drain(scheduler)
    assert sharer.cached_tokens == 16
    assert scheduler.cache.allocator.evictions > 0  # the other requests' cached blocks were recycled ...
    expected = [_alone(engine, r.prompt_ids, len(r.output_ids), stop_ids=()) for r in (holder, sharer, *others)]
    assert [r.output_ids for r in (holder, sharer, *others)] == expected  # ... and nobody read a recycled block

    alloc = BlockAllocator(3)
    a, b, _ = alloc.allocate(3)  # the third stays in use
    alloc.register(a, b"a"), alloc.register(b, b"b")
    alloc.release([a]), alloc.release([b])  # cached, a least recently used
    alloc.share(b)  # b back in use: not evictable
    assert alloc.allocate(1) == [a] and alloc.lookup(b"a") is None and alloc.lookup(b"b") == b
    with pytest.raises(KvCacheFull):
        alloc.allocate(1)  # b and c are in use


def test_fork_copies_a_shared_block_on_write():
    streams = [(KvStream("k", 1, 4, "bf16", "none", None, None), KvStream("v", 1, 4, "bf16", "none", None, None))]
    cache = PagedKVCache(streams, num_blocks=4, block_size=4)
    cache.add_sequence("a")
    positions = torch.arange(6)[None]
    cache.prepare(["a"], positions)
    first = torch.arange(24.0).view(1, 6, 1, 4)
    cache.update(0, (first, first), positions)
    cache.fork("a", "b")
    assert cache.block_tables["a"] == cache.block_tables["b"] and cache.num_used_blocks == 2
    cache.prepare(["b"], torch.tensor([[6]]))  # b writes into the shared half-full block: it gets a copy
    k, _ = cache.update(0, (torch.full((1, 1, 1, 4), -1.0),) * 2, torch.tensor([[6]]))
    assert cache.copies_on_write == 1 and cache.block_tables["a"][1] != cache.block_tables["b"][1]
    assert torch.equal(k[0, :6], first[0]) and torch.equal(k[0, 6], torch.full((1, 4), -1.0))
    cache.prepare(["a"], torch.tensor([[6]]))
    k, _ = cache.update(0, (torch.full((1, 1, 1, 4), 5.0),) * 2, torch.tensor([[6]]))
    assert torch.equal(k[0, :6], first[0]) and torch.equal(k[0, 6], torch.full((1, 4), 5.0))  # a unchanged


def test_queue_is_bounded_fcfs_and_abort_frees_blocks(stories):
    engine, texts = stories
    scheduler = Scheduler(engine, max_num_seqs=1, max_queue=2, num_blocks=64)
    first = scheduler.add_request(texts[0][:8], SamplingParams(max_tokens=30, stop_ids=()))
    second = scheduler.add_request(texts[1][:8], SamplingParams(max_tokens=3, stop_ids=()))
    with pytest.raises(QueueFull, match="queue is full"):
        scheduler.add_request(texts[2][:8])
    scheduler.step()
    assert scheduler.running == [first] and list(scheduler.waiting) == [second]  # first come, first served
    assert scheduler.cache.num_used_blocks > 0
    scheduler.abort(first.id)
    events = scheduler.step()
    assert first.finish_reason == "abort" and any(e.request is first and e.finished for e in events)
    assert scheduler.running == [second]
    _drain(scheduler)
    assert second.finish_reason == "length" and scheduler.cache.num_used_blocks == 0
    with pytest.raises(KilnError, match="needs 65 KV-cache blocks"):
        scheduler.add_request(texts[0][:10], SamplingParams(max_tokens=251))


def test_stop_strings_are_cut_and_never_streamed(stories):
    engine, texts = stories
    prompt = texts[0][:12]
    scheduler = Scheduler(engine, num_blocks=64, tokenizer=engine.tokenizer)
    free = scheduler.add_request(prompt, SamplingParams(max_tokens=40, stop_ids=()))
    _drain(scheduler)
    free_text = free.text
    assert free_text == engine.tokenizer.decode(prompt + free.output_ids)[len(engine.tokenizer.decode(prompt)):]
    stop = " ".join(free_text.split()[3:5])  # two words from inside the continuation, straddling tokens
    request = scheduler.add_request(prompt, SamplingParams(max_tokens=40, stop=(stop,), stop_ids=()))
    streamed = "".join(e.text for e in _drain(scheduler) if e.request is request)
    assert request.finish_reason == "stop"
    assert streamed == request.text == free_text[: free_text.index(stop)]
    assert stop not in streamed
