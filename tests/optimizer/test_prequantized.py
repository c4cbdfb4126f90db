"""Pre-quantized checkpoints (optimizer/prequantized.py): read with their true weights, or refused in one line.

The tiny FP8-block-scaled DeepSeek-V3 (examples/tiny_moe.py) loads with weights equal, bit for bit, to a block
loop written here; built with --recipe none it gives the logits of a plain float32 checkpoint holding those
weights. Kiln's own exports (hf-modelopt, compressed-tensors) load back as checkpoints whose weights are the
artifact's. Everything else is a one-line KilnError, exit 2 from the CLI.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from examples.tiny_moe import write_fp8_block_deepseek
from kiln.kernels import fp8
from kiln.kernels.errors import KilnError
from kiln.optimizer.loader import load_checkpoint
from kiln.optimizer.prequantized import dequantize_checkpoint
from tests.precision_helpers import SAMPLE_TEXT, tiny_with_tokenizer

torch.set_num_threads(1)


def block_reference(q: torch.Tensor, scale_inv: torch.Tensor, bm: int, bn: int) -> torch.Tensor:
    """DeepSeek-V3's dequantization, block by block: each [bm, bn] block of the FP8 codes (the last ones
    partial) times its weight_scale_inv, in float32."""
    out = torch.empty(q.shape, dtype=torch.float32)
    rows, cols = q.shape
    for i in range(0, rows, bm):
        for j in range(0, cols, bn):
            out[i:i + bm, j:j + bn] = q[i:i + bm, j:j + bn].to(torch.float32) * scale_inv[i // bm, j // bn].item()
    return out


def reference_weights(path: Path, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Every tensor of an FP8 block checkpoint as a plain checkpoint holds it: quantized linears dequantized by
    `block_reference`, scales gone, everything else as stored."""
    stored = load_file(str(path / "model.safetensors"))
    out = {}
    for name, t in stored.items():
        if name.endswith(".weight_scale_inv"):
            continue
        scale = stored.get(name.removesuffix(".weight") + ".weight_scale_inv")
        out[name] = t if scale is None else block_reference(t, scale, *block)
    return out


def edit_config(path: Path, **changes) -> Path:
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))
    return path


def edit_tensors(path: Path, edit) -> Path:
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def refused(path: Path) -> str:
    with pytest.raises(KilnError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.fixture(scope="module")
def dsv3_fp8(tmp_path_factory) -> Path:
    """The tiny DeepSeek-V3 in DeepSeek's FP8 layout, 16x16 blocks, with a tokenizer."""
    root = tmp_path_factory.mktemp("dsv3fp8")
    plain = tiny_with_tokenizer("deepseek_v3", root)  # for its tokenizer (vocabulary sized to it)
    vocab = json.loads((plain / "config.json").read_text())["vocab_size"]
    path = write_fp8_block_deepseek(root / "fp8", overrides={"vocab_size": vocab})
    for f in plain.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, path / f.name)
    return path


# --- FP8 block scales (DeepSeek-V3) ------------------------------------------------------------------------------


@pytest.mark.parametrize("block", [(16, 16), (24, 40), (128, 128)])  # several full blocks; partial ones; one each
def test_fp8_block_deepseek_loads_its_dequantized_weights(tmp_path, block):
    path = write_fp8_block_deepseek(tmp_path / "ckpt", block)
    stored = load_file(str(path / "model.safetensors"))
    scaled = sorted(n for n in stored if n.endswith(".weight_scale_inv"))
    assert len(scaled) == 48 and not any(".mlp.gate." in n for n in scaled)  # routers stay bfloat16
    expected = reference_weights(path, block)
    messages = []
    graph = load_checkpoint(path, log=messages.append)
    assert set(graph.tensors) == set(expected)  # the scales are gone, nothing else is
    for name, want in expected.items():
        got = graph.tensors[name]
        assert got.dtype == want.dtype and torch.equal(got, want), name
    kv_a = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"  # 24 rows: a partial row block under 16 or 128
    assert graph.tensors[kv_a].dtype == torch.float32 and graph.tensors[kv_a].shape == (24, 64)
    assert graph.metadata["loader"] == {"unused_tensors": [], "prequantized": {
        "quant_method": "fp8", "weight_block_size": list(block), "activation_scheme": "dynamic", "dequantized": 48,
        "dtype": "float32", "schemes": {f"fp8 {block[0]}x{block[1]} blocks": 48}, "dropped_scales": 0}}
    assert messages == [(f"pre-quantized checkpoint (fp8): dequantizing 48 linear weight(s) to float32 "
                         f"(48 fp8 {block[0]}x{block[1]} blocks)")]
    config = graph.hf_config if hasattr(graph, "hf_config") else graph.config
    assert "quantization_config" not in config


def test_fp8_block_weights_are_close_to_the_weights_they_were_quantized_from(tmp_path):
    from tests.tiny_models import make_tiny_checkpoint

    original = load_file(str(make_tiny_checkpoint("deepseek_v3", tmp_path / "bf") / "model.safetensors"))
    graph = load_checkpoint(write_fp8_block_deepseek(tmp_path / "fp8", (24, 40)))
    for name in ("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "model.layers.1.mlp.experts.3.down_proj.weight"):
        w, got = original[name], graph.tensors[name]
        assert not torch.equal(got, w) and (got - w).abs().max() <= w.abs().max() / 16  # FP8, not the original


def test_fp8_block_deepseek_builds_to_the_logits_of_its_dequantized_reference(dsv3_fp8, tmp_path, cli):
    from kiln.runtime.engine import load

    reference = tmp_path / "reference"  # the same model as a plain float32 checkpoint
    shutil.copytree(dsv3_fp8, reference)
    save_file(reference_weights(dsv3_fp8, (16, 16)), str(reference / "model.safetensors"), metadata={"format": "pt"})
    edit_config(reference, quantization_config=None)
    logits, outputs = [], []
    for source, out in ((dsv3_fp8, tmp_path / "art-fp8"), (reference, tmp_path / "art-ref")):
        code, stdout, stderr = cli("build", source, "--recipe", "none", "--no-gate", "-o", out)
        assert code == 0, stderr
        assert "quantization_config" not in json.loads((out / "config.json").read_text())
        logits.append(load(out).logits([[1, 5, 9, 2, 7, 3, 11, 4], [8, 6]]))
        outputs.append(stdout + stderr)
    assert "pre-quantized checkpoint (fp8): dequantizing 48 linear weight(s)" in outputs[0]
    assert "pre-quantized" not in outputs[1]
    for a, b in zip(*logits, strict=True):
        assert a.shape == b.shape and float((a - b).abs().max()) <= 1e-5


def test_dequantize_checkpoint_in_memory(dsv3_fp8):
    config = json.loads((dsv3_fp8 / "config.json").read_text())
    tensors = load_file(str(dsv3_fp8 / "model.safetensors"))
    new_config, out, provenance = dequantize_checkpoint(config, tensors)
    assert "quantization_config" not in new_config and "quantization_config" in config
    assert provenance["dequantized"] == 48 and provenance["weight_block_size"] == [16, 16]
    expected = reference_weights(dsv3_fp8, (16, 16))
    assert set(out) == set(expected) and all(torch.equal(out[k], v) for k, v in expected.items())
    plain = {"model.embed_tokens.weight": torch.zeros(4, 2)}
    assert dequantize_checkpoint({"model_type": "llama"}, plain) == ({"model_type": "llama"}, plain, {})


# --- per-tensor FP8 with static activation scales (a Llama) -------------------------------------------------------


def test_per_tensor_fp8_llama_and_its_static_activation_scales(tiny_checkpoints, tmp_path):
    path = tmp_path / "llama"
    shutil.copytree(tiny_checkpoints["llama"], path)
    expected = {}

    def quantize(t):
        for name in [n for n in t if n.endswith("_proj.weight")]:
            module = name.removesuffix(".weight")
            q, scale = fp8.fp8_quantize_per_tensor(t[name])
            t[name], t[f"{module}.weight_scale_inv"] = q, scale  # a 0-dim scale, as transformers' FP8Linear
            t[f"{module}.activation_scale"] = torch.tensor(0.5)
            expected[name] = q.float() * scale

    edit_tensors(path, quantize)
    edit_config(path, quantization_config={"quant_method": "fp8", "activation_scheme": "static",
                                           "weight_block_size": None})
    graph = load_checkpoint(path)
    assert len(expected) == 14 and all(torch.equal(graph.tensors[k], v) for k, v in expected.items())
    assert not any(k.endswith(("_scale", "_scale_inv")) for k in graph.tensors)
    assert graph.metadata["loader"]["prequantized"]["dropped_scales"] == 14
    assert graph.metadata["loader"]["prequantized"]["schemes"] == {"fp8 per tensor": 14}


@pytest.mark.parametrize("key", ["modules_to_not_convert", "ignored_layers"])  # MiniMax's name for it
def test_modules_to_not_convert_are_read_as_stored(tmp_path, key):
    path = write_fp8_block_deepseek(tmp_path / "ckpt")
    o_proj = "model.layers.2.self_attn.o_proj"
    edit_tensors(path, lambda t: t.update({f"{o_proj}.weight": torch.ones(64, 64, dtype=torch.bfloat16)})
                 or t.pop(f"{o_proj}.weight_scale_inv"))
    quant = json.loads((path / "config.json").read_text())["quantization_config"]
    edit_config(path, quantization_config={**quant, key: ["layers.2.self_attn.o_proj"]})
    graph = load_checkpoint(path)
    assert torch.equal(graph.tensors[f"{o_proj}.weight"], torch.ones(64, 64, dtype=torch.bfloat16))
    assert graph.metadata["loader"]["prequantized"]["dequantized"] == 47
    edit_config(path, quantization_config={**quant, key: ["self_attn.q_b_proj"]})
    assert "modules_to_not_convert excludes model.layers.0.self_attn.q_b_proj" in refused(path)


# --- Kiln's own exports, read back ---------------------------------------------------------------------------------


def _recipes():
    from kiln.passes.production_precision import ProductionPrecision
    from kiln.passes.weight_quant import WeightQuantization

    return {  # recipe -> (passes, the formats the artifact must hold)
        "mixed": ((ProductionPrecision(keep_most_sensitive=0),), {"nvfp4", "fp8_e4m3"}),  # ModelOpt MIXED_PRECISION
        "fp8-static": ((WeightQuantization(format="fp8", activations="static", granularity="per_tensor"),),
                       {"fp8_e4m3"}),  # ModelOpt FP8 (one algorithm, exclude_modules)
        "mxfp4": ((WeightQuantization(format="mxfp4", activations="dynamic"),), {"mxfp4"}),
    }


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """recipe -> (artifact, hf-modelopt export, compressed-tensors export) of a tiny Llama, built once each."""
    from kiln.optimizer.build import build
    from kiln.optimizer.export import export
    from kiln.optimizer.recipes import Recipe

    root = tmp_path_factory.mktemp("exports")
    llama = tiny_with_tokenizer("llama", root)
    made = {}

    def get(name: str):
        if name not in made:
            artifact = root / f"art-{name}"
            build(llama, "blackwell", Recipe(name, _recipes()[name][0]), artifact, gate=False, calib_data=SAMPLE_TEXT)
            made[name] = (artifact, export(artifact, "hf-modelopt", root / f"modelopt-{name}"),
                          export(artifact, "compressed-tensors", root / f"ct-{name}"))
        return made[name]

    return get


def artifact_weights(artifact: Path) -> dict[str, torch.Tensor]:
    from kiln.runtime.weights import dequantize_weight

    manifest = json.loads((artifact / "manifest.json").read_text())
    tensors = load_file(str(artifact / "model.safetensors"))
    return {f"{m}.weight": dequantize_weight(m, entry, tensors) for m, entry in manifest["formats"].items()
            if entry.get("format") != "dense"}


@pytest.mark.parametrize("recipe", ["mixed", "fp8-static", "mxfp4"])
@pytest.mark.parametrize("fmt", ["hf-modelopt", "compressed-tensors"])
def test_kiln_exports_load_back_with_the_artifacts_weights(exports, recipe, fmt, tmp_path, cli):
    from kiln.optimizer.export.compressed_tensors import NVFP4_DECODE_RTOL, dequantize_compressed_tensors

    artifact, modelopt, ct = exports(recipe)
    path = modelopt if fmt == "hf-modelopt" else ct
    manifest = json.loads((artifact / "manifest.json").read_text())
    expected = artifact_weights(artifact)
    messages = []
    graph = load_checkpoint(path, log=messages.append)
    decoded = dequantize_compressed_tensors(ct)  # compressed-tensors' own arithmetic
    formats = {entry["format"] for entry in manifest["formats"].values()}
    assert formats - {"dense"} == _recipes()[recipe][1] and len(expected) == 14
    assert not any(k.endswith(("_scale", "_scale_2", "_packed", "global_scale")) for k in graph.tensors)
    provenance = graph.metadata["loader"]["prequantized"]
    assert provenance["dequantized"] == len(expected) and messages[0].startswith("pre-quantized checkpoint")
    for name, want in expected.items():
        got = graph.tensors[name]
        assert got.dtype == torch.float32 and got.shape == want.shape, name
        if fmt == "compressed-tensors" and manifest["formats"][name.removesuffix(".weight")]["format"] == "nvfp4":
            # compressed-tensors stores NVFP4's global scale as its reciprocal (optimizer/export/compressed_tensors.py)
            assert torch.equal(got, decoded[name.removesuffix(".weight")])
            assert bool(((got - want).abs() <= NVFP4_DECODE_RTOL * want.abs()).all()), name
        else:
            assert torch.equal(got, want), name
    if fmt == "hf-modelopt":
        algo = {"mixed": "MIXED_PRECISION", "fp8-static": "FP8", "mxfp4": "mxfp4"}[recipe]
        assert provenance["quant_algo"] == algo and provenance["config"] == "hf_quant_config.json"
    assert provenance["dropped_scales"] == {"mixed": 6, "fp8-static": 14, "mxfp4": 0}[recipe]  # input scales
    code, _, stderr = cli("build", path, "--recipe", "none", "--no-gate", "-o", tmp_path / "rebuilt")
    assert code == 0, stderr


def test_modelopt_without_hf_quant_config_reads_config_json(exports, tmp_path):
    _, modelopt, _ = exports("mixed")
    path = shutil.copytree(modelopt, tmp_path / "m")
    (path / "hf_quant_config.json").unlink()
    graph = load_checkpoint(path)  # config.json's quantization_config carries quantized_layers too
    assert graph.metadata["loader"]["prequantized"]["config"] == "config.json"
    original = load_checkpoint(modelopt)
    assert all(torch.equal(graph.tensors[k], original.tensors[k]) for k in original.tensors)


def test_compressed_tensors_fp8_blocks(tiny_checkpoints, tmp_path):
    """llm-compressor's FP8_BLOCK: weight_scale per [128, 128] block (partial here), multiplying like DeepSeek's."""
    path = shutil.copytree(tiny_checkpoints["llama"], tmp_path / "llama")
    expected = {}

    def quantize(t):
        for name in [n for n in t if n.endswith("_proj.weight")]:
            q, scale = fp8.fp8_quantize_blocks(t[name], (128, 128))
            t[name], t[name.removesuffix(".weight") + ".weight_scale"] = q, scale.to(torch.bfloat16)
            expected[name] = block_reference(q, scale.to(torch.bfloat16), 128, 128)

    edit_tensors(path, quantize)
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block", "block_structure": [128, 128],
               "dynamic": False, "group_size": None}
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group", "group_size": 128, "dynamic": True}
    edit_config(path, quantization_config={
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
        "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {}})
    graph = load_checkpoint(path)
    assert len(expected) == 14 and all(torch.equal(graph.tensors[k], v) for k, v in expected.items())
    assert graph.metadata["loader"]["prequantized"]["schemes"] == {"compressed-tensors fp8 128x128 blocks": 14}


# --- refusals ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("quant, message", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128},
     "(quantization_config quant_method gptq) are not supported"),
    ({"quant_method": "awq", "bits": 4}, "quant_method awq) are not supported; Kiln reads fp8"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method bitsandbytes) are not supported"),
    ({"quant_method": "mystery"}, "quant_method mystery) are not supported"),
    ({"bits": 4}, "quant_method unknown) are not supported"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "quant_method fp8) with fmt 'e5m2' (only e4m3 is read) are not supported"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size must be two positive integers"),
    ({"quant_method": "modelopt", "quant_algo": "INT4_AWQ"}, "quant_method modelopt) with quant_algo INT4_AWQ"),
    ({"quant_method": "compressed-tensors", "quantization_status": "compressed", "format": "pack-quantized",
      "config_groups": {"g": {"targets": ["Linear"], "format": "pack-quantized",
                              "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}},
     "with 4-bit int group weights in format pack-quantized (integer weights are not read)"),
    ({"quant_method": "compressed-tensors", "quantization_status": "compressed", "transform_config": {"x": {}}},
     "with a transform_config (online rotations"),
    ({"quant_method": "compressed-tensors", "quantization_status": "frozen"}, "quantization_status frozen"),
])
def test_unreadable_quantization_configs_are_one_line(tiny_checkpoints, tmp_path, quant, message):
    path = edit_config(shutil.copytree(tiny_checkpoints["llama"], tmp_path / "ckpt"), quantization_config=quant)
    assert message in refused(path)


def _drop(name):
    return lambda t: t.pop(name)


O_PROJ = "model.layers.0.self_attn.o_proj"


@pytest.mark.parametrize("tensor_edit, config_edit, message", [
    (_drop(f"{O_PROJ}.weight_scale_inv"), {},
     (f"pre-quantized checkpoint (fp8): {O_PROJ}.weight is F8_E4M3 but has no weight_scale_inv beside it: its "
      "scale is missing")),
    (lambda t: t.update({f"{O_PROJ}.weight_scale_inv": torch.ones(4, 3)}), {},
     f"{O_PROJ}.weight_scale_inv has shape (4, 3); a 64x64 weight in 16x16 blocks needs (4, 4)"),
    (lambda t: t.update({f"{O_PROJ}.weight": t[f"{O_PROJ}.weight"].float()}), {},
     f"{O_PROJ}.weight has dtype F32; this layout stores it as F8_E4M3"),
    (lambda t: t.update({f"{O_PROJ}.pre_quant_scale": torch.ones(64)}), {}, "AWQ/SmoothQuant pre_quant_scale"),
    (lambda t: t.update({f"{O_PROJ}.weight_scale_inv": torch.full((4, 4), float("inf"))}), {},
     f"tensor {O_PROJ}.weight_scale_inv contains Inf values"),
    (lambda t: t.update({f"{O_PROJ}.weight_scale_inv": torch.full((4, 4), 1e13)}), {},
     f"tensor {O_PROJ}.weight, dequantized from fp8 16x16 blocks, holds a value of magnitude"),
    (None, {"quantization_config": None},
     "is a quantization scale or packed weight, but config.json has no quantization_config"),
    (None, {"quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32]}},
     "model.layers.0.mlp.down_proj.weight_scale_inv has shape (4, 6); a 64x96 weight in 32x32 blocks needs (2, 3)"),
])
def test_broken_fp8_checkpoints_are_one_line(tmp_path, tensor_edit, config_edit, message):
    path = write_fp8_block_deepseek(tmp_path / "ckpt")
    if tensor_edit:
        edit_tensors(path, tensor_edit)
    if config_edit:
        edit_config(path, **config_edit)
    assert message in refused(path)


def test_an_fp8_config_on_an_unquantized_checkpoint_is_one_line(tiny_checkpoints, tmp_path):
    path = edit_config(shutil.copytree(tiny_checkpoints["llama"], tmp_path / "ckpt"),
                       quantization_config={"quant_method": "fp8"})
    assert refused(path) == ("pre-quantized checkpoint (fp8): quantization_config says quant_method fp8 but no "
                             "tensor has a weight_scale_inv (the FP8 block scales DeepSeek-V3 and transformers store)")


def test_refusals_exit_2_with_one_line_from_the_cli(dsv3_fp8, tiny_checkpoints, tmp_path, cli):
    missing = shutil.copytree(dsv3_fp8, tmp_path / "missing")
    edit_tensors(missing, _drop(f"{O_PROJ}.weight_scale_inv"))
    gptq = edit_config(shutil.copytree(tiny_checkpoints["llama"], tmp_path / "gptq"),
                       quantization_config={"quant_method": "gptq", "bits": 4})
    for path, message in ((missing, "has no weight_scale_inv beside it"), (gptq, "quant_method gptq")):
        code, _, stderr = cli("build", path, "--recipe", "none", "--no-gate", "-o", tmp_path / f"out-{path.name}")
        assert code == 2 and stderr.startswith("error: ") and message in stderr
        assert stderr.count("\n") == 1 and "Traceback" not in stderr
        assert not (tmp_path / f"out-{path.name}").exists()
