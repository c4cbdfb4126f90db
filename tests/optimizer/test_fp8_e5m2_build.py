"""FP8 E5M2 weight-only end to end on stories260K, through the registry alone: a recipe file names it, the build
stores it, the runtime runs it (packed and dequantized alike), the exporters refuse it in one line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kiln import runtime
from kiln.runtime.linear import PackedLinear
from tests.conftest import STORIES

OPTIMIZE = str(Path(sys.executable).parent / "optimize")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}

TOKENS = [[1, 403, 261, 348, 416, 401, 263, 260, 443, 344]]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    if not (STORIES / "config.json").is_file():
        pytest.skip("../shared/models absent")
    root = tmp_path_factory.mktemp("e5m2")
    recipe = root / "e5m2.yaml"
    recipe.write_text("name: fp8-e5m2\npasses:\n  - pass: weight-quant\n    format: fp8_e5m2\n    method: rtn\n")
    result = subprocess.run([OPTIMIZE, "build", str(STORIES), "--recipe", str(recipe), "--no-gate", "-o",
                             str(root / "art")], env=ENV, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    return root / "art"


def test_build_stores_e5m2_weights_and_the_runtime_runs_them(artifact):
    manifest = json.loads((artifact / "manifest.json").read_text())
    quantized = {n: e for n, e in manifest["formats"].items() if e["format"] != "dense"}
    assert quantized and all((e["format"], e["activation"]) == ("fp8_e5m2", "none") for e in quantized.values())
    stored = load_file(artifact / "model.safetensors")
    assert all(stored[f"{n}.weight"].dtype == torch.float8_e5m2 for n in quantized)
    reference, packed = runtime.load(artifact), runtime.load(artifact, packed=True)
    assert sum(isinstance(m, PackedLinear) for m in packed.model.modules()) == len(quantized)
    [expected], [got] = reference.logits(TOKENS), packed.logits(TOKENS)
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-4 * float(expected.abs().max()))


@pytest.mark.parametrize("fmt", ["compressed-tensors", "hf-modelopt", "onnx"])
def test_exports_refuse_it_in_one_line(artifact, tmp_path, fmt):
    result = subprocess.run([OPTIMIZE, "export", str(artifact), "--format", fmt, "-o", str(tmp_path / "out")],
                            env=ENV, capture_output=True, text=True, check=False)
    assert result.returncode == 2, result.stderr
    assert "fp8_e5m2" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_per_tensor_scales_survive_fusion(tmp_path):
    """granularity per_tensor stores a 0-dim scale per linear; fusing q/k/v and gate/up keeps each part's scale
    (its rows repeat it), and the fused model computes what the unfused one does."""
    if not (STORIES / "config.json").is_file():
        pytest.skip("../shared/models absent")
    arts = {}
    for name, fuse in (("plain", ""), ("fused", "  - pass: fuse\n")):
        recipe = tmp_path / f"{name}.yaml"
        recipe.write_text("name: e5m2-per-tensor\npasses:\n  - pass: weight-quant\n    format: fp8_e5m2\n"
                          f"    granularity: per_tensor\n    method: rtn\n{fuse}")
        result = subprocess.run([OPTIMIZE, "build", str(STORIES), "--recipe", str(recipe), "--no-gate", "-o",
                                 str(tmp_path / name)], env=ENV, capture_output=True, text=True, check=False)
        assert result.returncode == 0, result.stderr
        arts[name] = tmp_path / name
    plain = load_file(arts["plain"] / "model.safetensors")
    assert plain["model.layers.0.self_attn.q_proj.weight_scale"].dim() == 0
    fused = json.loads((arts["fused"] / "manifest.json").read_text())["formats"]
    assert "model.layers.0.self_attn.qkv_proj" in fused
    [expected], [got] = runtime.load(arts["plain"]).logits(TOKENS), runtime.load(arts["fused"]).logits(TOKENS)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * float(expected.abs().max()))
