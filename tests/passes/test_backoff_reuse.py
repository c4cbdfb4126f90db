"""A back-off of WeightQuantization reuses the calibration of the attempt before it (CalibrationCache): the
blocks before the first one a kept linear is in are restored, the rest recalibrated; what it stores is exactly
what a full calibration with the same keep list stores (bit for bit), and the log says what each step cost."""

from __future__ import annotations

import json

import pytest
import torch

from kiln.kernels.targets import get_target
from kiln.optimizer.loader import load_checkpoint
from kiln.optimizer.runner import RuntimeRunner
from kiln.passes.base import GateResult, PassContext, config_dict, run_gated
from kiln.passes.weight_quant import CalibrationCache, WeightQuantization
from tests.conftest import CALIB_TEXT, STORIES, needs_stories
from tests.tiny_models import make_tiny_checkpoint


def token_lists(vocab: int, count: int = 12, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(8, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(count)]


@pytest.fixture(scope="module")
def four_blocks(tmp_path_factory):
    """A tiny random Llama with four blocks (a kept linear in block 2 leaves blocks 0 and 1 to reuse)."""
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("reuse") / "llama4",
                                overrides={"num_hidden_layers": 4})


def context(graph, tokens, log=None):
    return PassContext(get_target("hopper"), runner=RuntimeRunner(graph, tokens, max_batch_tokens=256),
                       log=log or (lambda m: None))


def stored(graph) -> dict[str, torch.Tensor]:
    """Every tensor the artifact would take from this pass: each linear's packed tensors, and the graph's
    replaced entries (AWQ folds, tuned norms)."""
    out = {}
    for name, lin in graph.linears.items():
        if lin.quant is not None:
            out.update({f"{name}.{k}": v for k, v in lin.quant.tensors.items()})
    out.update({k: graph.tensors[k] for k in graph.tensors.overlay})
    return out


def assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k, x in a.items():
        assert x.dtype == b[k].dtype and torch.equal(x, b[k]), k


def full_build(checkpoint, tokens, config: WeightQuantization):
    graph = load_checkpoint(checkpoint)
    result = config.apply(graph, context(graph, tokens))
    return graph, result


CONFIGS = {
    # the nvfp4-w4a16 recipe's calibration (its tuning is over the CPU budget on SmolLM2)
    "nvfp4-gptq": {"format": "nvfp4", "method": "gptq", "act_order": False},
    # fp8's: AWQ folds (replaced tensors), one observation per block
    "fp8-awq": {"format": "fp8", "activations": "dynamic", "method": "gptq", "awq": True, "true_sequential": False},
    # tuning after calibration depends on every block: redone whole, from the same calibrated product
    "mxfp4-tuned": {"format": "mxfp4", "method": "gptq", "awq": True, "tune_steps": 3, "tune_lr": 1e-3},
    "lm-head-unsequential": {"format": "nvfp4", "method": "gptq", "sequential": False,
                             "roles": ("q", "k", "v", "o", "gate", "up", "down", "lm_head")},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_reusing_attempt_stores_what_a_full_calibration_stores(four_blocks, name):
    graph = load_checkpoint(four_blocks)
    tokens = token_lists(graph.spec.vocab_size)
    lines: list[str] = []
    ctx = context(graph, tokens, lines.append)
    first_config = WeightQuantization(**CONFIGS[name])
    state = graph.snapshot()
    first = first_config.apply(graph, ctx)
    cache = first.calibration
    assert isinstance(cache, CalibrationCache) and [b.layer for b in cache.blocks][:4] == [0, 1, 2, 3]
    assert any(line.startswith("weight-quant: calibrated blocks 0..") for line in lines)
    # keep one linear of block 2, then one more of block 3: the second step reuses the first's blocks 0..2
    for step, keep in enumerate((("model.layers.2.mlp.up_proj",),
                                 ("model.layers.2.mlp.up_proj", "model.layers.3.self_attn.q_proj")), 1):
        graph.restore(state)
        config = WeightQuantization(**CONFIGS[name], keep=keep)
        result = config.reusing(cache).apply(graph, ctx)
        reused_to = 1 if step == 1 else 2
        line = next(line for line in lines if line.startswith("back-off step"))
        # the session starts at the first recalibrated block's kept inputs, not from the embedding
        assert f"weight-quant: calibration resumes from the kept inputs of block {reused_to + 1}" in lines
        lines.clear()
        assert line.startswith(f"back-off step {step}: kept {len(keep)} linears in source precision, recalibrated "
                               f"blocks {reused_to + 1}")
        assert line.endswith(f"of the first calibration); reused blocks 0..{reused_to}")
        full_graph, full = full_build(four_blocks, tokens, config)
        assert_identical(stored(graph), stored(full_graph))
        assert result.changed == full.changed and result.metrics == full.metrics and result.skipped == full.skipped
        assert [n for n in result.notes if not n.startswith("calibration of blocks")] == full.notes
        assert all(graph.linears[k].quant is None for k in keep)


def test_blocks_before_the_first_kept_one_are_not_recalibrated(four_blocks, monkeypatch):
    from kiln.passes import weight_quant

    graph = load_checkpoint(four_blocks)
    tokens = token_lists(graph.spec.vocab_size)
    ctx = context(graph, tokens)
    config = WeightQuantization(format="nvfp4", method="gptq")
    state = graph.snapshot()
    cache = config.apply(graph, ctx).calibration
    graph.restore(state)
    quantized: list[str] = []
    real = weight_quant.quantize_sibling_weights
    monkeypatch.setattr(weight_quant, "quantize_sibling_weights",
                        lambda ws, *a, **k: quantized.append(len(ws)) or real(ws, *a, **k))
    observed: list[int] = []
    session_type = type(ctx.runner.session(graph))
    real_observe = session_type.observe
    monkeypatch.setattr(session_type, "observe", lambda self, names, cb: observed.append(
        graph.linears[names[0]].layer) or real_observe(self, names, cb))
    replace_keep = WeightQuantization(format="nvfp4", method="gptq", keep=("model.layers.3.mlp.down_proj",))
    replace_keep.reusing(cache).apply(graph, ctx)
    assert set(observed) == {3}  # blocks 0..2 restored: neither observed nor quantized again
    assert len(quantized) == 3  # q/k/v, o, gate/up of block 3 (down_proj kept)


def test_a_session_resumes_only_where_the_graph_is_what_the_checkpoint_went_through(four_blocks):
    from kiln.optimizer.calibrator import RuntimeCalibrator

    graph = load_checkpoint(four_blocks)
    tokens = token_lists(graph.spec.vocab_size)
    calibrator = RuntimeCalibrator(tokens, max_batch_tokens=128)
    seen: dict[str, list[torch.Tensor]] = {}
    name = "model.layers.2.self_attn.o_proj"
    first = calibrator.session(graph)
    first.observe([name], lambda n, x: seen.setdefault("replayed", []).append(x))
    checkpoint = first.checkpoint()
    assert checkpoint.position == 2 and checkpoint.nbytes >= 4 * sum(map(len, tokens)) * graph.spec.hidden_size  # padded batches
    second = calibrator.session(graph)
    assert second.resume(checkpoint) and second.position == 2
    second.observe([name], lambda n, x: seen.setdefault("resumed", []).append(x))
    assert all(torch.equal(a, b) for a, b in zip(seen["replayed"], seen["resumed"], strict=True))
    # block 1 changes: the checkpoint no longer describes the graph, and a session refuses it
    WeightQuantization(format="nvfp4", keep=tuple(n for n in graph.linears if ".layers.1." not in n)).apply(
        graph, PassContext(get_target("hopper")))
    assert not calibrator.session(graph).resume(checkpoint)
    assert not RuntimeCalibrator(tokens[:5]).session(graph).resume(checkpoint)  # other batches


def test_a_cache_from_another_graph_or_config_is_not_used(four_blocks):
    graph = load_checkpoint(four_blocks)
    tokens = token_lists(graph.spec.vocab_size)
    lines: list[str] = []
    ctx = context(graph, tokens, lines.append)
    cache = WeightQuantization(format="nvfp4", method="gptq").apply(graph, ctx).calibration
    other = load_checkpoint(four_blocks)
    keep = ("model.layers.3.mlp.down_proj",)
    WeightQuantization(format="nvfp4", method="gptq", keep=keep).reusing(cache).apply(
        other, context(other, tokens, lines.append))
    assert "the graph is not the one it was calibrated on" in lines[-2]
    third = load_checkpoint(four_blocks)
    ctx3 = context(third, tokens, lines.append)
    state = third.snapshot()
    cache3 = WeightQuantization(format="nvfp4", method="gptq").apply(third, ctx3).calibration
    third.restore(state)
    WeightQuantization(format="nvfp4", method="gptq", damping=0.02, keep=keep).reusing(cache3).apply(third, ctx3)
    assert "its config differs beyond the keep list" in lines[-2]


def test_gated_back_offs_reuse_and_record_plain_configs(four_blocks):
    """Through run_gated, as a build runs it: every step reuses the attempt before it, the manifest's configs
    carry no cache, and the steps' artifact is the full calibration's with the same keep list."""
    graph = load_checkpoint(four_blocks)
    tokens = token_lists(graph.spec.vocab_size)
    lines: list[str] = []
    ctx = context(graph, tokens, lines.append)
    attempts = []

    def gate(g, floor, *args):  # the fourth attempt (third back-off step) passes
        attempts.append(1)
        recovery = 0.5 if len(attempts) < 4 else 1.0
        return GateResult(perplexity=10 / recovery, baseline_perplexity=10.0, kl=0.0, top1=1.0, tokens=100,
                          floor=floor)

    ctx.gate = gate
    config = WeightQuantization(format="nvfp4", method="gptq", act_order=False)
    record = run_gated(config, graph, ctx)
    assert record.decision == "backed-off" and len(record.attempts) == 4
    json.dumps(record.to_json())  # no cache object in the recorded configs
    assert "reuse" not in config_dict(config.reusing(None))
    steps = [line for line in lines if line.startswith("back-off step")]
    assert [s.split(":")[0] for s in steps] == ["back-off step 1", "back-off step 2", "back-off step 3"]
    assert [s.split(": kept ")[1].split(" ")[0] for s in steps] == ["1", "2", "4"]
    keep = tuple(record.config["keep"])
    full_graph, _ = full_build(four_blocks, tokens, WeightQuantization(format="nvfp4", method="gptq",
                                                                       act_order=False, keep=keep))
    assert_identical(stored(graph), stored(full_graph))


@needs_stories
@pytest.mark.parametrize("tune_steps", [0, 2])
def test_on_stories260k_a_back_off_step_is_the_full_build_with_its_keep_list(tune_steps):
    """The nvfp4-w4a16 recipe's calibration on the real model (tuning shortened): the gated back-offs, each
    reusing the one before, store exactly what a full calibration with the last step's keep list stores."""
    from kiln.calibration.data import load_token_lists
    from kiln.runtime.engine import load_tokenizer

    tokens = load_token_lists(load_tokenizer(STORIES), CALIB_TEXT, 48)
    graph = load_checkpoint(STORIES)
    lines: list[str] = []
    ctx = context(graph, tokens, lines.append)
    ctx.gate = lambda g, floor, *args: GateResult(perplexity=20.0, baseline_perplexity=10.0, kl=0.0, top1=1.0,
                                                  tokens=100, floor=floor)  # never passes: every step runs
    config = WeightQuantization(format="nvfp4", method="gptq", act_order=False, tune_steps=tune_steps,
                                max_back_offs=3)
    state = graph.snapshot()
    first = config.apply(graph, ctx)
    steps = list(config.back_offs(graph, first))  # the configs, each holding the cache (not yet cleared)
    for step in steps:
        graph.restore(state)
        step.apply(graph, ctx)
    assert sum(line.startswith("back-off step") for line in lines) == 3
    full_graph = load_checkpoint(STORIES)
    full = WeightQuantization(format="nvfp4", method="gptq", act_order=False, tune_steps=tune_steps,
                              keep=steps[-1].keep)
    full.apply(full_graph, context(full_graph, tokens))
    assert_identical(stored(graph), stored(full_graph))
