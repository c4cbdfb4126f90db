"""The gradient estimate of sensitivity (optimizer.measure.fisher.FisherKl) against the measured KL it stands in for
(optimizer.measure.logit_kl.LogitKl, itself checked against the full lowering in tests/test_probe_swap.py)."""

from __future__ import annotations

import pytest
import torch

from kiln.optimizer.loader import load_checkpoint
from kiln.optimizer.measure.fisher import FisherKl
from kiln.optimizer.measure.logit_kl import LogitKl
from tests.conftest import needs_stories
from tests.test_probe_swap import linears_of, quantize, random_tokens, restore


def spearman(xs, ys) -> float:
    """Rank correlation (no ties in measured floats)."""
    rx, ry = (torch.tensor(v).argsort().argsort().double() for v in (xs, ys))
    return float(torch.corrcoef(torch.stack([rx, ry]))[0, 1])


def candidate(graph, names, option):
    """{linear: its round-to-nearest quantized weight in `option`}, leaving the graph as it was."""
    before = quantize(graph, names, option)
    state = {n: graph.linears[n].quant for n in names}
    restore(graph, before)
    return state


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from tests.tiny_models import make_tiny_checkpoint

    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("fisher") / "llama")


def test_estimate_is_zero_without_change_and_independent_of_chunking(tiny_llama):
    graph = load_checkpoint(tiny_llama)
    tokens = random_tokens(8, graph.spec.vocab_size)
    cands = {("mlp0", "fp8"): candidate(graph, linears_of(graph, 0, ("gate", "up")), "fp8"),
             ("attn1", "nvfp4"): candidate(graph, linears_of(graph, 1, ("q", "k", "v")), "nvfp4"),
             ("head", "fp8"): candidate(graph, ["lm_head"], "fp8"),
             ("none", "bf16"): {n: None for n in linears_of(graph, 0, ("down",))}}
    whole = FisherKl(tokens, batch_tokens=64)(graph, cands, 8)
    split = FisherKl(tokens, batch_tokens=64, max_candidate_bytes=1)  # one candidate per sweep
    chunked = split(graph, cands, 8)
    assert split.sweeps == len(cands)
    assert whole[("none", "bf16")] == 0.0  # the source weights: Δy = 0
    assert all(whole[k] > 0 for k in cands if k != ("none", "bf16"))
    for key in cands:  # the same labels are drawn in every sweep
        assert chunked[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-12)
    assert all(graph.linears[n].quant is None for n in graph.linears)  # the graph is left as it was


@needs_stories
def test_estimate_ranks_groups_as_the_measured_kl_does_on_stories260k(stories_graph):
    """On a trained model, the estimate ranks groups and formats as measured probes do, and is of their size."""
    from kiln.calibration.data import read_paragraphs, tokenize_paragraphs
    from kiln.optimizer.defaults import CALIBRATION_TEXT
    from kiln.runtime.engine import load_tokenizer
    from tests.conftest import STORIES

    graph = stories_graph
    tokens = tokenize_paragraphs(load_tokenizer(STORIES), read_paragraphs(CALIBRATION_TEXT, 64))
    roles = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}
    cands = {(layer, group, option): candidate(graph, linears_of(graph, layer, rs), option)
             for layer in range(len(graph.blocks)) for group, rs in roles.items() for option in ("fp8", "nvfp4")}
    estimated = FisherKl(tokens)(graph, cands, 64)
    measured = {}
    probe = LogitKl(graph, tokens)
    for key, state in cands.items():
        before = {n: graph.linears[n].quant for n in state}
        for n, q in state.items():
            graph.linears[n].quant = q
        measured[key] = probe(graph, 64)
        restore(graph, before)
    keys = list(cands)
    rho = spearman([measured[k] for k in keys], [estimated[k] for k in keys])
    assert rho > 0.9, rho
    ratios = sorted(estimated[k] / measured[k] for k in keys)
    assert 0.3 < ratios[len(ratios) // 2] < 3, ratios
