"""The fuse pass: q/k/v and gate/up as single linears in their stored formats, kernel fusions recorded in the spec.

Each test reads like a spec: Before, the pass, Expected structure, then numerics (the fused graph's logits are the
unfused graph's up to float summation order), skip reasons, ordering, and the export round trip (the exports write
the parts back, tensor for tensor what the unfused build exports)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from kiln import runtime
from kiln.kernels.errors import KilnError
from kiln.kernels.targets import get_target
from kiln.optimizer.build import build
from kiln.optimizer.export import export
from kiln.optimizer.export.unfuse import unfuse_artifact
from kiln.optimizer.loader import load_checkpoint
from kiln.optimizer.lower import write_artifact
from kiln.optimizer.measure.gate import AccuracyGate, engine_from_graph
from kiln.optimizer.recipes import Recipe, resolve_recipe
from kiln.passes.base import PassContext, Pipeline
from kiln.passes.fuse import Fusion, unfuse_spec
from kiln.passes.weight_quant import WeightQuantization
from kiln.runtime.model import Transformer
from kiln.runtime.spec import spec_from_json
from tests.conftest import EVAL_TEXT, STORIES, needs_stories, refused, untuned
from tests.precision_helpers import SAMPLE_TEXT, tiny_with_tokenizer

MANIFEST = {"passes": [], "target": "blackwell", "source": {"model_type": "llama"},
            "recipe": {"name": "t", "passes": []}}
TOLERANCE = 1e-5  # of the largest |logit|: fp32 summation order, nothing else


def _ctx(target: str = "blackwell") -> PassContext:
    return PassContext(get_target(target))


def _tokens(vocab: int, count: int = 3, length: int = 12) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (length,), generator=gen).tolist() for _ in range(count)]


def _relative_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    worst = max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))
    return worst / max(float(y.abs().max()) for y in b)


def _fuse(graph, fusion: Fusion | None = None):
    (record,) = Pipeline([fusion or Fusion()]).run(graph, _ctx())
    return record.result


# --- structure ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "gemma3_text"])
def test_qkv_and_gate_up_become_one_linear_each(tiny_checkpoints, model_type, tmp_path):
    graph = load_checkpoint(tiny_checkpoints[model_type])
    # Before: three attention projections and two MLP inputs per layer
    a = graph.spec.layers[0].attention
    assert set(a.linears) == {"q", "k", "v", "o"} and set(graph.spec.layers[0].mlp.linears) == {"gate", "up", "down"}
    q, k, v = (a.linears[r] for r in ("q", "k", "v"))
    weights = {name: graph.tensors[f"{name}.weight"] for name in (q.name, k.name, v.name)}
    unfused = engine_from_graph(graph)
    result = _fuse(graph)
    # Expected: qkv_proj [H D + 2 Hkv D, hidden] and gate_up_proj [2 I, hidden], parts in row order
    for layer in graph.spec.layers:
        a, m = layer.attention, layer.mlp
        assert list(a.linears) == ["qkv", "o"] and list(m.linears) == ["gate_up", "down"]
        qkv, gate_up = a.linears["qkv"], m.linears["gate_up"]
        assert qkv.name == f"{layer.prefix}.self_attn.qkv_proj" and qkv.role == "qkv"
        assert (qkv.out_features, qkv.in_features) == ((a.num_heads + 2 * a.num_kv_heads) * a.head_dim, 64)
        assert [p.role for p in qkv.parts] == ["q", "k", "v"]
        assert qkv.bias == (model_type == "qwen2")  # Qwen2's q/k/v biases concatenate
        assert (gate_up.out_features, gate_up.in_features) == (2 * 96, 64)
        assert [p.name.rsplit(".", 1)[-1] for p in gate_up.parts] == ["gate_proj", "up_proj"]
        # unquantized: no activation quantization to fuse into, RoPE + KV write always
        assert [f.kind for f in layer.fusions] == ["rope_kv_write"] and layer.fusions[0].ops == (qkv.name,)
    assert graph.linears["model.layers.0.self_attn.qkv_proj"].role == "qkv"
    assert "model.layers.0.self_attn.q_proj" not in graph.linears
    assert "model.layers.0.self_attn.q_proj.weight" not in graph.tensors
    assert torch.equal(graph.tensors["model.layers.0.self_attn.qkv_proj.weight"], torch.cat(list(weights.values())))
    assert set(result.changed) >= {"model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.gate_up_proj",
                                   "model.layers.0.kernel.rope_kv_write"}
    # Gemma's GeGLU has no swiglu_quant kernel: skipped for that reason first
    assert ("not SiLU" if model_type == "gemma3_text" else "quantizes no activations") in \
        result.skipped["model.layers.0.kernel.swiglu_quant"]
    assert graph.metadata["fusion"]["linears"]["model.layers.0.self_attn.qkv_proj"] == list(weights)
    # numerics: the runtime runs one GEMM and splits it
    tokens = _tokens(graph.spec.vocab_size)
    assert _relative_difference(engine_from_graph(graph).logits(tokens), unfused.logits(tokens)) <= TOLERANCE
    # the artifact carries it and the runtime executes it
    art = write_artifact(graph, tmp_path / "art", MANIFEST, "report")
    manifest = json.loads((art / "manifest.json").read_text())
    layer0 = manifest["architecture"]["layers"][0]
    assert [p["name"] for p in layer0["attention"]["linears"]["qkv"]["parts"]] == list(weights)
    assert layer0["fusions"] == [{"kind": "rope_kv_write", "ops": ["model.layers.0.self_attn.qkv_proj"]}]
    assert manifest["formats"]["model.layers.0.mlp.gate_up_proj"]["role"] == "gate_up"
    engine = runtime.load(art)
    assert engine.spec == graph.spec and engine.model.blocks[0].attention.qkv_proj is not None
    assert _relative_difference(engine.logits(tokens), unfused.logits(tokens)) <= TOLERANCE


def test_the_fused_spec_round_trips_and_unfuses(tiny_checkpoints):
    graph = load_checkpoint(tiny_checkpoints["qwen2"])
    source = graph.spec
    Pipeline([WeightQuantization(format="fp8", activations="dynamic"), Fusion()]).run(graph, _ctx())
    spec = graph.spec
    assert spec_from_json(json.loads(json.dumps(spec.to_json()))) == spec
    assert unfuse_spec(spec) == source  # the parts are the linears the source had, exactly
    kinds = [f.kind for f in spec.layers[0].fusions]
    assert kinds == ["rope_kv_write", "rmsnorm_quant", "rmsnorm_quant", "swiglu_quant"]
    assert spec.layers[0].fusions[1].ops == ("model.layers.0.input_layernorm.weight",
                                             "model.layers.0.self_attn.qkv_proj")
    assert spec.layers[0].fusions[3].ops == ("model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj")
    bad = spec.to_json()
    bad["layers"][0]["fusions"][0]["kind"] = "flash_everything"
    refused(spec_from_json, bad, match="unknown kernel fusion 'flash_everything'")


def test_the_runtime_refuses_a_fused_linear_whose_parts_do_not_fit(tiny_checkpoints):
    from kiln.optimizer.lower import lower_tensors

    graph = load_checkpoint(tiny_checkpoints["llama"])
    _fuse(graph)
    tensors, formats = lower_tensors(graph)
    layer = graph.spec.layers[0]
    qkv = layer.attention.linears["qkv"]
    swapped = dataclasses.replace(qkv, parts=(qkv.parts[1], qkv.parts[0], qkv.parts[2]))  # k before q
    attention = dataclasses.replace(layer.attention, linears={**layer.attention.linears, "qkv": swapped})
    spec = dataclasses.replace(graph.spec, layers=(dataclasses.replace(layer, attention=attention),
                                                   *graph.spec.layers[1:]))
    refused(Transformer, spec, tensors, formats, match="fused linear model.layers.0.self_attn.qkv_proj has parts")


# --- numerics on the real model, per stored format ------------------------------------------------------------------
STORIES_RECIPES = {
    "none": (),
    # the built-ins without their 200 tuning steps (they move grid points, not the layout under test)
    "fp8-weights": untuned("fp8-weights").passes,
    "nvfp4-w4a16": untuned("nvfp4-w4a16").passes,
}


@needs_stories
@pytest.mark.parametrize("recipe", sorted(STORIES_RECIPES))
def test_fused_logits_equal_the_unfused_graphs_on_stories(recipe):
    from kiln.calibration.data import load_token_lists
    from kiln.runtime.engine import load_tokenizer

    graph = build(STORIES, "hopper", Recipe(recipe, STORIES_RECIPES[recipe]), None, gate=False).graph
    tokens = load_token_lists(load_tokenizer(STORIES), EVAL_TEXT, 16)
    unfused = engine_from_graph(graph).logits(tokens)
    result = _fuse(graph)
    assert len([k for k in result.changed if k.endswith(("qkv_proj", "gate_up_proj"))]) == 2 * 5
    fmt = {"none": "dense", "fp8-weights": "fp8_e4m3", "nvfp4-w4a16": "nvfp4"}[recipe]
    assert graph.linears["model.layers.4.mlp.gate_up_proj"].format == fmt
    a = graph.spec.layers[4].attention  # 8 heads and 4 KV heads of 8 dims
    assert graph.linears["model.layers.4.self_attn.qkv_proj"].out_features == (8 + 2 * 4) * 8 == \
        (a.num_heads + 2 * a.num_kv_heads) * a.head_dim
    assert _relative_difference(engine_from_graph(graph).logits(tokens), unfused) <= TOLERANCE


@needs_stories
def test_the_gate_holds_fusion_to_the_unfused_figures(stories_graph):
    from kiln.calibration.data import load_token_lists
    from kiln.runtime.engine import load_tokenizer

    tokens = load_token_lists(load_tokenizer(STORIES), EVAL_TEXT, 40)
    gate = AccuracyGate(engine_from_graph(stories_graph), tokens)
    ctx = PassContext(get_target("hopper"), gate=gate)
    quantized, fused = Pipeline([WeightQuantization(format="fp8"), Fusion()]).run(stories_graph, ctx)
    assert fused.decision == "kept"
    (metric,) = fused.gate.metrics
    assert metric.name == "max logit diff (relative)" and not metric.higher_is_better
    assert 0 <= metric.value <= 1e-5 and metric.passed
    # the standard gate is the unfused build's: same recovery, KL and top-1 up to float summation order
    assert fused.gate.recovery == pytest.approx(quantized.gate.recovery, abs=1e-6)
    assert fused.gate.kl == pytest.approx(quantized.gate.kl, abs=1e-7)
    assert fused.gate.top1 == pytest.approx(quantized.gate.top1, abs=1e-3)
    assert fused.gate.floor == Fusion.default_floor and fused.gate.max_kl == Fusion.default_max_kl


# --- what is skipped, and why ---------------------------------------------------------------------------------------
def test_moe_routed_experts_and_mla_are_skipped_with_the_reason(tiny_checkpoints):
    graph = load_checkpoint(tiny_checkpoints["qwen2_moe"])
    tokens = _tokens(graph.spec.vocab_size)
    unfused = engine_from_graph(graph).logits(tokens)
    result = _fuse(graph)
    assert "routed experts" in result.skipped["model.layers.0.mlp.experts"]
    assert "model.layers.0.mlp.shared_expert.gate_up_proj" in result.changed  # a shared expert is a dense MLP
    assert set(graph.spec.layers[0].mlp.linears) == {"router", "shared_gate_up", "shared_down", "shared_gate_router"}
    assert graph.spec.layers[0].mlp.experts == load_checkpoint(tiny_checkpoints["qwen2_moe"]).spec.layers[0].mlp.experts
    assert _relative_difference(engine_from_graph(graph).logits(tokens), unfused) <= TOLERANCE

    deepseek = load_checkpoint(tiny_checkpoints["deepseek_v3"])
    result = _fuse(deepseek)
    assert "MLA attention" in result.skipped["model.layers.0.self_attn"]
    assert "qkv" not in deepseek.spec.layers[0].attention.linears
    assert "model.layers.0.mlp.gate_up_proj" in result.changed  # layer 0's dense MLP
    assert "model.layers.1.mlp.shared_experts.gate_up_proj" in result.changed


def test_fp8_per_tensor_scales_that_differ_become_per_channel_or_skip(tiny_checkpoints):
    per_tensor = WeightQuantization(format="fp8", activations="dynamic", granularity="per_tensor")
    graph = load_checkpoint(tiny_checkpoints["llama"])
    Pipeline([per_tensor]).run(graph, _ctx())
    tokens = _tokens(graph.spec.vocab_size)
    unfused = engine_from_graph(graph).logits(tokens)
    scales = [graph.linears[f"model.layers.0.self_attn.{p}_proj"].quant.tensors["weight_scale"] for p in "qkv"]
    assert len({float(s) for s in scales}) == 3  # three per-tensor scales
    state = graph.snapshot()
    result = _fuse(graph)
    assert "per-tensor FP8 scales became per-channel" in result.changed["model.layers.0.self_attn.qkv_proj"]
    qw = graph.linears["model.layers.0.self_attn.qkv_proj"].quant
    assert qw.part_scales == ("per_tensor",) * 3 and qw.tensors["weight_scale"].shape == (128, 1)
    assert torch.equal(qw.tensors["weight_scale"][64:96, 0], scales[1].expand(32))  # k's rows keep k's scale
    assert _relative_difference(engine_from_graph(graph).logits(tokens), unfused) <= TOLERANCE

    graph.restore(state)
    result = _fuse(graph, Fusion(fp8_per_tensor="skip"))
    assert "FP8 weight scales are per-tensor and differ" in result.skipped["model.layers.0.self_attn.qkv_proj"]
    assert "q/k/v are not fused" in result.skipped["model.layers.0.kernel.rmsnorm_quant.attention"]
    assert "q" in graph.spec.layers[0].attention.linears


def _replace_stored(graph, name: str, **tensors) -> None:
    lin = graph.linears[name]
    lin.quant = dataclasses.replace(lin.quant, tensors={**lin.quant.tensors, **tensors})


def test_nvfp4_global_scales_and_input_scales_must_agree(tiny_checkpoints):
    graph = load_checkpoint(tiny_checkpoints["llama"])
    Pipeline([WeightQuantization(format="nvfp4")]).run(graph, _ctx())
    # weight-quant shares one per-tensor scale across q/k/v and across gate/up
    q, k = (graph.linears[f"model.layers.0.self_attn.{p}_proj"].quant.tensors for p in "qk")
    assert torch.equal(q["weight_scale_2"], k["weight_scale_2"])
    state = graph.snapshot()
    _replace_stored(graph, "model.layers.0.self_attn.k_proj", weight_scale_2=k["weight_scale_2"] * 2)
    result = _fuse(graph)
    assert "NVFP4 per-tensor scales (weight_scale_2) differ" in result.skipped["model.layers.0.self_attn.qkv_proj"]
    assert "model.layers.1.self_attn.qkv_proj" in result.changed  # the other layer fuses

    graph.restore(state)
    assert "nvfp4 linear" in _fuse(graph).changed["model.layers.0.self_attn.qkv_proj"]

    # static activations: gate and up share one calibrated input scale (they read one input)
    graph = load_checkpoint(tiny_checkpoints["llama"])
    Pipeline([WeightQuantization(format="fp8", activations="static")]).run(
        graph, PassContext(get_target("blackwell"), runner=_runner(graph)))
    gate, up = (graph.linears[f"model.layers.0.mlp.{p}_proj"].quant.tensors for p in ("gate", "up"))
    assert torch.equal(gate["input_scale"], up["input_scale"])
    _replace_stored(graph, "model.layers.0.mlp.up_proj", input_scale=up["input_scale"] * 2)
    result = _fuse(graph)
    assert "activation quantizers (input_scale) differ" in result.skipped["model.layers.0.mlp.gate_up_proj"]
    assert "gate/up are not fused" in result.skipped["model.layers.0.kernel.rmsnorm_quant.mlp"]
    assert "fp8_static_per_tensor" in result.changed["model.layers.0.kernel.swiglu_quant"]


def _runner(graph):
    from kiln.optimizer.measure.runner import RuntimeRunner

    return RuntimeRunner(graph, _tokens(graph.spec.vocab_size, count=4, length=32))


def test_formats_that_differ_are_skipped_and_nothing_fused_is_an_error(tiny_checkpoints):
    graph = load_checkpoint(tiny_checkpoints["llama"])
    kept = tuple(f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.k_proj", "mlp.up_proj"))
    Pipeline([WeightQuantization(format="fp8", keep=kept)]).run(graph, _ctx())
    result = _fuse(graph, Fusion())
    assert result.skipped["model.layers.0.self_attn.qkv_proj"] == ("not fused: formats differ (fp8_e4m3, dense, "
                                                                   "fp8_e4m3): one GEMM has one format")
    assert set(result.changed) == {f"model.layers.{i}.kernel.rope_kv_write" for i in range(2)}
    graph = load_checkpoint(tiny_checkpoints["llama"])
    Pipeline([WeightQuantization(format="fp8", keep=kept)]).run(graph, _ctx())
    with pytest.raises(KilnError, match="pass 'fuse' matched no layers: model.layers.0.self_attn.qkv_proj: not fused"):
        _fuse(graph, Fusion(kernels=False))


def test_fuse_must_be_last_and_is_a_recipe():
    refused(Pipeline, [Fusion(), WeightQuantization()], match="'fuse' must be the last pass")
    refused(lambda: Pipeline(resolve_recipe("fuse,fp8-weights").passes), match="must be the last pass")
    for spec in ("fp8-weights,fuse", "nvfp4-w4a16,fuse", "none,fuse"):
        passes = Pipeline(resolve_recipe(spec).passes).flat()
        assert isinstance(passes[-1], Fusion)
    refused(Fusion, False, False, False, match="would fuse nothing")
    refused(lambda: Fusion(fp8_per_tensor="drop"), match="fp8_per_tensor='drop' is not allowed")


# --- export: the parts go back under their own names ----------------------------------------------------------------
EXPORT_CASES = {
    "fp8-dynamic": (lambda: WeightQuantization(format="fp8", activations="dynamic"),
                    ("compressed-tensors", "hf-modelopt")),
    "fp8-static-per-tensor": (lambda: WeightQuantization(format="fp8", activations="static", granularity="per_tensor"),
                              ("compressed-tensors", "hf-modelopt")),
    "nvfp4-w4a16": (lambda: WeightQuantization(format="nvfp4"), ("compressed-tensors", "hf-modelopt")),
}


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return tiny_with_tokenizer("qwen2", tmp_path_factory.mktemp("fuse-export"))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype.itemsize == 1 else torch.equal(a, b)


@pytest.mark.parametrize("case", sorted(EXPORT_CASES))
def test_an_exported_fused_build_equals_the_exported_unfused_build(qwen2, tmp_path, case):
    make, formats = EXPORT_CASES[case]
    built = {}
    for name, passes in (("unfused", (make(),)), ("fused", (make(), Fusion()))):
        built[name] = build(qwen2, "blackwell", Recipe(case, passes), tmp_path / name, gate=False,
                            calib_data=SAMPLE_TEXT).path
    fused_manifest = json.loads((built["fused"] / "manifest.json").read_text())
    assert "model.layers.0.self_attn.qkv_proj" in fused_manifest["formats"]
    assert fused_manifest["records"]["fusion"]["linears"]["model.layers.0.mlp.gate_up_proj"] == [
        "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]
    # the unfused view of the fused artifact is the unfused artifact
    view, tensors = unfuse_artifact(fused_manifest, load_file(str(built["fused"] / "model.safetensors")))
    plain = json.loads((built["unfused"] / "manifest.json").read_text())
    reference = load_file(str(built["unfused"] / "model.safetensors"))
    assert spec_from_json(view["architecture"]) == spec_from_json(plain["architecture"])
    assert view["formats"] == plain["formats"]
    assert tensors.keys() == reference.keys() and all(_same(tensors[k], reference[k]) for k in reference)
    for fmt in formats:
        out = {name: export(path, fmt, tmp_path / f"{name}-{fmt}") for name, path in built.items()}
        a, b = (load_file(str(out[n] / "model.safetensors")) for n in ("fused", "unfused"))
        assert a.keys() == b.keys() and not any("qkv" in k or "gate_up" in k for k in a)
        assert any(k.startswith("model.layers.0.self_attn.q_proj.weight") for k in a)
        assert all(_same(a[k], b[k]) for k in b), fmt
        assert json.loads((out["fused"] / "config.json").read_text()) == \
            json.loads((out["unfused"] / "config.json").read_text())


def test_the_onnx_export_of_a_fused_artifact_takes_the_parts(tiny_checkpoints, tmp_path):
    onnx = pytest.importorskip("onnx")
    graph = load_checkpoint(tiny_checkpoints["llama"])
    _fuse(graph)
    art = write_artifact(graph, tmp_path / "art", MANIFEST, "report")
    out = export(art, "onnx", tmp_path / "onnx")  # checked against the (fused) runtime's logits within 1e-3
    names = {init.name for init in onnx.load(str(out / "model.onnx"), load_external_data=False).graph.initializer}
    assert any("q_proj" in n for n in names) and not any("qkv" in n or "gate_up" in n for n in names)
    check = json.loads((out / "onnx_check.json").read_text())
    assert check["max_abs_logit_diff"] < 1e-4, check
