"""The draft head's training objective: EAGLE-3's training-time test unrolls drafting exactly as the runtime
drafts, step by step, so what the head trains on at step j is what it sees at its j-th draft."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kiln.optimizer.loader import load_checkpoint
from kiln.optimizer.measure.draft_training import DraftDistillation, unroll_mask
from kiln.passes.draft_head import head_module, init_tensors
from kiln.runtime.kv_format import resolve_kv_streams
from kiln.runtime.paged_kv_cache import PagedKVCache


def test_the_unroll_mask_by_hand():
    # step 3 at position t: step 1's keys up to t - 2, step 2's key at t - 1, its own at t
    mask = unroll_mask(4, 3).int()
    assert mask.tolist() == [
        [0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0],
        [0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0],
        [1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0],
        [1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1],
    ]
    assert torch.equal(unroll_mask(5, 1), torch.ones(5, 5, dtype=torch.bool).tril())


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    """A random Llama of four layers (an EAGLE-3 head reads three)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=128)
    path = tmp_path_factory.mktemp("four_layers")
    LlamaForCausalLM(config).eval().save_pretrained(path)
    return load_checkpoint(path)


@pytest.mark.parametrize("architecture", ["eagle3", "mtp"])
def test_each_unrolled_step_equals_drafting_through_the_paged_cache(four_layers, architecture):
    torch.manual_seed(0)
    graph = four_layers
    module = head_module(graph, architecture)
    init = {name: (t + 0.05 * torch.randn_like(t)) for name, t in
            init_tensors(module, graph.spec.hidden_size, seed=1).items()}  # far from the identity start
    T, steps = 12, 4
    tokens = torch.randint(3, graph.spec.vocab_size, (1, T))
    objective = DraftDistillation(graph, module, init, [tokens[0].tolist()], unroll=steps)
    head = objective.module
    streams = resolve_kv_streams(dataclasses.replace(graph.spec, layers=(module.layer,), extra_modules=()), {})[0]
    positions = torch.arange(T)[None]
    with torch.no_grad():
        got = objective.target.features(tokens, positions, collect=head.aux_layers)
        inputs = got[1] if head.aux_layers else got
        outs = objective.unrolled(inputs[:, :-1], tokens[:, 1:], positions[:, :-1])
        for start in (0, 3, 6):  # the target verified positions 0..start; the head drafts from there
            cache = PagedKVCache([streams], 8, 4)
            cache.add_sequence(0)
            pos = cache.prepare([0], positions[:, :start + 1])
            last = head(head.project(inputs[:, :start + 1]), tokens[:, 1:start + 2], pos, cache)[:, -1]
            torch.testing.assert_close(last, outs[0][:, start], rtol=1e-5, atol=1e-5)
            for j in range(2, steps + 1):
                t = start + j - 1
                pos = cache.prepare([0], torch.tensor([[t]]))
                last = head(last[:, None], tokens[:, t + 1:t + 2], pos, cache)[:, 0]
                torch.testing.assert_close(last, outs[j - 1][:, t], rtol=1e-5, atol=1e-5,
                                           msg=lambda m, j=j, t=t: f"step {j} at position {t}: {m}")


def test_unroll_counts_at_least_one_step(four_layers):
    from kiln.kernels.errors import KilnError

    graph = four_layers
    module = head_module(graph, "eagle3")
    with pytest.raises(KilnError, match="unroll counts the drafting steps"):
        DraftDistillation(graph, module, init_tensors(module, graph.spec.hidden_size, 0), [[1, 2, 3]], unroll=0)


def test_a_padded_batch_unrolls_each_row_as_alone(four_layers):
    """Rows padded at the end: every valid position's output at every step is the row's own, alone."""
    torch.manual_seed(0)
    module = head_module(four_layers, "eagle3")
    objective = DraftDistillation(four_layers, module, init_tensors(module, four_layers.spec.hidden_size, 1),
                                  [[5, 6, 7]], unroll=3)
    lengths = (11, 7)
    tokens = torch.randint(3, four_layers.spec.vocab_size, (2, max(lengths)))
    tokens[1, lengths[1]:] = 0
    positions = torch.arange(max(lengths)).expand(2, -1)
    with torch.no_grad():
        inputs = objective.target.features(tokens, positions, collect=objective.module.aux_layers)[1]
        batch = objective.unrolled(inputs[:, :-1], tokens[:, 1:], positions[:, :-1])
        for row, n in enumerate(lengths):
            alone = objective.unrolled(inputs[row:row + 1, :n - 1], tokens[row:row + 1, 1:n], positions[:1, :n - 1])
            for j, (b, a) in enumerate(zip(batch, alone, strict=True), start=1):
                torch.testing.assert_close(b[row, j - 1:n - 1], a[0, j - 1:], rtol=1e-5, atol=1e-5,
                                           msg=lambda m, j=j, row=row: f"row {row} step {j}: {m}")
