"""`optimize export --format hf-modelopt`: the unified Hugging Face layout of NVIDIA ModelOpt.

Without ModelOpt: the export dequantizes to exactly the artifact's weights, and formats ModelOpt cannot express
are refused in one line. With ModelOpt (`-m modelopt`, the `anchors` extra): for the same tiny Llama and the same
calibration text, the tensor names, dtypes and shapes and the JSON fields (hf_quant_config.json and config.json's
quantization_config, `producer` aside) equal ModelOpt 0.47's own `export_hf_checkpoint`, and so do the weights.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from safetensors.torch import load_file

from kiln.kernels.errors import KilnError
from kiln.kernels.targets import get_target
from kiln.optimizer.build import build
from kiln.optimizer.export import export
from kiln.optimizer.export.modelopt import HF_QUANT_CONFIG, dequantize_hf_modelopt, summarize_excluded
from kiln.optimizer.recipes import Recipe
from kiln.passes.auto_precision import AutoPrecision
from kiln.passes.precision_options import default_candidates
from kiln.passes.production_precision import ProductionPrecision
from kiln.passes.weight_quant import WeightQuantization
from kiln.runtime.spec import spec_from_json
from kiln.runtime.weights import dequantize_weight
from tests.precision_helpers import SAMPLE_TEXT, tiny_with_tokenizer

HAS_MODELOPT = importlib.util.find_spec("modelopt") is not None

# recipe -> the ModelOpt config that makes the same format
RECIPES = {
    "fp8": (lambda: (WeightQuantization(format="fp8", activations="static", granularity="per_tensor"),),
            "FP8_DEFAULT_CFG"),
    "fp8-pc-pt": (lambda: (WeightQuantization(format="fp8", activations="dynamic"),), "FP8_PER_CHANNEL_PER_TOKEN_CFG"),
    "nvfp4": (lambda: (ProductionPrecision(mlp="nvfp4-w4a4", attention="nvfp4-w4a4", keep_most_sensitive=0),),
              "NVFP4_DEFAULT_CFG"),
    # production-precision, not weight-quant: it shares NVFP4's global scale across q/k/v and gate/up as
    # ModelOpt does (serving engines fuse them into one GEMM with one global scale)
    "w4a16-nvfp4": (lambda: (ProductionPrecision(mlp="nvfp4", attention="nvfp4", keep_most_sensitive=0),),
                    "W4A16_NVFP4_CFG"),
    "mxfp4": (lambda: (WeightQuantization(format="mxfp4", activations="dynamic"),), "MXFP4_DEFAULT_CFG"),
    "mixed": (lambda: (ProductionPrecision(keep_most_sensitive=0),), None),  # NVFP4 MLP + FP8 attention
}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_with_tokenizer("llama", tmp_path_factory.mktemp("export"))


def kiln_artifact(checkpoint, name: str, out):
    passes, _ = RECIPES[name]
    build(checkpoint, "blackwell", Recipe(name, passes()), out, gate=False, calib_data=SAMPLE_TEXT)
    return out


def artifact_weights(artifact) -> dict[str, torch.Tensor]:
    manifest = json.loads((artifact / "manifest.json").read_text())
    tensors = load_file(str(artifact / "model.safetensors"))
    spec = spec_from_json(manifest["architecture"])
    out = {}
    for lin in spec.linears():
        if lin.name == "lm_head" and "lm_head.weight" not in tensors:
            out[lin.name] = tensors[spec.embedding].float()
        else:
            out[lin.name] = dequantize_weight(lin.name, manifest["formats"][lin.name], tensors)
    return out


def test_export_dequantizes_to_the_artifacts_weights(llama, tmp_path, cli):
    artifact = kiln_artifact(llama, "mixed", tmp_path / "art")
    code, stdout, stderr = cli("export", artifact, "--format", "hf-modelopt", "-o", tmp_path / "hf")
    assert code == 0, stderr
    assert "MIXED_PRECISION" in stdout
    hf = tmp_path / "hf"
    assert {"model.safetensors", "config.json", HF_QUANT_CONFIG, "tokenizer.json"} <= {p.name for p in hf.iterdir()}
    quant = json.loads((hf / HF_QUANT_CONFIG).read_text())["quantization"]
    layers = quant["quantized_layers"]
    assert layers["model.layers.0.mlp.down_proj"] == {"quant_algo": "NVFP4", "group_size": 16}
    assert layers["model.layers.0.self_attn.q_proj"] == {"quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"}
    config = json.loads((hf / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "modelopt"
    exported, expected = dequantize_hf_modelopt(hf), artifact_weights(artifact)
    assert exported.keys() == expected.keys()
    for name in expected:
        assert torch.equal(exported[name], expected[name]), name
    tensors = load_file(str(hf / "model.safetensors"))
    assert tensors["model.layers.0.self_attn.q_proj.weight_scale"].shape == (64,)  # FP8 per channel: [N]
    assert tensors["model.layers.0.mlp.up_proj.input_scale"].shape == ()


def test_export_of_a_tied_real_model(tmp_path):
    from tests.conftest import STORIES

    if not (STORIES / "config.json").is_file():
        pytest.skip("../shared/models absent")
    artifact = tmp_path / "art"
    # round to nearest: the layout is under test, not the calibration (which takes a minute here)
    build(STORIES, "hopper", Recipe("rtn", (WeightQuantization(format="nvfp4", method="rtn"),)), artifact, gate=False)
    hf = export(artifact, "hf-modelopt", tmp_path / "hf")
    quant = json.loads((hf / HF_QUANT_CONFIG).read_text())["quantization"]
    assert quant["quant_algo"] == "W4A16_NVFP4"
    assert quant["exclude_modules"] == ["lm_head", "model.embed_tokens"]
    # K = 172 is padded to 176 in storage; the reader takes the true K from config.json
    weights = dequantize_hf_modelopt(hf)
    assert weights["model.layers.0.mlp.down_proj"].shape == (64, 172)
    embedding = load_file(str(STORIES / "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.equal(weights["lm_head"], embedding.float())  # tied: the embedding, unquantized
    # compressed-tensors (and vLLM's loader for it) keep whole 16-groups only: K = 172 is refused, in one line
    with pytest.raises(KilnError, match="in_features 172 is not a multiple of the NVFP4 group size 16") as err:
        export(artifact, "compressed-tensors", tmp_path / "ct")
    assert "\n" not in str(err.value) and not (tmp_path / "ct").exists()


def test_export_refuses_what_modelopt_cannot_express(llama, tmp_path):
    artifact = tmp_path / "art"
    build(llama, "hopper", "fp8-weights", artifact, gate=False)  # FP8 weight-only: no ModelOpt algorithm
    with pytest.raises(KilnError) as err:
        export(artifact, "hf-modelopt", tmp_path / "hf")
    assert "\n" not in str(err.value) and "no ModelOpt unified-checkpoint algorithm" in str(err.value)
    assert "--format compressed-tensors" in str(err.value)  # the way out the message names works
    assert not (tmp_path / "hf").exists()
    with pytest.raises(KilnError, match="unknown export format"):
        export(artifact, "gguf", tmp_path / "hf")
    ct = export(artifact, "compressed-tensors", tmp_path / "ct")
    assert json.loads((ct / "config.json").read_text())["quantization_config"]["format"] == "naive-quantized"


def test_exclude_modules_summary():
    quantized = ["model.layers.0.mlp.up_proj", "model.layers.1.self_attn.q_proj"]
    unquantized = ["lm_head", "model.embed_tokens", "model.layers.1.mlp.up_proj", "model.layers.2.mlp.up_proj",
                   "model.layers.2.self_attn.q_proj"]
    assert summarize_excluded(unquantized, quantized) == [
        "lm_head", "model.embed_tokens", "model.layers.1.mlp*", "model.layers.2*"]


# --- against ModelOpt's own export ------------------------------------------------------------------------------


def modelopt_export(checkpoint, config_name: str | None, out, token_lists):
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    if config_name is None:  # what production makes on Blackwell: NVFP4 MLPs, FP8 per-channel attention
        import copy

        cfg = copy.deepcopy(mtq.NVFP4_DEFAULT_CFG)
        fp8 = mtq.FP8_PER_CHANNEL_PER_TOKEN_CFG["quant_cfg"]
        cfg["quant_cfg"] = cfg["quant_cfg"] + [
            {"quantizer_name": "*self_attn*weight_quantizer", "cfg": fp8[1]["cfg"]},
            {"quantizer_name": "*self_attn*input_quantizer", "cfg": fp8[2]["cfg"]}]
    else:
        cfg = getattr(mtq, config_name)

    def forward(m):
        with torch.no_grad():
            for ids in token_lists:
                m(torch.tensor([ids]))

    model = mtq.quantize(model, cfg, forward)
    export_hf_checkpoint(model, export_dir=out)
    return out


def without_producer(d: dict) -> dict:
    d = json.loads(json.dumps(d))
    d.pop("producer", None)
    return d


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.modelopt
@pytest.mark.anchors
@pytest.mark.skipif(not HAS_MODELOPT, reason="nvidia-modelopt is not installed (the `anchors` extra)")
def test_export_equals_modelopts_own(llama, tmp_path, name):
    from kiln.calibration.data import load_token_lists
    from kiln.runtime.engine import load_tokenizer

    artifact = kiln_artifact(llama, name, tmp_path / "art")
    ours = export(artifact, "hf-modelopt", tmp_path / "ours")
    token_lists = load_token_lists(load_tokenizer(llama), SAMPLE_TEXT, 256)
    theirs = modelopt_export(llama, RECIPES[name][1], tmp_path / "theirs", token_lists)

    ours_q, theirs_q = (json.loads((d / HF_QUANT_CONFIG).read_text()) for d in (ours, theirs))
    assert ours_q["producer"]["name"] == "kiln" and theirs_q["producer"]["name"] == "modelopt"
    assert without_producer(ours_q) == without_producer(theirs_q)
    ours_c, theirs_c = (json.loads((d / "config.json").read_text())["quantization_config"] for d in (ours, theirs))
    assert without_producer(ours_c) == without_producer(theirs_c)

    a, b = load_file(str(ours / "model.safetensors")), load_file(str(theirs / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for key in a:
        assert (a[key].dtype, a[key].shape) == (b[key].dtype, b[key].shape), key
    # the same numbers, too: weights identical after dequantization; input scales calibrated on the same text.
    # Not MXFP4: ModelOpt picks the E8M0 exponent as ceil(log2(amax / 6)) and rounds ties down, Kiln as the OCP
    # spec and torchao do (floor(log2(amax)) - 2, ties to even; kernels/mxfp4.py), so the values differ by design.
    ours_w, theirs_w = dequantize_hf_modelopt(ours), dequantize_hf_modelopt(theirs)
    for key in ours_w if name != "mxfp4" else ():
        assert torch.equal(ours_w[key], theirs_w[key]), key
    # weight-quant calibrates sequentially (block i on the outputs of the quantized blocks before it), ModelOpt
    # on the source model, so their static input scales differ slightly; the precision passes match ModelOpt
    tolerance = 0.02 if name == "fp8" else 1e-4
    for key in (k for k in a if k.endswith("input_scale")):
        torch.testing.assert_close(a[key], b[key], rtol=tolerance, atol=0)


@pytest.mark.modelopt
@pytest.mark.anchors
@pytest.mark.skipif(not HAS_MODELOPT, reason="nvidia-modelopt is not installed (the `anchors` extra)")
def test_fp8_per_tensor_static_export_equals_modelopts_fp8(llama, tmp_path):
    """ModelOpt's FP8_DEFAULT_CFG (per-tensor weights, static per-tensor activations): no Kiln pass makes it yet,
    so the artifact is written by hand from ModelOpt's own scales; the export's layout must match."""
    from kiln.calibration.data import load_token_lists
    from kiln.kernels import fp8
    from kiln.optimizer.loader import load_checkpoint
    from kiln.optimizer.lower import write_artifact
    from kiln.passes.graph import QuantizedWeight
    from kiln.runtime.engine import load_tokenizer

    token_lists = load_token_lists(load_tokenizer(llama), SAMPLE_TEXT, 256)
    theirs = modelopt_export(llama, "FP8_DEFAULT_CFG", tmp_path / "theirs", token_lists)
    reference = load_file(str(theirs / "model.safetensors"))
    graph = load_checkpoint(llama)
    for lin in graph.iter_linears():
        if lin.role == "lm_head":
            continue
        q, scale = fp8.fp8_quantize_per_tensor(graph.weight(lin))
        lin.quant = QuantizedWeight("fp8_e4m3", {"weight": q, "weight_scale": scale,
                                                 "input_scale": reference[f"{lin.name}.input_scale"]},
                                    "fp8_static_per_tensor")
    manifest = {"source": {"checkpoint": str(llama), "model_type": "llama", "weight_files": {}},
                "target": "hopper", "recipe": {"name": "by-hand", "passes": []}, "passes": []}
    artifact = write_artifact(graph, tmp_path / "art", manifest, "by hand\n")
    ours = export(artifact, "hf-modelopt", tmp_path / "ours")
    assert without_producer(json.loads((ours / HF_QUANT_CONFIG).read_text())) == \
        without_producer(json.loads((theirs / HF_QUANT_CONFIG).read_text()))
    a = load_file(str(ours / "model.safetensors"))
    assert {k: (v.dtype, v.shape) for k, v in a.items()} == {k: (v.dtype, v.shape) for k, v in reference.items()}
    ours_w, theirs_w = dequantize_hf_modelopt(ours), dequantize_hf_modelopt(theirs)
    assert all(torch.equal(ours_w[k], theirs_w[k]) for k in ours_w)


def test_export_refuses_rotations_and_quantized_kv_caches():
    from kiln.kernels.errors import KilnError
    from kiln.optimizer.export.modelopt import kv_algo, modelopt_algo

    rotated = {"format": "mxfp4", "activation": "mxfp4", "input_rotation": 16}
    with pytest.raises(KilnError, match="rotated online"):
        modelopt_algo("model.layers.0.mlp.down_proj", rotated, {})
    fp8 = {"format": "fp8_e4m3", "scaling": "per_tensor", "streams": ["k", "v"]}
    assert kv_algo({}, 2) is None and kv_algo({"0": fp8, "1": fp8}, 2) == "FP8"
    for table, match in (({"0": fp8}, "keep a BF16 KV cache"),
                         ({"0": fp8, "1": {**fp8, "scaling": "per_head"}}, "one scale per tensor"),
                         ({"0": fp8, "1": {**fp8, "offset_tensors": {"k": "x"}}}, "offset"),
                         ({"0": fp8, "1": {**fp8, "format": "nvfp4"}}, "FP8 E4M3 KV scales only"),
                         ({"0": fp8, "1": {**fp8, "streams": ["latent", "k_rope"]}}, "MLA")):
        with pytest.raises(KilnError, match=match):
            kv_algo(table, 2)


# --- compressed-tensors ----------------------------------------------------------------------------------------
# llm-compressor's layout (optimizer/export/compressed_tensors.py). Without the library: the JSON is compressed-
# tensors' (written out literally below), the tensors carry its names, shapes and dtypes, and the export decodes to
# the artifact's weights. With it (`pip install -e '.[export-check]'`): transformers + compressed-tensors load the export and
# decompress it to the same weights, and the scheme table equals the library's own presets.


def _ct_args(bits, strategy, dynamic=False, group_size=None, **extra):
    return {"num_bits": bits, "type": "float", "symmetric": True, "group_size": group_size, "strategy": strategy,
            "dynamic": dynamic, **extra}


CT_W8_TENSOR, CT_W8_CHANNEL = _ct_args(8, "tensor"), _ct_args(8, "channel")
CT_A8_TOKEN, CT_A8_STATIC = _ct_args(8, "token", True), _ct_args(8, "tensor")
CT_W4_NV, CT_A4_NV = _ct_args(4, "tensor_group", group_size=16), _ct_args(4, "tensor_group", "local", 16)
CT_W4_MX = _ct_args(4, "group", group_size=32, scale_dtype="torch.uint8")
CT_A4_MX = _ct_args(4, "group", True, 32, scale_dtype="torch.uint8")
NAIVE, FLOAT, NVFP4_PACKED, MXFP4_PACKED = ("naive-quantized", "float-quantized", "nvfp4-pack-quantized",
                                            "mxfp4-pack-quantized")

# name -> (passes, target, {"attention" | "mlp": (weights, input_activations, format)}, global format)
CT_RECIPES = {
    "fp8-w8a16-tensor": (lambda: (WeightQuantization(format="fp8", granularity="per_tensor"),), "hopper",
                         {"attention": (CT_W8_TENSOR, None, NAIVE), "mlp": (CT_W8_TENSOR, None, NAIVE)}, NAIVE),
    "fp8-static": (lambda: (WeightQuantization(format="fp8", activations="static", granularity="per_tensor"),),
                   "hopper", {k: (CT_W8_TENSOR, CT_A8_STATIC, FLOAT) for k in ("attention", "mlp")}, FLOAT),
    "fp8-dynamic": (lambda: (WeightQuantization(format="fp8", activations="dynamic"),), "hopper",
                    {k: (CT_W8_CHANNEL, CT_A8_TOKEN, FLOAT) for k in ("attention", "mlp")}, FLOAT),
    "nvfp4-w4a16": (lambda: (ProductionPrecision(mlp="nvfp4", attention="nvfp4", keep_most_sensitive=0),), "hopper",
                    {k: (CT_W4_NV, None, NVFP4_PACKED) for k in ("attention", "mlp")}, NVFP4_PACKED),
    "nvfp4-w4a4": (lambda: (ProductionPrecision(mlp="nvfp4-w4a4", attention="nvfp4-w4a4", keep_most_sensitive=0),),
                   "blackwell", {k: (CT_W4_NV, CT_A4_NV, NVFP4_PACKED) for k in ("attention", "mlp")}, NVFP4_PACKED),
    # two schemes, one compression format: two groups with explicit targets, format mxfp4-pack-quantized
    "mxfp4": (lambda: (ProductionPrecision(mlp="mxfp4-w4a4", attention="mxfp4", keep_most_sensitive=0),),
              "blackwell", {"attention": (CT_W4_MX, None, MXFP4_PACKED), "mlp": (CT_W4_MX, CT_A4_MX, MXFP4_PACKED)},
              MXFP4_PACKED),
    # FP8 weight-only attention, NVFP4 W4A16 MLPs, the most sensitive group kept BF16 (in `ignore`)
    "mixed-w16": (lambda: (ProductionPrecision(mlp="nvfp4", attention="fp8", keep_most_sensitive=1),), "hopper",
                  {"attention": (CT_W8_CHANNEL, None, NAIVE), "mlp": (CT_W4_NV, None, NVFP4_PACKED)},
                  "mixed-precision"),
    "mixed-w4a4": (lambda: (ProductionPrecision(mlp="nvfp4-w4a4", attention="fp8-w8a8", keep_most_sensitive=0),),
                   "blackwell", {"attention": (CT_W8_CHANNEL, CT_A8_TOKEN, FLOAT),
                                 "mlp": (CT_W4_NV, CT_A4_NV, NVFP4_PACKED)}, "mixed-precision"),
    # whatever the solver picks among the exportable options (MXFP6 only Kiln's runtime runs: refused below)
    "auto": (lambda: (AutoPrecision(weight_bits=6.0, candidates=tuple(
        c for c in default_candidates(get_target("blackwell")) if c != "mxfp6")),), "blackwell", None, None),
}
ATTENTION = ("q", "k", "v", "o")


@pytest.fixture(scope="module")
def ct_exports(llama, tmp_path_factory):
    """recipe name -> (artifact, compressed-tensors export), each built on first use."""
    from kiln.optimizer.export.compressed_tensors import export_compressed_tensors

    root, built = tmp_path_factory.mktemp("ct"), {}

    def get(name: str):
        if name not in built:
            passes, target = CT_RECIPES[name][:2]
            artifact = root / f"art-{name}"
            build(llama, target, Recipe(name, passes()), artifact, gate=False, calib_data=SAMPLE_TEXT)
            built[name] = (artifact, export_compressed_tensors(artifact, root / f"ct-{name}"))
        return built[name]

    return get


@pytest.mark.parametrize("name", list(CT_RECIPES))
def test_compressed_tensors_layout_and_weights(ct_exports, name):
    from kiln.optimizer.export.compressed_tensors import (
        NVFP4_DECODE_RTOL,
        dequantize_compressed_tensors,
        scheme_of,
    )

    artifact, ct = ct_exports(name)
    _, _, expected_groups, expected_format = CT_RECIPES[name]
    formats = json.loads((artifact / "manifest.json").read_text())["formats"]
    quant = json.loads((ct / "config.json").read_text())["quantization_config"]
    assert quant["quant_method"] == "compressed-tensors" and quant["quantization_status"] == "compressed"
    assert quant["kv_cache_scheme"] is None and quant["producer"]["name"] == "kiln"
    if expected_format:
        assert quant["format"] == expected_format
    groups = quant["config_groups"]
    assert all(g["output_activations"] is None for g in groups.values())
    if len(groups) == 1:
        assert next(iter(groups.values()))["targets"] == ["Linear"]
    else:  # explicit module names, each in one group
        targets = [t for g in groups.values() for t in g["targets"]]
        assert len(targets) == len(set(targets)) and "Linear" not in targets
    dense = [m for m, e in formats.items() if e["format"] == "dense"]
    assert sorted(quant["ignore"]) == sorted(dense) and "lm_head" in quant["ignore"]

    artifact_tensors = load_file(str(artifact / "model.safetensors"))
    tensors = load_file(str(ct / "model.safetensors"))
    for module, entry in formats.items():
        group = scheme_of(module, quant)
        if entry["format"] == "dense":
            assert group is None
            continue
        if expected_groups:
            kind = "attention" if entry["role"] in ATTENTION else "mlp"
            assert (group["weights"], group["input_activations"], group["format"]) == expected_groups[kind], module
        keys = {k.removeprefix(module + ".") for k in tensors if k.startswith(module + ".")}
        n, k = artifact_tensors[f"{module}.weight"].shape[0], int(entry.get("in_features", 0))
        if entry["format"] == "fp8_e4m3":
            static = entry["activation"] == "fp8_static_per_tensor"
            assert keys == {"weight", "weight_scale"} | ({"input_scale"} if static else set()), module
            assert tensors[f"{module}.weight"].dtype == torch.float8_e4m3fn
            scale = tensors[f"{module}.weight_scale"]
            assert scale.dtype == torch.float32
            assert scale.shape == ((1,) if group["weights"]["strategy"] == "tensor" else (n, 1))
            if static:
                assert tensors[f"{module}.input_scale"].shape == (1,)
        elif entry["format"] == "nvfp4":
            w4a4 = entry["activation"] == "nvfp4"
            assert keys == {"weight_packed", "weight_scale", "weight_global_scale"} | (
                {"input_global_scale"} if w4a4 else set()), module
            assert (tensors[f"{module}.weight_packed"].dtype, tensors[f"{module}.weight_packed"].shape) == \
                (torch.uint8, (n, k // 2))
            assert torch.equal(tensors[f"{module}.weight_packed"], artifact_tensors[f"{module}.weight"])
            assert tensors[f"{module}.weight_scale"].dtype == torch.float8_e4m3fn
            assert tensors[f"{module}.weight_scale"].shape == (n, k // 16)
            # the global scales are divisors: compressed-tensors' weight_global_scale = 1 / ModelOpt's weight_scale_2
            one = torch.ones(1)
            assert torch.equal(tensors[f"{module}.weight_global_scale"],
                               one / artifact_tensors[f"{module}.weight_scale_2"].float().reshape(1))
            if w4a4:
                assert torch.equal(tensors[f"{module}.input_global_scale"],
                                   one / artifact_tensors[f"{module}.input_scale"].float().reshape(1))
        else:
            assert entry["format"] == "mxfp4" and keys == {"weight_packed", "weight_scale"}, module
            assert tensors[f"{module}.weight_scale"].dtype == torch.uint8
            assert tensors[f"{module}.weight_scale"].shape == (n, k // 32)

    exported, expected = dequantize_compressed_tensors(ct), artifact_weights(artifact)
    assert exported.keys() == expected.keys()
    for module in expected:
        if formats[module]["format"] == "nvfp4":  # 1/g rounds: see the writer's docstring
            torch.testing.assert_close(exported[module], expected[module], rtol=NVFP4_DECODE_RTOL, atol=0)
        else:
            assert torch.equal(exported[module], expected[module]), module


def test_compressed_tensors_exports_fp8_weight_only_from_the_cli(llama, tmp_path, cli):
    """The default recipe (FP8 weight-only), which hf-modelopt cannot export."""
    artifact = tmp_path / "art"
    build(llama, "hopper", "fp8-weights", artifact, gate=False)
    code, _, stderr = cli("export", artifact, "--format", "compressed-tensors", "-o", tmp_path / "ct")
    assert code == 0, stderr
    from kiln.optimizer.export import export_summary
    from kiln.optimizer.export.compressed_tensors import dequantize_compressed_tensors

    quant = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert quant["format"] == "naive-quantized" and quant["ignore"] == ["lm_head"]
    assert quant["config_groups"] == {"group_0": {"targets": ["Linear"], "weights": CT_W8_CHANNEL,
                                                  "input_activations": None, "output_activations": None,
                                                  "format": "naive-quantized"}}
    assert "tokenizer.json" in {p.name for p in (tmp_path / "ct").iterdir()}
    exported, expected = dequantize_compressed_tensors(tmp_path / "ct"), artifact_weights(artifact)
    assert all(torch.equal(exported[k], expected[k]) for k in expected)
    assert "FP8 weight-only (per-channel)" in export_summary(tmp_path / "ct", "compressed-tensors")
    code, _, stderr = cli("export", artifact, "--format", "compressed-tensors", "-o", tmp_path / "ct")
    assert code != 0 and "already exists" in stderr


@pytest.mark.parametrize("model_type, overrides", [("llama", {"tie_word_embeddings": True}), ("mixtral", {})])
def test_compressed_tensors_tied_head_and_moe_routers(tmp_path, model_type, overrides):
    """A tied lm_head is stored once (as the embedding) and ignored; MoE routers are ignored by name."""
    from kiln.optimizer.export.compressed_tensors import dequantize_compressed_tensors
    from tests.precision_helpers import add_tokenizer
    from tests.tiny_models import make_tiny_checkpoint

    checkpoint = add_tokenizer(make_tiny_checkpoint(model_type, tmp_path / model_type, overrides=overrides), 160)
    artifact = tmp_path / "art"
    build(checkpoint, "hopper", Recipe("w8a16", (WeightQuantization(format="fp8"),)), artifact, gate=False,
          calib_data=None)
    ct = export(artifact, "compressed-tensors", tmp_path / "ct")
    quant = json.loads((ct / "config.json").read_text())["quantization_config"]
    tensors = load_file(str(ct / "model.safetensors"))
    if overrides:
        assert quant["ignore"] == ["lm_head"] and "lm_head.weight" not in tensors
    else:
        routers = sorted(k.removesuffix(".weight") for k in tensors if k.endswith(".gate.weight"))
        assert routers and sorted(quant["ignore"]) == sorted(["lm_head", *routers])
    exported, expected = dequantize_compressed_tensors(ct), artifact_weights(artifact)
    assert exported.keys() == expected.keys() and all(torch.equal(exported[k], expected[k]) for k in expected)


@pytest.mark.parametrize("fmt", ["compressed-tensors", "hf-modelopt", "onnx"])
def test_mxfp6_weights_are_refused_by_every_quantized_layout(llama, tmp_path, fmt):
    if fmt == "onnx":
        pytest.importorskip("onnx")  # without it, the missing extra is what the export names first
    artifact = tmp_path / "art"
    build(llama, "hopper", Recipe("mxfp6", (WeightQuantization(format="mxfp6", method="rtn"),)), artifact, gate=False)
    with pytest.raises(KilnError) as err:
        export(artifact, fmt, tmp_path / "out")
    message = str(err.value)
    assert "\n" not in message and "stored as MXFP6" in message and "candidates" in message
    assert not (tmp_path / "out").exists()


def test_compressed_tensors_refusals(llama, tmp_path):
    from kiln.optimizer.export.compressed_tensors import ct_scheme

    def refused(entry, tensors=None, match=""):
        with pytest.raises(KilnError, match=match) as err:
            ct_scheme("model.layers.0.mlp.down_proj", entry, tensors or {})
        assert "\n" not in str(err.value) and "model.layers.0.mlp.down_proj" in str(err.value)

    refused({"format": "mxfp4", "activation": "mxfp4", "in_features": 96,
             "input_rotation": {"kind": "block_hadamard", "block_size": 16}}, match="rotated online")
    refused({"format": "nvfp4", "activation": "none", "in_features": 172}, match="not a multiple of the NVFP4 group")
    refused({"format": "mxfp4", "activation": "none", "in_features": 48}, match="not a multiple of the MXFP4 group")
    refused({"format": "nvfp4", "activation": "nvfp4", "in_features": 96}, match="without a calibrated input_scale")
    refused({"format": "nvfp4", "activation": "fp8_dynamic_per_token", "in_features": 96},
            match="no compressed-tensors scheme")
    fp8 = {"model.layers.0.mlp.down_proj.weight": torch.zeros(4, 8, dtype=torch.float8_e4m3fn),
           "model.layers.0.mlp.down_proj.weight_scale": torch.ones(4, 1)}
    refused({"format": "fp8_e4m3", "activation": "fp8_static_per_tensor"}, fp8, match="without a calibrated")
    assert ct_scheme("model.layers.0.mlp.down_proj", {"format": "fp8_e4m3", "activation": "none"}, fp8).label == \
        "FP8 weight-only (per-channel)"
    # end to end: refused before anything is written
    artifact = tmp_path / "art"
    rotated = WeightQuantization(format="mxfp4", activations="dynamic", rotation_block=16)
    build(llama, "blackwell", Recipe("rot", (rotated,)), artifact, gate=False, calib_data=None)
    with pytest.raises(KilnError, match="rotated online") as err:
        export(artifact, "compressed-tensors", tmp_path / "ct")
    assert "\n" not in str(err.value) and not (tmp_path / "ct").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ct")]


# --- against compressed-tensors itself (the `export-check` extra) ----------------------------------------------


def test_compressed_tensors_schemes_equal_the_librarys_presets():
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    from kiln.optimizer.export.compressed_tensors import SCHEMES, Scheme

    presets = 0
    for (kind, act), (label, fmt) in SCHEMES.items():
        ours = Scheme(label, fmt, kind, act).group(["Linear"])
        theirs = QuantizationScheme.model_validate(ours)  # the library accepts it ...
        assert infer_module_format(torch.nn.Linear, theirs).value == fmt, label  # ... and infers our format
        if label in PRESET_SCHEMES:
            preset = QuantizationScheme(targets=["Linear"], format=fmt, **PRESET_SCHEMES[label]).model_dump(mode="json")
            for args in (preset["weights"], preset["input_activations"]):
                if args:
                    args.pop("observer", None)  # a calibration setting, not the format
                    if fmt == "nvfp4-pack-quantized":
                        args.pop("scale_dtype")  # left out for compressed-tensors < 0.13 (E4M3 is the default)
            assert ours == preset, label
            presets += 1
    assert presets == 6, ct.__version__


@pytest.mark.parametrize("name", list(CT_RECIPES))
@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")  # run_compressed=False is the point
def test_compressed_tensors_library_decompresses_to_the_artifact(ct_exports, name):
    """transformers + compressed-tensors load the export (run_compressed=False: its own decompressors) and get the
    artifact's weights: exactly for FP8, MXFP4 and BF16; for NVFP4 exactly what our reader decodes (the library
    decompresses NVFP4 to bfloat16, so also its fp32 `dequantize` on the same tensors)."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    from kiln.optimizer.export.compressed_tensors import dequantize_compressed_tensors, scheme_of

    artifact, ct = ct_exports(name)
    model, info = AutoModelForCausalLM.from_pretrained(
        ct, quantization_config=CompressedTensorsConfig(run_compressed=False), output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    state = model.state_dict()
    formats = json.loads((artifact / "manifest.json").read_text())["formats"]
    quant = json.loads((ct / "config.json").read_text())["quantization_config"]
    ours, expected = dequantize_compressed_tensors(ct), artifact_weights(artifact)
    tensors = load_file(str(ct / "model.safetensors"))
    for module in expected:
        theirs = state[f"{module}.weight"]
        if formats[module]["format"] != "nvfp4":
            assert torch.equal(theirs.float(), expected[module]), module
            continue
        assert torch.equal(theirs, ours[module].to(theirs.dtype)), module
        args = QuantizationScheme.model_validate(scheme_of(module, quant)).weights
        packed = tensors[f"{module}.weight_packed"]
        fp32 = dequantize(x_q=unpack_fp4_from_uint8(packed, packed.shape[0], 2 * packed.shape[1], dtype=torch.float32),
                          scale=tensors[f"{module}.weight_scale"].float(), args=args,
                          global_scale=tensors[f"{module}.weight_global_scale"], dtype=torch.float32)
        assert torch.equal(fp32, ours[module]), module
