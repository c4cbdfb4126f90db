"""`optimize export --format onnx`: the artifact as an ONNX graph with a KV cache, weights behind DequantizeLinear.

The graph is run here independently of the exporter's own check: onnxruntime (CPU) for FP8 and dense weights,
onnx.reference for FP4 (onnxruntime has no FP4 DequantizeLinear); a prefill from an empty past, then decode steps
feeding the presents back, every position against Kiln's runtime. The artifacts are stories260K built with RTN
versions of the built-in recipes (same format table as fp8-weights, fp8, nvfp4-w4a16, mxfp4-w4a16; GPTQ would only
change which values are stored, and takes minutes).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kiln.optimizer.build import build
from kiln.optimizer.recipes import Recipe
from kiln.passes.kv_cache import KvCacheQuantization
from kiln.passes.weight_quant import WeightQuantization
from tests.conftest import STORIES, needs_stories, refused
from tests.precision_helpers import SAMPLE_TEXT

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from kiln.optimizer.export import export, onnx_lowering, onnx_qdq  # after the skips: they import onnx
from kiln.optimizer.export.onnx import export_onnx

pytestmark = needs_stories

RECIPES = {
    "fp8-weights": lambda: [WeightQuantization(format="fp8")],  # W8A16, per-channel scales
    "fp8": lambda: [WeightQuantization(format="fp8", activations="dynamic")],  # W8A8, dynamic per-token
    "fp8-static-kv": lambda: [WeightQuantization(format="fp8", activations="static", granularity="per_tensor"),
                              KvCacheQuantization(format="fp8", scaling="per_tensor")],
    "nvfp4-w4a16": lambda: [WeightQuantization(format="nvfp4")],
    "mxfp4-w4a16": lambda: [WeightQuantization(format="mxfp4")],
    "fp8-kv-per-head": lambda: [KvCacheQuantization(format="fp8", scaling="per_head")],
    "fp8-kv-dynamic": lambda: [KvCacheQuantization(format="fp8", scaling="dynamic")],
    # online block Hadamard (down_proj's K = 172 = 10 x 16 + 8 + 4: whole blocks and the tail's pieces)
    "nvfp4-rotated": lambda: [WeightQuantization(format="nvfp4", rotation_block=16)],
    "nvfp4-w4a4": lambda: [WeightQuantization(format="nvfp4", activations="dynamic")],
}


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    """name -> a stories260K artifact of RECIPES[name], built once per module on first use."""
    root, built = tmp_path_factory.mktemp("onnx-artifacts"), {}

    def get(name: str):
        if name not in built:
            built[name] = build(STORIES, "blackwell", Recipe(name, RECIPES[name]()), root / name, gate=False,
                                calib_data=SAMPLE_TEXT).path
        return built[name]

    return get


def _decode(run, spec, rows: np.ndarray, prefill: int) -> tuple[np.ndarray, dict]:
    """Prefill `prefill` tokens from an empty past, then one token at a time with the presents fed back."""
    batch = rows.shape[0]
    past = {}
    for layer in spec.layers:
        a = layer.attention
        for kind in ("key", "value"):
            past[f"past_key_values.{layer.index}.{kind}"] = np.zeros((batch, a.num_kv_heads, 0, a.head_dim), np.float32)
    logits, start = [], 0
    for end in [prefill, *range(prefill + 1, rows.shape[1] + 1)]:
        positions = np.broadcast_to(np.arange(start, end), (batch, end - start)).astype(np.int64)
        out = run({"input_ids": rows[:, start:end], "position_ids": positions, **past})
        logits.append(out["logits"])
        past = {k.replace("present.", "past_key_values.", 1): v for k, v in out.items() if k.startswith("present.")}
        start = end
    return np.concatenate(logits, axis=1), past


def _kiln_logits(art, rows: np.ndarray) -> np.ndarray:
    from kiln import runtime

    return torch.stack(runtime.load(art).logits(rows.tolist())).numpy()


def _rows(vocab: int, batch: int = 2, length: int = 10, seed: int = 1) -> np.ndarray:
    rows = torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))
    rows[:, 0] = 1  # BOS
    return rows.numpy().astype(np.int64)


def _ort(path):
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return lambda feeds: dict(zip(names, session.run(names, feeds)))


def _reference(path):
    from onnx.reference import ReferenceEvaluator

    evaluator = ReferenceEvaluator(str(path))
    names = list(evaluator.output_names)
    return lambda feeds: dict(zip(names, evaluator.run(names, feeds)))


def _spec(art):
    from kiln.runtime.artifact import read_manifest
    from kiln.runtime.spec import spec_from_json

    return spec_from_json(read_manifest(art)["architecture"])


@pytest.mark.parametrize("name", ["fp8-weights", "nvfp4-w4a16", "mxfp4-w4a16", "nvfp4-rotated"])
def test_weight_only_graph_decodes_the_runtimes_logits(name, artifact, tmp_path, cli):
    art = artifact(name)
    code, stdout, stderr = cli("export", art, "--format", "onnx", "-o", tmp_path / "onnx")
    assert code == 0, stderr
    out = tmp_path / "onnx"
    assert {p.name for p in out.iterdir()} == {"model.onnx", "onnx_check.json", "kiln_export.json"}
    model = onnx.load(str(out / "model.onnx"))
    assert model.opset_import[0].version == 23
    assert [i.name for i in model.graph.input][:2] == ["input_ids", "position_ids"]
    assert "past_key_values.4.value" in {i.name for i in model.graph.input}
    assert [o.name for o in model.graph.output][:3] == ["logits", "present.0.key", "present.0.value"]
    stored = {t.data_type for t in model.graph.initializer}
    fp4 = name != "fp8-weights"
    assert (onnx.TensorProto.FLOAT4E2M1 if fp4 else onnx.TensorProto.FLOAT8E4M3FN) in stored
    dequantize = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    # one per quantized linear (NVFP4: a second for its two-level block scales); the lm_head is the tied embedding
    assert len(dequantize) == 5 * 7 * (2 if name.startswith("nvfp4") else 1)

    rows = _rows(512)
    got, past = _decode(_reference(out / "model.onnx") if fp4 else _ort(out / "model.onnx"), _spec(art), rows, 6)
    diff = np.abs(got - _kiln_logits(art, rows)).max(axis=-1)  # [B, L]: 6 prefill positions, then 4 decode steps
    print(f"{name}: max |logit diff| prefill {diff[:, :6].max():.2e}, decode {diff[:, 6:].max():.2e}")
    assert diff.max() <= 1e-3
    assert past["past_key_values.0.key"].shape == (2, 4, 10, 8)
    check = json.loads((out / "onnx_check.json").read_text())
    assert check["max_abs_logit_diff"] <= 1e-3 and check["runner"].startswith("onnx.reference" if fp4 else "onnxruntime")
    assert "logits match the runtime's within" in stdout


# per layer: W8A8 dynamic quantizes the inputs of q/k/v (one), o, gate/up (one) and down; static ones each of the
# 7 linears' inputs (their own scales) and K and V (with calibrated offsets); the KV-only recipes K and V
QUANTIZERS = {"fp8": 5 * 4, "fp8-static-kv": 5 * (7 + 2), "fp8-kv-per-head": 5 * 2, "fp8-kv-dynamic": 5 * 2}


@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_fp8_activation_and_kv_quantizers_are_kilns_bit_for_bit(name, artifact, tmp_path):
    """W8A8 (and an FP8 KV cache): each quantizer is Kiln's to the bit; whole-graph logits agree except where an
    activation lies within fp32 rounding of an FP8 midpoint (measured on stories260K: 15 of 16 positions within
    1e-3, one at 1.9e-3; on SmolLM2-135M no position, as Kiln's own logits move by up to 2.9 under 1-ulp noise)."""
    art = artifact(name)
    out = export(art, "onnx", tmp_path / "onnx")
    model = onnx.load(str(out / "model.onnx"))
    to_fp8 = [n for n in model.graph.node if n.op_type == "QuantizeLinear"
              or (n.op_type == "Cast" and n.attribute[0].i == onnx.TensorProto.FLOAT8E4M3FN)]
    assert len(to_fp8) == QUANTIZERS[name]
    check = json.loads((out / "onnx_check.json").read_text())
    assert check["quantizers_bit_exact"] == QUANTIZERS[name]
    assert check["without_quantizers_max_abs_logit_diff"] <= 1e-3

    rows = _rows(512)
    got, _ = _decode(_ort(out / "model.onnx"), _spec(art), rows, 6)
    diff = np.abs(got - _kiln_logits(art, rows)).max(axis=-1)
    print(f"{name}: max |logit diff| {diff.max():.2e}, {(diff <= 1e-3).sum()} of {diff.size} positions within 1e-3")
    assert np.median(diff) <= 1e-3
    assert (got.argmax(-1) == _kiln_logits(art, rows).argmax(-1)).mean() >= 0.9


def test_external_data_and_overwrite(artifact, tmp_path, cli):
    art = artifact("fp8-weights")
    out = export_onnx(art, tmp_path / "onnx", external_data=True)
    assert (out / "model.onnx.data").stat().st_size > (out / "model.onnx").stat().st_size
    rows = _rows(512, batch=1, length=4)
    got, _ = _decode(_ort(out / "model.onnx"), _spec(art), rows, 2)
    assert np.abs(got - _kiln_logits(art, rows)).max() <= 1e-3

    code, _, stderr = cli("export", art, "--format", "onnx", "-o", out)
    assert code == 2 and "already exists; pass --overwrite" in stderr and stderr.count("\n") == 1
    code, _, stderr = cli("export", art, "--format", "onnx", "-o", out, "--overwrite")
    assert code == 0, stderr
    assert not (out / "model.onnx.data").exists()  # replaced whole: a small model keeps its weights inline


def test_the_check_refuses_a_wrong_graph_and_writes_nothing(artifact, tmp_path, monkeypatch):
    # no causal mask: the prefill's logits are wrong (decode steps alone would not see it)
    monkeypatch.setattr(onnx_lowering, "LOWEST", 0.0)
    refused(export, artifact("fp8-weights"), "onnx", tmp_path / "a", match="logits differ from the runtime's")
    # an FP8 quantizer with the wrong range: caught bit for bit, whatever the logits do
    monkeypatch.undo()
    monkeypatch.setattr(onnx_qdq, "E4M3_MAX", 440.0)
    refused(export, artifact("fp8"), "onnx", tmp_path / "b", match="fp8_dynamic_per_token quantizer on model.layers.0")
    assert not any(tmp_path.iterdir())  # no output, no temporary sibling


def test_formats_not_lowered_are_refused_in_one_line(artifact, tmp_path):
    refused(export, artifact("nvfp4-w4a4"), "onnx", tmp_path / "out", match="(W4A4), which is not lowered")
    # NVFP4 KV needs head dims of 16: a tiny Qwen3 (head_dim 32) rather than stories260K (8)
    from tests.precision_helpers import tiny_with_tokenizer

    qwen3 = tiny_with_tokenizer("qwen3", tmp_path)
    art = build(qwen3, "blackwell", Recipe("nvfp4-kv", [KvCacheQuantization(format="nvfp4")]), tmp_path / "art",
                gate=False, calib_data=SAMPLE_TEXT).path
    refused(export, art, "onnx", tmp_path / "out", match="KV cache is NVFP4, which is not lowered")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("model_type,match", [("mixtral", "(MoE is not lowered)"),
                                              ("deepseek_v3", "(MLA is not lowered)")])
def test_structures_not_lowered_are_refused_in_one_line(model_type, match, tmp_path):
    from tests.precision_helpers import tiny_with_tokenizer

    art = build(tiny_with_tokenizer(model_type, tmp_path), "hopper", "none", tmp_path / "art", gate=False).path
    refused(export, art, "onnx", tmp_path / "out", match=match)
    assert not (tmp_path / "out").exists()


# q/k/v biases; per-head q/k RMSNorm; Gemma 3: (1 + w) and sandwich norms, scaled embedding, GeGLU, windows
@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "gemma3_text"])
def test_qwen_and_gemma_structures_lower(model_type, tmp_path):
    from tests.precision_helpers import tiny_with_tokenizer

    art = build(tiny_with_tokenizer(model_type, tmp_path), "hopper", "none", tmp_path / "art", gate=False).path
    out = export(art, "onnx", tmp_path / "onnx")
    assert json.loads((out / "onnx_check.json").read_text())["max_abs_logit_diff"] <= 1e-3


def test_missing_artifact_and_missing_onnx(tmp_path, cli, monkeypatch):
    code, _, stderr = cli("export", tmp_path / "nope", "--format", "onnx", "-o", tmp_path / "out")
    assert code == 2 and "does not exist" in stderr and stderr.count("\n") == 1
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnx" else find_spec(name, *a))
    refused(export, tmp_path / "art", "onnx", tmp_path / "out", match="pip install -e '.[onnx]'")
