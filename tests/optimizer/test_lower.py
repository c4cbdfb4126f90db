"""Lowering: a build lowers its graph once after the passes, and the artifact stores that lowering."""

from __future__ import annotations

import json

from kiln.optimizer import build as build_module
from kiln.optimizer import lower as lower_module
from kiln.optimizer.build import build
from kiln.optimizer.loader import load_checkpoint
from kiln.optimizer.lower import lower, write_artifact

MANIFEST = {"source": {"model_type": "llama"}, "target": "hopper", "recipe": {"name": "t", "passes": []}, "passes": []}


def test_write_artifact_stores_the_given_lowering(generated_checkpoint, tmp_path, monkeypatch):
    graph = load_checkpoint(generated_checkpoint)
    lowered = lower(graph)
    calls = []
    monkeypatch.setattr(lower_module, "lower_tensors", lambda g: calls.append(g))  # lowering again would fail
    art = write_artifact(graph, tmp_path / "art", MANIFEST, "report", lowered=lowered)
    manifest = json.loads((art / "manifest.json").read_text())
    assert not calls and manifest["formats"] == lowered.formats
    assert manifest["sizes"]["weight_bytes"] == lowered.weight_bytes and set(manifest["tensors"]) == set(lowered.tensors)


def test_a_build_lowers_once_after_its_passes(generated_checkpoint, tmp_path, monkeypatch):
    calls = []

    def counted(graph):
        calls.append(graph)
        return lower(graph)

    monkeypatch.setattr(build_module, "lower", counted)
    result = build(generated_checkpoint, "hopper", "fp8-weights", tmp_path / "art", gate=False)
    assert len(calls) == 1 and result.weight_bytes == result.manifest["sizes"]["weight_bytes"]
