"""The compiled decode step (Engine.compile_decode: torch.compile over PagedKVCache.step_view) decodes what the
eager step decodes, writes the same cache, and serves every batch size and history length from the two graphs
its warm-up compiles (batch 1, and any larger batch), without recompiling."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from kiln.optimizer.loader import load_checkpoint
from kiln.runtime.engine import Engine, load_tokenizer
from kiln.runtime.request import SamplingParams
from kiln.runtime.scheduler import Scheduler
from tests.conftest import STORIES, refused

torch.set_num_threads(1)

# prompts of different lengths, so the rows of a batch hold histories of different lengths
PROMPTS = [[1, *range(100 + i, 104 + 5 * i)] for i in range(4)]
FP8_DYNAMIC = {"format": "fp8_e4m3", "scaling": "dynamic"}


def _engine(kv_cache=None) -> Engine:
    if not (STORIES / "config.json").is_file():
        pytest.skip("../shared/models absent")
    return Engine(load_checkpoint(STORIES).spec, load_file(STORIES / "model.safetensors"), {},
                  load_tokenizer(STORIES), kv_cache=kv_cache, kv_block_size=4)


@pytest.mark.parametrize("kv", ["bf16", "fp8-dynamic"])
def test_compiled_decode_generates_the_eager_tokens_from_two_graphs(kv):
    from torch._dynamo.utils import counters

    table = None if kv == "bf16" else {str(i): FP8_DYNAMIC for i in range(5)}
    eager, compiled = _engine(table), _engine(table)
    torch._dynamo.reset()
    counters.clear()
    compiled.compile_decode()
    assert compiled.compiled and counters["stats"]["unique_graphs"] == 2  # batch 1, and batch >= 2
    # one request at a time, then all four: batches of 1 to 4 rows, histories of 5 to 60 tokens
    for prompts in ([PROMPTS[0]], [PROMPTS[3]], PROMPTS):
        assert compiled.generate_ids(prompts, 40) == eager.generate_ids(prompts, 40)
    assert counters["stats"]["unique_graphs"] == 2  # nothing recompiled
    assert not counters["graph_break"]


def test_a_compiled_step_writes_the_cache_and_logits_of_an_eager_step():
    eager, compiled = _engine(), _engine()
    compiled.compile_decode(warmup=False)
    caches, logits = [], []
    for engine in (eager, compiled):
        scheduler = Scheduler(engine, max_num_seqs=4, max_num_batched_tokens=256)
        for prompt in PROMPTS[:3]:
            scheduler.add_request(prompt, SamplingParams(max_tokens=8, stop_ids=()))
        scheduler.step()  # the prompts, eager in both
        ids = [r.id for r in scheduler.running]
        cache = scheduler.cache
        tokens = torch.tensor([[r.tokens[r.num_computed]] for r in scheduler.running])
        positions = torch.tensor([[r.num_computed] for r in scheduler.running])
        cache.prepare(ids, positions)
        with torch.inference_mode():
            logits.append(engine.decode_logits(tokens, positions, cache))
        caches.append([[getattr(pool, n).clone() for pool in layer for n in pool.storage] for layer in cache.pools])
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-4)
    for eager_layer, compiled_layer in zip(*caches, strict=True):
        for a, b in zip(eager_layer, compiled_layer, strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-5)


def test_step_view_refuses_a_forward_it_cannot_express():
    engine = _engine()
    cache = engine.new_kv_cache(num_blocks=8)
    cache.add_sequence("a")
    refused(cache.step_view, match="prepare")
    positions = torch.arange(4).unsqueeze(0)
    cache.prepare(["a"], positions, torch.tensor([[True, True, True, False]]))  # padding
    refused(cache.step_view, match="no padding")
