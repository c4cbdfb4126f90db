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

from kernels.errors import KilnError
from optimizer.build import build
from optimizer.export import HF_QUANT_CONFIG, dequantize_hf_modelopt, export, summarize_excluded
from optimizer.recipes import Recipe
from passes.mixed_precision import WeightQuantization
from passes.mixed_precision_auto import ProductionPrecision
from runtime.spec import build_spec
from runtime.weights import dequantize_weight
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
    spec = build_spec(json.loads((artifact / "config.json").read_text()))
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
    build(STORIES, "hopper", "nvfp4-w4a16", artifact, gate=False)
    hf = export(artifact, "hf-modelopt", tmp_path / "hf")
    quant = json.loads((hf / HF_QUANT_CONFIG).read_text())["quantization"]
    assert quant["quant_algo"] == "W4A16_NVFP4"
    assert quant["exclude_modules"] == ["lm_head", "model.embed_tokens"]
    # K = 172 is padded to 176 in storage; the reader takes the true K from config.json
    weights = dequantize_hf_modelopt(hf)
    assert weights["model.layers.0.mlp.down_proj"].shape == (64, 172)
    assert torch.equal(weights["lm_head"], weights["lm_head"])  # tied: the embedding, unquantized


def test_export_refuses_what_modelopt_cannot_express(llama, tmp_path):
    artifact = tmp_path / "art"
    build(llama, "hopper", "fp8-weights", artifact, gate=False)  # FP8 weight-only: no ModelOpt algorithm
    with pytest.raises(KilnError) as err:
        export(artifact, "hf-modelopt", tmp_path / "hf")
    assert "\n" not in str(err.value) and "no ModelOpt unified-checkpoint algorithm" in str(err.value)
    assert not (tmp_path / "hf").exists()
    with pytest.raises(KilnError, match="unknown export format"):
        export(artifact, "gguf", tmp_path / "hf")


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
    from calibration.data import load_token_lists
    from runtime.engine import load_tokenizer

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
    from calibration.data import load_token_lists
    from kernels import fp8
    from optimizer.loader import load_checkpoint
    from optimizer.lower import write_artifact
    from passes.graph import QuantizedWeight
    from runtime.engine import load_tokenizer

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
    from kernels.errors import KilnError
    from optimizer.export import _kv_algo, modelopt_algo

    rotated = {"format": "mxfp4", "activation": "mxfp4", "input_rotation": 16}
    with pytest.raises(KilnError, match="rotated online"):
        modelopt_algo("model.layers.0.mlp.down_proj", rotated, {})
    with pytest.raises(KilnError, match="not exported yet"):
        _kv_algo({"0": {"format": "fp8_e4m3", "scaling": "per_tensor"}})
    assert _kv_algo({}) is None
