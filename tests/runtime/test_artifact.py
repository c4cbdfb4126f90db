"""Artifact contract: schema version and checksums are checked before anything is used."""

from __future__ import annotations

import json

import pytest

from kiln import runtime
from kiln.kernels.errors import KilnError
from kiln.optimizer.build import build
from kiln.optimizer.defaults import SAMPLE_TEXT
from kiln.optimizer.loader import load_checkpoint
from kiln.runtime.spec import spec_from_json


@pytest.fixture
def artifact(generated_checkpoint, tmp_path):
    return build(generated_checkpoint, "hopper", "fp8-weights", tmp_path / "art", eval_data=SAMPLE_TEXT,
                 min_recovery=0.5, force=True).path  # force: a model of random weights reads no text


def test_manifest_contents(artifact):
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["schema_version"] == 2 and manifest["kiln_version"]
    assert spec_from_json(manifest["architecture"]) == load_checkpoint(manifest["source"]["checkpoint"]).spec
    assert manifest["target"] == "hopper" and manifest["recipe"]["name"] == "fp8-weights"
    assert set(manifest["files"]) == {p.name for p in artifact.iterdir()} - {"manifest.json"}
    assert manifest["source"]["weight_files"]["model.safetensors"]
    tensors = manifest["tensors"]
    assert tensors["model.layers.0.self_attn.q_proj.weight"]["dtype"] == "float8_e4m3fn"
    assert tensors["model.layers.0.self_attn.q_proj.weight_scale"]["shape"] == [64, 1]  # per output channel
    (p,) = manifest["passes"]
    assert p["gate"]["seconds"] is not None and p["decision"] == "kept" and p["result"]["changed"]
    assert "## Gate" in (artifact / "report.md").read_text()
    assert not [x for x in artifact.parent.iterdir() if x.name.startswith(".")]  # no temp dirs left


def test_load_refuses_other_schema_versions_and_missing_files(artifact):
    runtime.load(artifact)
    manifest = json.loads((artifact / "manifest.json").read_text())
    (artifact / "manifest.json").write_text(json.dumps({**manifest, "schema_version": 99}))
    with pytest.raises(KilnError, match="schema version 99"):
        runtime.load(artifact)
    (artifact / "manifest.json").write_text(json.dumps({**manifest, "schema_version": 1}))
    with pytest.raises(KilnError, match="schema version 1 .* rebuild it"):
        runtime.load(artifact)
    (artifact / "manifest.json").write_text(json.dumps(manifest))
    (artifact / "report.md").unlink()
    with pytest.raises(KilnError, match="report.md listed in the manifest is missing"):
        runtime.load(artifact)


def test_runtime_does_not_import_passes_or_optimizer():
    import subprocess
    import sys

    code = ("import sys, kiln.runtime, kiln.runtime.engine, kiln.runtime.model; "
            "bad = [m for m in sys.modules if m.split('.')[:2] in (['kiln', 'passes'], ['kiln', 'optimizer'], "
            "['kiln', 'calibration'])]; "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
