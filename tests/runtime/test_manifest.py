"""The typed manifest: one reader and writer of manifest.json, recording the source's spec."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kiln.kernels.errors import KilnError
from kiln.optimizer.build_config import BuildConfig
from kiln.optimizer.loader import load_checkpoint
from kiln.runtime.manifest import SOURCE_ARCHITECTURE, Manifest, known_source_spec, load_manifest, source_spec


def _as_written(manifest: Manifest) -> dict:
    return json.loads(json.dumps(manifest.to_json()))  # tuples become lists, as in manifest.json


def test_a_build_records_the_source_spec_and_reads_back_equal(plain_artifact, generated_checkpoint):
    data = json.loads((plain_artifact / "manifest.json").read_text())
    manifest = load_manifest(plain_artifact)
    assert _as_written(manifest) == data  # every key, typed or kept as it was
    spec = load_checkpoint(generated_checkpoint).spec
    assert manifest.source_spec == spec and manifest.architecture == spec
    assert source_spec(manifest, manifest.architecture) is manifest.architecture  # no structural pass
    assert source_spec(data, manifest.architecture) is manifest.architecture
    assert manifest.sizes.weight_bytes == data["sizes"]["weight_bytes"]
    assert manifest.build.reproducible is False and manifest.artifact.files == data["files"]


def test_source_spec_differs_after_a_structural_change(plain_artifact):
    manifest = load_manifest(plain_artifact)
    changed = dataclasses.replace(manifest.architecture, vocab_size=manifest.architecture.vocab_size + 1)
    assert source_spec(manifest, changed) == manifest.source_spec != changed


def test_an_artifact_without_the_source_spec_still_loads(plain_artifact):
    data = json.loads((plain_artifact / "manifest.json").read_text())
    del data[SOURCE_ARCHITECTURE]  # as written before the source's spec was recorded
    manifest = Manifest.from_json(data)
    assert manifest.source_spec is None and _as_written(manifest) == data
    assert source_spec(manifest, manifest.architecture) is None and source_spec(data, manifest.architecture) is None


def test_a_hand_made_manifest_keeps_its_keys():
    data = {"source": {"model_type": "llama"}, "target": "hopper", "recipe": {"name": "t", "passes": []},
            "passes": [], "note": "kept"}
    manifest = Manifest.from_json(data)
    assert manifest.build is None and manifest.artifact is None and manifest.extra == {"note": "kept"}
    assert manifest.to_json() == data


def test_build_config_checks_before_anything_loads():
    with pytest.raises(KilnError, match="paragraph counts must be positive"):
        BuildConfig("nowhere", "hopper", "none", None, paragraphs=0)
    with pytest.raises(KilnError, match="calib_tokens"):
        BuildConfig("nowhere", "hopper", "none", None, calib_tokens=0)
    config = BuildConfig("nowhere", "hopper", "fp8-weights", None, gate=False)
    assert config.eval_data is None and config.calib_data is not None and config.place.type == "cpu"
    assert config.resolved_recipe.name == "fp8-weights" and len(config.pipeline.passes) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.gate = True


def test_known_source_spec_refuses_an_older_converted_artifact_in_one_line(plain_artifact):
    data = json.loads((plain_artifact / "manifest.json").read_text())
    spec = load_manifest(plain_artifact).architecture
    layer = spec.layers[0]
    converted = dataclasses.replace(spec, layers=(dataclasses.replace(
        layer, attention=dataclasses.replace(layer.attention, kind="mla")), *spec.layers[1:]))
    assert known_source_spec(data, converted, "pricing") == spec  # recorded: the source before the conversion
    del data[SOURCE_ARCHITECTURE]  # written before the record
    assert known_source_spec(data, spec, "pricing") is spec  # nothing converted: the artifact's own
    with pytest.raises(KilnError, match="^pricing needs the structure of the checkpoint") as refused:
        known_source_spec(data, converted, "pricing")
    assert "\n" not in str(refused.value)
    data["source"]["model_type"] = "deepseek_v3"  # natively MLA: nothing was converted
    assert known_source_spec(data, converted, "pricing") is converted
