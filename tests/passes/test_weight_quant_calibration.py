"""WeightQuantization's calibration: AWQ folding and rotations keep the fp32 function, calibration is
sequential through the runtime's own modules, calibrated scales and tuned values are what the artifact
stores, and on the real model the calibrated methods beat round-to-nearest (the recovery floors: slow)."""

from __future__ import annotations

import pytest
import torch

from kiln.calibration.quantize import static_input_scale
from kiln.kernels.errors import KilnError
from kiln.kernels.rotation import block_hadamard
from kiln.kernels.targets import get_target
from kiln.optimizer.loader import load_checkpoint
from kiln.optimizer.measure import calibration_session as calibrator_module
from kiln.optimizer.measure.calibration_session import RuntimeCalibrator
from kiln.optimizer.measure.gate import engine_from_graph
from kiln.optimizer.measure.runner import RuntimeRunner
from kiln.passes.awq_fold import awq_groups, fold_input_scale
from kiln.passes.base import PassContext, Pipeline
from kiln.passes.linear_quant import stage_of
from kiln.passes.weight_quant import WeightQuantization
from kiln.runtime.engine import Engine
from tests.conftest import CALIB_TEXT, EVAL_TEXT, STORIES, needs_stories


def token_lists(vocab: int, count: int = 12, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(8, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(count)]


def logits(graph, tokens):
    return torch.cat(engine_from_graph(graph).logits(tokens))


def test_awq_folding_keeps_the_fp32_function(generated_checkpoint):
    graph = load_checkpoint(generated_checkpoint)  # GQA, tied embeddings
    tokens = token_lists(graph.spec.vocab_size)
    before = logits(graph, tokens)
    embedding = graph.tensors[graph.embedding]
    source = dict(graph.tensors)
    g = torch.Generator().manual_seed(1)
    for block in graph.blocks:
        groups, why_not = awq_groups(graph, block.index)
        assert why_not is None and len(groups) == 4
        for group in groups:
            k = graph.linears[group.consumers[0]].in_features
            scale = torch.rand(k, generator=g) * 1.5 + 0.5
            if group.tie is not None:  # o_proj: query heads sharing a KV head share a scale
                scale = scale[: int(group.tie.max()) + 1][group.tie]
            fold_input_scale(graph, group, scale)
    torch.testing.assert_close(logits(graph, tokens), before, atol=1e-5, rtol=1e-5)
    assert graph.tensors[graph.embedding] is embedding  # the tied embedding is never touched
    changed = [n for n in source if graph.tensors[n] is not source[n]]
    assert changed and all(not torch.equal(graph.tensors[n], source[n]) for n in changed)  # replaced, not mutated


def test_rotation_folding_is_exact_in_fp32(tiny_checkpoints):
    from kiln.optimizer.lower import lower_tensors

    graph = load_checkpoint(tiny_checkpoints["llama"])
    tokens = token_lists(graph.spec.vocab_size)
    tensors, formats = lower_tensors(graph)
    before = torch.cat(Engine(graph.spec, tensors, formats).logits(tokens))
    for lin in graph.iter_linears(("q", "k", "v", "o", "gate", "up", "down")):
        tensors[lin.weight_name] = block_hadamard(tensors[lin.weight_name], 32)  # W R
        formats[lin.name] = {**formats[lin.name], "input_rotation": {"kind": "block_hadamard", "block_size": 32}}
    after = torch.cat(Engine(graph.spec, tensors, formats).logits(tokens))
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)


def test_rotated_pass_stores_the_rotated_weight_and_its_rotation(tiny_checkpoints):
    from kiln.optimizer.lower import lower_tensors

    graph = load_checkpoint(tiny_checkpoints["llama"])
    source = graph.weight("model.layers.0.mlp.down_proj").clone()
    Pipeline([WeightQuantization(format="nvfp4", rotation_block=16)]).run(graph, PassContext(get_target("hopper")))
    q = graph.linears["model.layers.0.mlp.down_proj"].quant
    assert q.rotation_block == 16
    rotated = block_hadamard(source, 16)
    assert float((q.dequantize() - rotated).pow(2).sum() / rotated.pow(2).sum()) < 0.02
    _, formats = lower_tensors(graph)
    assert formats["model.layers.0.mlp.down_proj"]["input_rotation"] == {"kind": "block_hadamard", "block_size": 16}


def test_without_calibration_text_static_scales_fail_and_the_rest_falls_back_loudly(tiny_checkpoints):
    graph = load_checkpoint(tiny_checkpoints["llama"])
    with pytest.raises(KilnError, match="activations='static' needs calibration text"):
        WeightQuantization(activations="static").apply(graph, PassContext(get_target("hopper")))
    logged = []
    ctx = PassContext(get_target("hopper"), log=logged.append)
    result = WeightQuantization(format="nvfp4", method="gptq", awq=True, tune_steps=3).apply(graph, ctx)
    assert "method='gptq', awq, tune_steps not possible" in result.notes[0] and logged[0].startswith("warning")
    assert {lin.quant.method for lin in graph.linears.values() if lin.quant} == {"mse"}


@pytest.mark.parametrize("config, message", [
    ({"method": "gptq2"}, "method='gptq2' is not allowed"),
    ({"format": "mxfp4", "activations": "static"}, "not allowed for mxfp4"),
    ({"format": "mxfp6", "activations": "dynamic"}, "not allowed for mxfp6"),
    ({"rotation_block": 24}, "power of two"),
    ({"damping": 2.0}, "damping must be"),
    ({"tune_steps": -1}, "tune_steps must be"),
])
def test_config_validation(config, message):
    with pytest.raises(KilnError, match=message):
        WeightQuantization(**config)


def test_calibration_is_sequential_through_the_runtime(tiny_checkpoints):
    graph = load_checkpoint(tiny_checkpoints["llama"])
    tokens = token_lists(graph.spec.vocab_size)
    session = RuntimeCalibrator(tokens, max_batch_tokens=128).session(graph)
    seen: dict[str, list[torch.Tensor]] = {}

    def keep(name, x):
        seen.setdefault(name, []).append(x.clone())

    name = "model.layers.1.self_attn.o_proj"
    session.observe([name], keep)
    observed = torch.cat(seen.pop(name))
    # the same inputs, hooked on the runtime's own model over the same tokens (real tokens only)
    engine = engine_from_graph(graph)
    direct = []
    hook = engine.model.blocks[1].attention.o_proj.register_forward_pre_hook(lambda m, a: direct.append(a[0][0]))
    for ids in tokens:
        engine.logits([ids])
    hook.remove()
    assert observed.shape[0] == sum(map(len, tokens))
    torch.testing.assert_close(observed.sum(0), torch.cat(direct).sum(0), atol=1e-4, rtol=1e-4)
    # quantizing block 0 changes what block 1 sees (sequential), and the session follows the graph
    Pipeline([WeightQuantization(format="mxfp4", roles=("q", "k", "v", "o", "gate", "up", "down"),
                                 keep=tuple(n for n in graph.linears if ".layers.0." not in n))]).run(
        graph, PassContext(get_target("hopper")))
    session.observe([name], keep)
    assert not torch.allclose(torch.cat(seen[name]), observed, atol=1e-6)


def test_static_fp8_scales_are_the_calibrated_input_maxima(tiny_checkpoints):
    graph = load_checkpoint(tiny_checkpoints["llama"])
    tokens = token_lists(graph.spec.vocab_size)
    ctx = PassContext(get_target("hopper"), runner=RuntimeRunner(graph, tokens))
    maxima: dict[str, float] = {}
    reference = RuntimeCalibrator(tokens).session(load_checkpoint(tiny_checkpoints["llama"]))
    reference.observe(["model.layers.0.self_attn.q_proj"],
                      lambda n, x: maxima.__setitem__(n, max(maxima.get(n, 0.0), float(x.abs().max()))))
    (_record,) = Pipeline([WeightQuantization(format="fp8", activations="static", method="mse")]).run(graph, ctx)
    q = graph.linears["model.layers.0.self_attn.q_proj"].quant
    assert q.activation == "fp8_static_per_tensor" and q.method == "mse"
    expected = static_input_scale("fp8", torch.tensor(maxima["model.layers.0.self_attn.q_proj"]))
    torch.testing.assert_close(q.tensors["input_scale"], expected)
    engine_from_graph(graph).logits(tokens[:2])  # the runtime runs it


def test_gptq_awq_and_tuning_store_grid_values_and_lower_the_kl(generated_checkpoint):
    graph = load_checkpoint(generated_checkpoint)
    tokens = token_lists(graph.spec.vocab_size, count=24)
    source = engine_from_graph(graph)

    def kl(g):
        base = torch.log_softmax(torch.cat(source.logits(tokens)), -1)
        cand = torch.log_softmax(torch.cat(engine_from_graph(g).logits(tokens)), -1)
        return float((base.exp() * (base - cand)).sum(-1).mean())

    rtn = load_checkpoint(generated_checkpoint)
    Pipeline([WeightQuantization(format="mxfp4")]).run(rtn, PassContext(get_target("hopper")))
    ctx = PassContext(get_target("hopper"), runner=RuntimeRunner(graph, tokens, max_batch_tokens=256))
    norm = graph.tensors["model.layers.0.input_layernorm.weight"]
    (record,) = Pipeline([WeightQuantization(format="mxfp4", method="gptq", awq=True, tune_steps=8,
                                             tune_lr=1e-3)]).run(graph, ctx)
    q = graph.linears["model.layers.1.mlp.down_proj"].quant
    assert q.method == "awq+gptq+tuned"
    assert any(n.startswith("tuned 8 steps") for n in record.result.notes)
    assert graph.tensors["model.layers.0.input_layernorm.weight"] is not norm  # AWQ and tuning replace norms
    assert kl(graph) < kl(rtn)


@needs_stories
def test_gptq_beats_round_to_nearest_on_the_real_model():
    from kiln.calibration.data import load_token_lists
    from kiln.optimizer.measure.gate import AccuracyGate
    from kiln.runtime.engine import load_tokenizer

    graph = load_checkpoint(STORIES)
    tokenizer = load_tokenizer(STORIES)
    gate = AccuracyGate(engine_from_graph(graph), load_token_lists(tokenizer, EVAL_TEXT, 100))
    calib = load_token_lists(tokenizer, CALIB_TEXT, 64)
    rtn, gptq = load_checkpoint(STORIES), load_checkpoint(STORIES)
    Pipeline([WeightQuantization(format="nvfp4")]).run(rtn, PassContext(get_target("hopper")))
    Pipeline([WeightQuantization(format="nvfp4", method="gptq", act_order=False)]).run(
        gptq, PassContext(get_target("hopper"), runner=RuntimeRunner(gptq, calib)))
    assert gate(gptq, 0.0).recovery > gate(rtn, 0.0).recovery + 0.02


FLOORS = {"fp8-weights": 0.995, "fp8": 0.99, "nvfp4-w4a16": 0.97, "mxfp4-w4a16": 0.94}


@pytest.mark.slow
@needs_stories
@pytest.mark.parametrize("recipe", sorted(FLOORS))
def test_builtin_recipes_reach_the_recovery_floors(recipe, tmp_path):
    """The fixed protocol: first 600 paragraphs of evaluation.txt, through the runtime; calibration.txt only."""
    from kiln.optimizer.build import build

    result = build(STORIES, "blackwell", recipe, None, eval_data=EVAL_TEXT, calib_data=CALIB_TEXT,
                   min_recovery=FLOORS[recipe])
    (record,) = result.records
    assert record.decision == "kept" and record.gate.recovery >= FLOORS[recipe]


def test_distillation_objective_is_the_runtimes_kl(tiny_checkpoints):
    """The tuning's forward is the runtime's: its KL equals the one computed from two runtime engines."""
    from kiln.calibration.grids import WeightLayout
    from kiln.calibration.tuning import FakeQuantWeight

    graph = load_checkpoint(tiny_checkpoints["llama"])
    tokens = token_lists(graph.spec.vocab_size, count=6)
    session = RuntimeCalibrator(tokens, max_batch_tokens=10_000).session(graph)
    assert float(session.distillation({}, {}, max_batch_tokens=10_000).loss(0)) < 1e-6  # nothing changed
    source = engine_from_graph(graph)
    Pipeline([WeightQuantization(format="nvfp4", activations="dynamic")]).run(graph, PassContext(get_target("blackwell")))
    layout = WeightLayout("nvfp4")
    latents = {lin.name: FakeQuantWeight(layout, lin.quant.dequantize(),
                                         layout.scales_from_stored(dict(lin.quant.tensors), lin.out_features))
               for lin in graph.linears.values() if lin.quant is not None}
    objective = session.distillation(latents, {}, max_batch_tokens=10_000)
    assert len(objective) == 1
    base = torch.log_softmax(torch.cat(source.logits(tokens)), -1)
    cand = torch.log_softmax(torch.cat(engine_from_graph(graph).logits(tokens)), -1)
    expected = float((base.exp() * (base - cand)).sum(-1).mean())
    loss = objective.loss(0)  # runs backward itself
    assert abs(loss - expected) < 1e-6 + 1e-4 * expected and expected > 1e-5
    # straight-through: every latent weight gets a gradient
    assert all(fq.latent.grad is not None and fq.latent.grad.abs().sum() > 0 for fq in latents.values())


def test_distillation_micro_batches_add_up_to_the_batch(tiny_checkpoints, monkeypatch):
    """A step's batch run as micro-batches gives the same loss and accumulated gradient as in one piece
    (weight-only: dynamic FP4 activation scales depend on the batch, as in the runtime)."""
    from kiln.calibration.grids import WeightLayout
    from kiln.calibration.tuning import FakeQuantWeight

    graph = load_checkpoint(tiny_checkpoints["llama"])
    tokens = token_lists(graph.spec.vocab_size, count=6)
    session = RuntimeCalibrator(tokens, max_batch_tokens=10_000).session(graph)
    Pipeline([WeightQuantization(format="nvfp4")]).run(graph, PassContext(get_target("hopper")))
    layout = WeightLayout("nvfp4")
    latents = {lin.name: FakeQuantWeight(layout, lin.quant.dequantize(),
                                         layout.scales_from_stored(dict(lin.quant.tensors), lin.out_features))
               for lin in graph.linears.values() if lin.quant is not None}
    results = []
    for micro_tokens in (10_000, 60):
        monkeypatch.setattr(calibrator_module, "MICRO_BATCH_TOKENS", micro_tokens)
        for fq in latents.values():
            fq.latent.grad = None
        objective = session.distillation(latents, {}, max_batch_tokens=10_000)
        assert len(objective) == 1 and len(objective.batches[0]) == (1 if micro_tokens > 1000 else 6)
        results.append((objective.loss(0), {n: fq.latent.grad.clone() for n, fq in latents.items()}))
    (whole, whole_grads), (micro, micro_grads) = results
    assert micro == pytest.approx(whole, rel=1e-4) and whole > 1e-6  # fp32 sums over other paddings
    for n in latents:
        assert torch.allclose(micro_grads[n], whole_grads[n], rtol=1e-3, atol=1e-9)


@pytest.mark.parametrize("model_type", ["qwen2", "mixtral", "qwen3_moe", "deepseek_v3", "gemma3_text"])
def test_calibrated_pass_runs_on_every_architecture(tiny_checkpoints, model_type):
    """MoE experts the router never picks get data-free scales (and their stage's input range when static);
    AWQ skips what it cannot fold (MoE, MLA) and says so; the runtime runs the result."""
    graph = load_checkpoint(tiny_checkpoints[model_type])
    tokens = token_lists(graph.spec.vocab_size, count=2)
    ctx = PassContext(get_target("blackwell"), runner=RuntimeRunner(graph, tokens))
    (record,) = Pipeline([WeightQuantization(method="gptq", awq=True, activations="static")]).run(graph, ctx)
    quantized = [lin for lin in graph.linears.values() if lin.quant is not None]
    assert quantized and all("input_scale" in lin.quant.tensors for lin in quantized)
    idle = [n for n in record.result.notes if "saw no calibration token" in n]
    assert idle or model_type == "qwen2" or all(lin.quant.method == "awq+gptq" for lin in quantized)
    if model_type in ("mixtral", "qwen3_moe", "deepseek_v3"):
        assert any("AWQ folding supports" in n for n in record.result.notes)
    engine_from_graph(graph).logits(tokens)


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_awq_folds_keep_the_function(tiny_checkpoints, model_type):
    """Folding per-channel scales into every AWQ group (norm -> q/k/v and gate/up, v -> o, up -> down) leaves
    the model's logits as they were: Gemma's norms scale by (1 + w), so the fold divides (1 + w), not w."""
    from kiln.passes.awq_fold import awq_groups, fold_input_scale

    graph = load_checkpoint(tiny_checkpoints[model_type])
    tokens = token_lists(graph.spec.vocab_size, count=2)
    before = engine_from_graph(graph).logits(tokens)
    gen = torch.Generator().manual_seed(0)
    for layer in range(len(graph.spec.layers)):
        groups, why = awq_groups(graph, layer)
        assert not why and any(g.producer_is_norm for g in groups)
        for group in groups:
            width = graph.linears[group.consumers[0]].in_features
            scale = torch.rand(width, generator=gen) + 0.5
            if group.tie is not None:  # o_proj: the query heads reading one KV head share its channels' scale
                scale = (torch.rand(int(group.tie.max()) + 1, generator=gen) + 0.5)[group.tie]
            fold_input_scale(graph, group, scale)
    after = engine_from_graph(graph).logits(tokens)
    assert not torch.equal(graph.tensors["model.layers.0.input_layernorm.weight"],
                           load_checkpoint(tiny_checkpoints[model_type]).tensors["model.layers.0.input_layernorm.weight"])
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_nvfp4_fused_siblings_share_one_global_scale(tiny_checkpoints, method):
    """q/k/v and gate/up run as one GEMM in serving engines: one NVFP4 per-tensor scale, amax of the set / (6 * 448)."""
    from kiln.kernels.nvfp4 import nvfp4_global_scale

    graph = load_checkpoint(tiny_checkpoints["llama"])
    source = {n: graph.weight(lin).float().clone() for n, lin in graph.linears.items()}
    tokens = token_lists(graph.spec.vocab_size)
    ctx = PassContext(get_target("hopper"), runner=RuntimeRunner(graph, tokens) if method != "rtn" else None)
    Pipeline([WeightQuantization(format="nvfp4", method=method, act_order=False)]).run(graph, ctx)
    a, m = "model.layers.1.self_attn.", "model.layers.1.mlp."
    sets = [[a + "q_proj", a + "k_proj", a + "v_proj"], [m + "gate_proj", m + "up_proj"], [a + "o_proj"],
            [m + "down_proj"]]
    for names in sets:
        expected = nvfp4_global_scale(torch.cat([source[n].flatten() for n in names]))
        for n in names:
            assert torch.equal(graph.linears[n].quant.tensors["weight_scale_2"], expected), n
    assert not torch.equal(graph.linears[a + "o_proj"].quant.tensors["weight_scale_2"],
                           graph.linears[a + "q_proj"].quant.tensors["weight_scale_2"])


def test_awq_hands_the_first_stage_its_folded_statistics(tiny_checkpoints, monkeypatch):
    """q/k/v are not observed again after AWQ: their statistics are AWQ's observation divided by the folded
    scale, which is what observing the folded model gives (checked against a fresh observation), and the
    forward of every other stage stops once its linears have their inputs."""
    from kiln.calibration.observers import InputObserver

    graph = load_checkpoint(tiny_checkpoints["llama"])
    tokens = token_lists(graph.spec.vocab_size)
    runner = RuntimeRunner(graph, tokens)
    handed: dict[str, InputObserver] = {}
    original = WeightQuantization._awq

    def spy(self, graph_, session, layer, lins, result):
        derived = original(self, graph_, session, layer, lins, result)
        if layer == 1:
            handed.update(derived)
            fresh = {}
            session.observe(["model.layers.1.self_attn.q_proj"], lambda n, x: fresh.setdefault(n, []).append(x))
            x = torch.cat(fresh["model.layers.1.self_attn.q_proj"]).double()
            handed["fresh"] = (x.T @ x / x.shape[0]).float()
            # as handed over: GPTQ then takes the Hessian and factors it in place
            handed["q_hessian"] = derived["model.layers.1.self_attn.q_proj"].hessian.clone()
        return derived

    monkeypatch.setattr(WeightQuantization, "_awq", spy)
    (record,) = Pipeline([WeightQuantization(format="fp8", method="gptq", awq=True)]).run(
        graph, PassContext(get_target("hopper"), runner=runner))
    names = {f"model.layers.1.self_attn.{p}_proj" for p in "qkv"}
    assert set(handed) == names | {"fresh", "q_hessian"}
    (note,) = [n for n in record.result.notes if n.startswith("awq: layer 1:")]
    assert "q_proj alpha 0.00" not in note  # a scale was folded: the statistics really were rescaled
    torch.testing.assert_close(handed["q_hessian"], handed["fresh"], rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="taken"):  # spent by GPTQ, and saying so
        _ = handed["model.layers.1.self_attn.q_proj"].hessian


@pytest.mark.parametrize("true_sequential, awq, observations", [
    (True, True, 4),  # AWQ's observation serves q/k/v; o, gate/up and down each through the quantized stages
    (True, False, 4),
    (False, True, 1),  # one observation per block: AWQ's, every group divided by its folded scale
    (False, False, 1),
])
def test_observations_per_block(tiny_checkpoints, monkeypatch, true_sequential, awq, observations):
    from kiln.optimizer.measure.calibration_session import RuntimeCalibrationSession

    graph = load_checkpoint(tiny_checkpoints["llama"])
    tokens = token_lists(graph.spec.vocab_size)
    calls: list[int] = []
    original = RuntimeCalibrationSession.observe

    def count(self, linears, callback):
        calls.append(graph.linears[linears[0]].layer)
        return original(self, linears, callback)

    monkeypatch.setattr(RuntimeCalibrationSession, "observe", count)
    source = engine_from_graph(graph)
    Pipeline([WeightQuantization(format="fp8", method="gptq", awq=awq, true_sequential=true_sequential)]).run(
        graph, PassContext(get_target("hopper"), runner=RuntimeRunner(graph, tokens)))
    assert calls.count(1) == observations
    base = torch.log_softmax(torch.cat(source.logits(tokens)), -1)
    cand = torch.log_softmax(torch.cat(engine_from_graph(graph).logits(tokens)), -1)
    assert float((base.exp() * (base - cand)).sum(-1).mean()) < 0.01  # still a close FP8 model


def test_tuning_over_its_budget_is_skipped_and_said(tiny_checkpoints):
    """tune_steps x tune_batch_tokens x weights above tune_budget: nothing is tuned, and the notes say why."""
    results = {}
    for budget in (1e15, 1.0):
        graph = load_checkpoint(tiny_checkpoints["llama"])
        ctx = PassContext(get_target("hopper"), runner=RuntimeRunner(graph, token_lists(graph.spec.vocab_size)))
        p = WeightQuantization(format="nvfp4", method="rtn", tune_steps=3, tune_budget=budget)
        (record,) = Pipeline([p]).run(graph, ctx)
        results[budget] = ({lin.quant.method for lin in graph.linears.values() if lin.quant is not None},
                           record.result.notes)
    assert results[1e15][0] == {"rtn+tuned"}
    assert results[1.0][0] == {"rtn"}
    assert any("not tuned" in n and "tune_budget" in n for n in results[1.0][1])
    with pytest.raises(KilnError, match="tune_budget"):
        WeightQuantization(format="nvfp4", tune_steps=3, tune_budget=0)


def test_the_default_tuning_budget_is_the_devices(tiny_checkpoints):
    """tune_budget None: 2^40 token-weights where the distillation runs on a CPU, 2^50 on a GPU (1000 times the
    fp32 matmul rate); a number set in a recipe holds on either."""
    from kiln.passes.end_to_end_tuning import TUNE_BUDGETS, linear_weight_count, over_budget

    graph = load_checkpoint(tiny_checkpoints["llama"])
    weights = linear_weight_count(graph)
    steps = int(2**44 // (2048 * weights))  # between the two budgets
    assert TUNE_BUDGETS == {"cpu": 2**40, "cuda": 2**50}
    note = over_budget(graph, steps, 2048, None, "cpu")
    assert note is not None and "on cpu (tune_budget)" in note
    assert over_budget(graph, steps, 2048, None, torch.device("cuda")) is None
    assert "on cuda" in over_budget(graph, steps, 2048, 2**42, "cuda")  # a recipe's own budget
    assert over_budget(graph, steps, 2048, 2**46, "cpu") is None
    assert WeightQuantization(format="nvfp4", tune_steps=3).tune_budget is None


@pytest.mark.parametrize("true_sequential", [False, True])
def test_stage_order_widest_first_only_when_stages_are_uncoupled(tiny_checkpoints, monkeypatch, true_sequential):
    """Observed up front (not true-sequential), a block's stages quantize widest input first (down_proj's
    Hessian is freed before gate/up's GPTQ) and the stored tensors are those of input-to-output order, bit for
    bit; true-sequential keeps input-to-output order."""
    tokens = token_lists(160, count=6)
    order = []
    original = WeightQuantization._stage_order

    def recording(self, lins):
        stages = original(self, lins)
        order.append([sorted({lin.role for lin in lins if stage_of(lin) == s}) for s in stages])
        return stages

    def stored(stage_order):
        monkeypatch.setattr(WeightQuantization, "_stage_order", stage_order)
        graph = load_checkpoint(tiny_checkpoints["llama"])
        ctx = PassContext(get_target("hopper"), runner=RuntimeRunner(graph, tokens))
        Pipeline([WeightQuantization(format="fp8", method="gptq", awq=True, true_sequential=true_sequential)]).run(graph, ctx)
        return {n: dict(lin.quant.tensors) for n, lin in graph.linears.items() if lin.quant is not None}

    default = stored(recording)
    # widest first; stages of one width (q/k/v, o and gate/up all read the hidden size here) input to output
    expected = [["down"], ["k", "q", "v"], ["o"], ["gate", "up"]] if not true_sequential else \
        [["k", "q", "v"], ["o"], ["gate", "up"], ["down"]]
    assert order and all(o == expected for o in order)
    forward = stored(lambda self, lins: sorted({stage_of(lin) for lin in lins}))
    assert default.keys() == forward.keys() and default
    for name in default:
        for key, value in default[name].items():
            assert torch.equal(value, forward[name][key]), (name, key)


@pytest.mark.parametrize("tied", [True, False])
def test_distillation_tunes_the_embedding_and_the_head_that_reads_it(tmp_path, tied):
    """The embedding as a tuned tensor: unchanged it costs nothing; changed, its gradient reaches the rows of
    tokens that never occur in the text only through a tied lm_head (untied: those rows get none)."""
    from tests.tiny_models import make_tiny_checkpoint

    graph = load_checkpoint(make_tiny_checkpoint("llama", tmp_path / "m", overrides={"tie_word_embeddings": tied}))
    vocab = graph.spec.vocab_size
    tokens = token_lists(vocab, count=6)
    session = RuntimeCalibrator(tokens, max_batch_tokens=10_000).session(graph)
    embed = torch.nn.Parameter(graph.tensors[graph.embedding].float().clone())
    assert float(session.distillation({}, {graph.embedding: embed}, max_batch_tokens=10_000).loss(0)) < 1e-6
    with torch.no_grad():
        embed.mul_(1.2)
    objective = session.distillation({}, {graph.embedding: embed}, max_batch_tokens=10_000)
    assert objective.loss(0) > 1e-4
    unseen = sorted(set(range(vocab)) - {t for ts in tokens for t in ts})
    seen = sorted({t for ts in tokens for t in ts})
    assert unseen and float(embed.grad[seen].abs().sum()) > 0
    assert (float(embed.grad[unseen].abs().sum()) > 0) == tied


def test_source_samples_come_from_the_source_model(tiny_checkpoints):
    """The tuning's extra text: `count` paragraphs, each a calibration paragraph's first tokens and the
    model's continuation at temperature 1, the same on every run, and fitted by the distillation beside the
    calibration paragraphs."""
    from kiln.passes.end_to_end_tuning import SAMPLE_PROMPT_TOKENS, source_samples

    graph = load_checkpoint(tiny_checkpoints["llama"])
    tokens = token_lists(graph.spec.vocab_size, count=5)
    runner = RuntimeRunner(graph, tokens)
    samples = source_samples(graph, runner, 7, seed=3)
    assert len(samples) == 7 and samples == source_samples(graph, runner, 7, seed=3)
    for i, sample in enumerate(samples):
        assert sample[:SAMPLE_PROMPT_TOKENS] == tokens[i % 5][:SAMPLE_PROMPT_TOKENS]
        assert SAMPLE_PROMPT_TOKENS < len(sample) <= min(256, graph.spec.max_position_embeddings)
    assert samples[0] != samples[5]  # the same prompt, another seed
    plain = runner.session(graph).distillation({}, {}, max_batch_tokens=64)
    more = runner.session(graph).distillation({}, {}, max_batch_tokens=64, extra_token_lists=samples)
    assert sum(map(more.batch_tokens, range(len(more)))) == \
        sum(map(plain.batch_tokens, range(len(plain)))) + sum(map(len, samples))

