"""`optimize gate` compares an artifact against its recorded source only, and never passes a result that
cannot come from a faithful rewrite (recovery far above 1, KL of nats per token)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.passes.gate_result import GateResult
from tests.breakage import broken_copy
from tests.conftest import EVAL_TEXT, STORIES, needs_stories


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    from kiln.optimizer.build import build

    if not (STORIES / "config.json").is_file():
        pytest.skip("../shared/models absent")
    out = tmp_path_factory.mktemp("gate") / "art"
    build(STORIES, "hopper", "none", out, gate=False)
    return out


def scrambled_copy(tmp_path):
    """stories260K with every linear weight drowned in noise: the same shapes, another model."""
    path = broken_copy(STORIES, tmp_path / "other", "intact")
    tensors = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for name, t in tensors.items():
        if name.endswith("proj.weight"):
            tensors[name] = t + 3 * t.std() * torch.randn(t.shape, generator=gen)
    save_file(tensors, path / "model.safetensors")
    return path


def gate(cli, artifact, baseline, *extra):
    return cli("gate", artifact, "--baseline", baseline, "--data", EVAL_TEXT, "--paragraphs", "30",
               "--min-recovery", "0.9", "--generate", "0", *extra)


@needs_stories
def test_the_recorded_source_passes(cli, artifact):
    code, stdout, stderr = gate(cli, artifact, STORIES, "--json")
    assert code == 0, stderr
    assert json.loads(stdout)["recovery"] == pytest.approx(1.0)


@needs_stories
def test_another_model_is_refused_as_baseline(cli, artifact, tmp_path):
    code, _, stderr = gate(cli, artifact, scrambled_copy(tmp_path))
    assert code == 2 and "is not this artifact's source" in stderr and stderr.count("\n") == 1


@needs_stories
def test_the_artifact_itself_is_refused_as_baseline(cli, artifact):
    code, _, stderr = gate(cli, artifact, artifact)
    assert code == 2 and "is a Kiln engine artifact, not a checkpoint" in stderr and stderr.count("\n") == 1


@needs_stories
def test_any_baseline_compares_but_an_implausible_result_fails(cli, artifact, tmp_path):
    other = scrambled_copy(tmp_path)
    code, _, stderr = gate(cli, artifact, other, "--any-baseline")  # it cannot read the text: refused first
    assert code == 2 and "foreign to the model" in stderr
    code, stdout, stderr = gate(cli, artifact, other, "--any-baseline", "--force", "--json")
    result = json.loads(stdout)
    assert code == 1 and "implausible" in stderr
    assert result["recovery"] > 1.25 and not result["passed"] and "far above 1" in result["suspect"]


def test_suspect_results_never_pass():
    fine = GateResult(perplexity=5.0, baseline_perplexity=4.9, kl=0.01, top1=0.95, tokens=1000, floor=0.9)
    too_good = GateResult(perplexity=4.0, baseline_perplexity=4006.0, kl=15.4, top1=0.001, tokens=1000, floor=0.9)
    other = GateResult(perplexity=5.0, baseline_perplexity=5.0, kl=3.0, top1=0.2, tokens=1000, floor=0.9)
    assert fine.passed and fine.suspect is None
    assert not too_good.passed and "far above 1" in too_good.suspect
    assert not other.passed and "not a faithful rewrite" in other.suspect
    assert too_good.to_json()["suspect"] == too_good.suspect


# --- the baseline's identity is its weights and its config.json (issue #18, 4) ------------------------------
def edited_config_copy(tmp_path, name: str, **changes):
    """stories260K with the same weights and its config.json changed (or only rewritten, with no changes)."""
    path = broken_copy(STORIES, tmp_path / name, "intact")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}, indent=4, sort_keys=not changes))
    return path


@needs_stories
def test_the_manifest_records_the_sources_config_hash(artifact):
    from kiln.optimizer.loader import config_digest, read_config

    source = json.loads((artifact / "manifest.json").read_text())["source"]
    assert source["config_sha256"] == config_digest(read_config(STORIES))
    assert set(source["weight_files"]) == {"model.safetensors"}


@needs_stories
def test_the_same_weights_under_another_config_are_refused(cli, artifact, tmp_path):
    """rope_theta changed: the weight hashes match, so this was accepted, and the gate then failed on KL with
    exit 1 as if the artifact were bad. It is another model: refused as one (exit 2), unless --any-baseline."""
    # transformers 5 reads rope_parameters (stories260K's), older versions the top-level key
    other = edited_config_copy(tmp_path, "rope", rope_theta=500000.0,
                               rope_parameters={"rope_theta": 500000.0, "rope_type": "default"})
    code, _, stderr = gate(cli, artifact, other)
    assert code == 2 and stderr.count("\n") == 1, stderr
    assert "is not this artifact's source" in stderr and "the weights match but its config.json differs" in stderr
    code, _, stderr = gate(cli, artifact, other, "--any-baseline")
    assert code == 1 and "gate failed:" in stderr, stderr  # compared: another rotary base is another model


@needs_stories
def test_a_config_rewritten_without_changes_is_the_same_source(cli, artifact, tmp_path):
    same = edited_config_copy(tmp_path, "reformatted")  # other indentation and key order, the same content
    assert (same / "config.json").read_bytes() != (STORIES / "config.json").read_bytes()
    code, _, stderr = gate(cli, artifact, same)
    assert code == 0, stderr


@needs_stories
def test_an_artifact_built_before_the_config_hash_still_gates_on_its_weights(cli, artifact, tmp_path):
    import shutil

    old = tmp_path / "old-art"
    shutil.copytree(artifact, old)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["source"]["config_sha256"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    code, _, stderr = gate(cli, old, STORIES)
    assert code == 0, stderr
    assert "warning: the artifact's manifest records no hash of its source's config.json" in stderr
    assert "checked on its weights only" in stderr
    code, _, stderr = gate(cli, old, scrambled_copy(tmp_path))  # the weights are still checked
    assert code == 2 and "its weight files' sha256 differ" in stderr
