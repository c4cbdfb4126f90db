"""FP8 KV-cache scales in both export layouts: written under the names and in the config the serving engines
read (vLLM, SGLang, TensorRT-LLM), equal to the artifact's, and refused in one line where no layout can say what
the artifact does (offsets, per-head scales, layers kept BF16)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from kiln.optimizer.build import build
from kiln.optimizer.export import export
from kiln.optimizer.recipes import Recipe
from kiln.passes.kv_cache import KvCacheQuantization
from kiln.passes.weight_quant import WeightQuantization
from tests.conftest import refused


def _build(checkpoint, root, name, **kv):
    passes = (WeightQuantization(format="fp8", activations="dynamic", method="rtn"), KvCacheQuantization(**kv))
    return build(checkpoint, "hopper", Recipe(name, passes), root / name, gate=False).path


@pytest.fixture(scope="module")
def artifact(generated_checkpoint, tmp_path_factory):
    return _build(generated_checkpoint, tmp_path_factory.mktemp("kv"), "fp8-kv", format="fp8", scaling="per_tensor",
                  center=False)


def _scales(artifact):
    tensors = load_file(artifact / "model.safetensors")
    out = {k: v for k, v in tensors.items() if k.endswith(("k_scale", "v_scale"))}
    layers = json.loads((artifact / "manifest.json").read_text())["architecture"]["layers"]
    assert len(out) == 2 * len(layers)
    return out


def test_compressed_tensors_writes_kv_cache_scheme_and_the_scales(artifact, tmp_path):
    out = export(artifact, "compressed-tensors", tmp_path / "ct")
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    scheme = quant["kv_cache_scheme"]
    assert (scheme["num_bits"], scheme["type"], scheme["strategy"], scheme["dynamic"]) == (8, "float", "tensor", False)
    written = load_file(out / "model.safetensors")
    for name, value in _scales(artifact).items():  # llm-compressor's names: model.layers.i.self_attn.k_scale
        assert written[name].shape == (1,) and torch.equal(written[name].reshape(()), value.float().reshape(()))


def test_hf_modelopt_writes_fp8_kv_and_the_scales_under_k_proj_and_v_proj(artifact, tmp_path):
    out = export(artifact, "hf-modelopt", tmp_path / "mo")
    hf_quant = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert hf_quant["kv_cache_quant_algo"] == "FP8"
    assert json.loads((out / "config.json").read_text())["quantization_config"]["kv_cache_scheme"]["num_bits"] == 8
    written = load_file(out / "model.safetensors")
    for name, value in _scales(artifact).items():
        prefix, kind = name.rsplit(".", 1)
        stream = kind[0]
        exported = written[f"{prefix}.{stream}_proj.{kind}"]
        assert exported.shape == () and torch.equal(exported, value.float().reshape(()))
        assert name not in written


def test_kiln_reads_its_own_fp8_kv_exports_back(artifact, tmp_path):
    from kiln.optimizer.loader import load_checkpoint

    for fmt in ("compressed-tensors", "hf-modelopt"):
        graph = load_checkpoint(export(artifact, fmt, tmp_path / fmt))  # KV scales are dropped, and counted
        assert graph.linears["model.layers.0.self_attn.q_proj"].in_features > 0


@pytest.mark.parametrize(("kv", "match"), [
    ({"format": "fp8", "scaling": "per_tensor"}, "offset"),  # the recipe's default centers K and V
    ({"format": "fp8", "scaling": "per_head", "center": False}, "one scale per tensor"),
    ({"format": "fp8", "scaling": "per_tensor", "center": False, "keep": (0,)}, "keep a BF16 KV cache"),
])
def test_what_no_layout_can_say_is_refused_before_writing(generated_checkpoint, tmp_path, kv, match):
    art = _build(generated_checkpoint, tmp_path, "kv", **kv)
    for fmt in ("compressed-tensors", "hf-modelopt"):
        refused(export, art, fmt, tmp_path / fmt, match=match)
        assert not (tmp_path / fmt).exists()


def test_the_built_in_fp8_kv_export_recipe_is_what_the_exports_carry():
    from kiln.optimizer.recipes import resolve_recipe

    (kv,) = resolve_recipe("fp8-kv-export").passes
    assert (kv.format, kv.scaling, kv.center, kv.keep) == ("fp8", "per_tensor", False, ())
