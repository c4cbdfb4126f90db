"""The gate reproduces the protocol's reference figure and measures what the artifact stores."""

from __future__ import annotations

import pytest

from kiln.calibration.data import load_token_lists, read_paragraphs
from kiln.optimizer.measure.gate import AccuracyGate, engine_from_graph, score
from kiln.passes.weight_quant import WeightQuantization
from kiln.runtime.engine import load_tokenizer
from tests.conftest import EVAL_TEXT, STORIES, needs_stories


@needs_stories
def test_fp32_stories260k_perplexity_matches_the_protocol_reference(stories_graph):
    tokens = load_token_lists(load_tokenizer(STORIES), EVAL_TEXT, 600)
    assert len(tokens) == 600 and all(t[0] == 1 and len(t) <= 256 for t in tokens)
    result = score(engine_from_graph(stories_graph), tokens)
    assert result.perplexity == pytest.approx(4.873, abs=5e-4)


@needs_stories
def test_gate_scores_the_stored_artifact(stories_graph, tmp_path):
    from kiln import runtime
    from kiln.kernels.targets import get_target
    from kiln.optimizer.lower import write_artifact
    from kiln.passes.base import PassContext, Pipeline

    tokens = load_token_lists(load_tokenizer(STORIES), EVAL_TEXT, 40)
    gate = AccuracyGate(engine_from_graph(stories_graph), tokens)
    Pipeline([WeightQuantization(format="fp8")]).run(stories_graph, PassContext(get_target("hopper")))
    in_memory = gate(stories_graph, 0.9)
    manifest = {"passes": [], "target": "hopper", "source": {"model_type": "llama"},
                "recipe": {"name": "fp8", "passes": []}}
    path = write_artifact(stories_graph, tmp_path / "a", manifest, "report")
    from_disk = gate.compare(runtime.load(path), 0.9)
    assert in_memory.perplexity == from_disk.perplexity and in_memory.kl == from_disk.kl
    assert 0.98 < in_memory.recovery < 1.0 and in_memory.kl > 0


def test_paragraph_protocol(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("first one\nstill first\n\n  \n\nsecond \n\n\nthird")
    assert read_paragraphs(text, None) == ["first one\nstill first", "second ", "third"]
    assert read_paragraphs(text, 2) == ["first one\nstill first", "second "]
