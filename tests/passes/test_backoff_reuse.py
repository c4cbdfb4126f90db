"""A back-off of WeightQuantization reuses the calibration of the attempt before it (CalibrationCache).
back_off_scope "downstream": the blocks before the first one a kept linear is in are restored, the rest
recalibrated, and what it stores is exactly what a full calibration with the same keep list stores (bit for
bit). "touched" (the default): only the blocks holding a newly kept linear are recalibrated, on their kept
inputs; every other block keeps its product (the same objects). The log says what each step cost."""

from __future__ import annotations

import json

import pytest
import torch

from kiln.kernels.targets import get_target
from kiln.optimizer.loader import load_checkpoint
from kiln.optimizer.measure.runner import RuntimeRunner
from kiln.passes.base import PassContext, config_dict, run_gated
from kiln.passes.gate_result import GateResult
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


EXACT = {"back_off_scope": "downstream"}
CONFIGS = {
    # the nvfp4-w4a16 recipe's calibration (its tuning is over the CPU budget on SmolLM2)
    "nvfp4-gptq": {"format": "nvfp4", "method": "gptq", "act_order": False, **EXACT},
    # fp8's: AWQ folds (replaced tensors), one observation per block
    "fp8-awq": {"format": "fp8", "activations": "dynamic", "method": "gptq", "awq": True, "true_sequential": False,
                **EXACT},
    # tuning after calibration depends on every block: redone whole, from the same calibrated product
    "mxfp4-tuned": {"format": "mxfp4", "method": "gptq", "awq": True, "tune_steps": 3, "tune_lr": 1e-3, **EXACT},
    "lm-head-unsequential": {"format": "nvfp4", "method": "gptq", "sequential": False,
                             "roles": ("q", "k", "v", "o", "gate", "up", "down", "lm_head"), **EXACT},
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
        assert line.endswith(f"of the first calibration); reused blocks 0..{reused_to}; every block as a full "
                             "calibration with this keep list gives it")
        full_graph, full = full_build(four_blocks, tokens, config)
        assert_identical(stored(graph), stored(full_graph))
        assert result.changed == full.changed and result.metrics == full.metrics and result.skipped == full.skipped
        assert [n for n in result.notes if not n.startswith("calibration of blocks")] == full.notes
        assert all(graph.linears[k].quant is None for k in keep)


def test_blocks_before_the_first_kept_one_are_not_recalibrated(four_blocks, monkeypatch):
    from kiln.passes import block_calibration

    graph = load_checkpoint(four_blocks)
    tokens = token_lists(graph.spec.vocab_size)
    ctx = context(graph, tokens)
    config = WeightQuantization(format="nvfp4", method="gptq")
    state = graph.snapshot()
    cache = config.apply(graph, ctx).calibration
    graph.restore(state)
    quantized: list[str] = []
    real = block_calibration.quantize_sibling_weights
    monkeypatch.setattr(block_calibration, "quantize_sibling_weights",
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
    from kiln.optimizer.measure.calibration_session import RuntimeCalibrator

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
    # back_off_keep is defined by the calibration without them: with no cache that holds it, it is computed first
    lines.clear()
    step = WeightQuantization(format="nvfp4", method="gptq", back_off_keep=("model.layers.1.mlp.down_proj",))
    fresh = load_checkpoint(four_blocks)  # not the graph `cache` was calibrated on
    step.reusing(cache).apply(fresh, context(fresh, tokens, lines.append))
    assert any("calibrating without them first" in line for line in lines)
    rebuilt = load_checkpoint(four_blocks)
    step.apply(rebuilt, context(rebuilt, tokens))
    assert_identical(stored(fresh), stored(rebuilt))


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
    config = WeightQuantization(format="nvfp4", method="gptq", act_order=False, **EXACT)
    record = run_gated(config, graph, ctx)
    assert record.decision == "backed-off" and len(record.attempts) == 4
    json.dumps(record.to_json())  # no cache object in the recorded configs
    assert "reuse" not in config_dict(config.reusing(None))
    steps = [line for line in lines if line.startswith("back-off step")]
    assert [s.split(":")[0] for s in steps] == ["back-off step 1", "back-off step 2", "back-off step 3"]
    assert [s.split(": kept ")[1].split(" ")[0] for s in steps] == ["1", "2", "4"]
    keep = tuple(record.config["keep"])
    full_graph, _ = full_build(four_blocks, tokens, WeightQuantization(format="nvfp4", method="gptq",
                                                                       act_order=False, keep=keep, **EXACT))
    assert_identical(stored(graph), stored(full_graph))


@needs_stories
@pytest.mark.parametrize("tune_steps", [0, 2])
def test_on_stories260k_a_back_off_step_is_the_full_build_with_its_keep_list(tune_steps):
    """The nvfp4-w4a16 recipe's calibration on the real model (tuning shortened), downstream: the back-offs, each
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
                                max_back_offs=3, **EXACT)
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


def first_attempt(checkpoint):
    """The back-off tests' start: the four-block model calibrated once by the nvfp4-w4a16 recipe's calibration,
    as (graph, tokens, log lines, context, config, the graph's state before it, the calibration cache)."""
    graph = load_checkpoint(checkpoint)
    tokens = token_lists(graph.spec.vocab_size)
    lines: list[str] = []
    ctx = context(graph, tokens, lines.append)
    config = WeightQuantization(format="nvfp4", method="gptq", act_order=False)
    state = graph.snapshot()
    cache = config.apply(graph, ctx).calibration
    return graph, tokens, lines, ctx, config, state, cache


def quant_of(graph, layer: int) -> dict:
    return {n: lin.quant for n, lin in graph.linears.items() if lin.layer == layer}


def test_a_touched_step_recalibrates_only_the_blocks_with_a_newly_kept_linear(four_blocks, monkeypatch):
    graph, tokens, lines, ctx, config, state, cache = first_attempt(four_blocks)
    assert config.back_off_scope == "touched"  # the default
    first = {layer: quant_of(graph, layer) for layer in range(4)}
    observed: list[int] = []
    session_type = type(ctx.runner.session(graph))
    real_observe = session_type.observe
    monkeypatch.setattr(session_type, "observe", lambda self, names, cb: observed.append(
        graph.linears[names[0]].layer) or real_observe(self, names, cb))
    # step 1 keeps a linear of block 1: blocks 0, 2 and 3 keep the first attempt's product (the same objects)
    graph.restore(state)
    keep1 = ("model.layers.1.mlp.up_proj",)
    step1 = replace_config(config, keep1).reusing(cache)
    step1.apply(graph, ctx)
    assert set(observed) == {1}
    for layer in (0, 2, 3):
        assert all(graph.linears[n].quant is q for n, q in first[layer].items()), layer
    # block 0 is unchanged, so block 1's kept inputs are what it computes: an exact resume
    assert "weight-quant: calibration resumes from the kept inputs of block 1" in lines
    line = next(line for line in lines if line.startswith("back-off step 1"))
    assert "recalibrated blocks 1 (" in line and line.endswith(
        "of the first calibration); reused blocks 0, 2..3; blocks 2..3 on inputs an earlier attempt gave them")
    # block 1 saw the same inputs as in a downstream step (block 0 is unchanged): the same product, bit for bit
    exact_graph, _ = full_build(four_blocks, tokens, replace_config(config, keep1, back_off_scope="downstream"))
    assert_identical(stored_layer(graph, 1), stored_layer(exact_graph, 1))
    assert all(graph.linears[k].quant is None for k in keep1)
    # step 2 adds one of block 3: only block 3 is redone, block 1 keeps step 1's product
    block1 = quant_of(graph, 1)
    graph.restore(state)
    observed.clear()
    replace_config(config, (*keep1, "model.layers.3.self_attn.q_proj")).reusing(cache).apply(graph, ctx)
    assert set(observed) == {3}
    assert all(graph.linears[n].quant is q for n, q in block1.items())
    assert all(graph.linears[n].quant is q for n, q in first[2].items())
    assert graph.linears["model.layers.3.self_attn.q_proj"].quant is None
    assert any(line.startswith("back-off step 2: kept 2 linears in source precision, recalibrated blocks 3 (")
               for line in lines)


def test_an_inexact_resume_takes_the_checkpoint_whatever_the_blocks_before_hold(four_blocks):
    from kiln.optimizer.measure.calibration_session import RuntimeCalibrator

    graph = load_checkpoint(four_blocks)
    tokens = token_lists(graph.spec.vocab_size)
    calibrator = RuntimeCalibrator(tokens, max_batch_tokens=128)
    first = calibrator.session(graph)
    name = "model.layers.2.self_attn.o_proj"
    first.observe([name], lambda n, x: None)
    checkpoint = first.checkpoint()
    WeightQuantization(format="nvfp4", keep=tuple(n for n in graph.linears if ".layers.1." not in n)).apply(
        graph, PassContext(get_target("hopper")))
    session = calibrator.session(graph)
    assert not session.resume(checkpoint) and session.position is None
    assert session.resume(checkpoint, exact=False) and session.position == 2
    seen = []
    session.observe([name], lambda n, x: seen.append(x))  # at the checkpoint: block 1's change does not replay
    assert session.position == 2 and all(h is c for h, c in zip((b.hidden for b in session.batches),
                                                                 checkpoint.hidden, strict=True))
    assert not RuntimeCalibrator(tokens[:5]).session(graph).resume(checkpoint, exact=False)  # other batches


def test_back_off_scope_is_checked_and_not_part_of_the_cache_key():
    from kiln.kernels.errors import KilnError

    with pytest.raises(KilnError, match="back_off_scope"):
        WeightQuantization(format="nvfp4", back_off_scope="all")
    a = WeightQuantization(format="nvfp4", back_off_scope="touched")
    assert a._config_key() == WeightQuantization(format="nvfp4", back_off_scope="downstream")._config_key()


def replace_config(config: WeightQuantization, keep: tuple[str, ...], **changes) -> WeightQuantization:
    import dataclasses

    return dataclasses.replace(config, keep=keep, **changes)


def stored_layer(graph, layer: int) -> dict[str, torch.Tensor]:
    return {f"{n}.{k}": v for n, q in quant_of(graph, layer).items() if q is not None for k, v in q.tensors.items()}


def test_a_touched_step_knows_which_blocks_are_exact_and_a_downstream_one_redoes_from_there(four_blocks):
    """Keeping a linear of block 1: block 1 is recalibrated on the inputs block 0 computes (exact), blocks 2..3
    keep products of their old inputs (not exact). A downstream attempt with the same keep list then reuses
    blocks 0..1 only and stores the full calibration's bytes."""
    graph, tokens, lines, ctx, config, state, cache = first_attempt(four_blocks)
    assert [b.exact for b in cache.blocks] == [True] * 4
    keep = ("model.layers.1.mlp.up_proj",)
    graph.restore(state)
    replace_config(config, keep).reusing(cache).apply(graph, ctx)
    assert [b.exact for b in cache.blocks] == [True, True, False, False]
    graph.restore(state)
    lines.clear()
    replace_config(config, keep, back_off_scope="downstream").reusing(cache).apply(graph, ctx)
    line = next(line for line in lines if line.startswith("back-off step 2"))
    assert "recalibrated blocks 2..3 (" in line and "reused blocks 0..1;" in line
    assert [b.exact for b in cache.blocks] == [True] * 4
    full_graph, _ = full_build(four_blocks, tokens, replace_config(config, keep))
    assert_identical(stored(graph), stored(full_graph))


def test_an_exact_resume_refuses_states_an_inexact_one_led_to(four_blocks):
    """After a resume that took an earlier attempt's states as they were, the session's checkpoints carry
    the current fingerprints but not the states those blocks compute: an exact resume refuses them."""
    from kiln.optimizer.measure.calibration_session import RuntimeCalibrator

    graph = load_checkpoint(four_blocks)
    tokens = token_lists(graph.spec.vocab_size)
    calibrator = RuntimeCalibrator(tokens, max_batch_tokens=128)
    first = calibrator.session(graph)
    first.observe(["model.layers.2.self_attn.o_proj"], lambda n, x: None)
    checkpoint = first.checkpoint()
    assert checkpoint.faithful
    WeightQuantization(format="nvfp4", keep=tuple(n for n in graph.linears if ".layers.1." not in n)).apply(
        graph, PassContext(get_target("hopper")))
    session = calibrator.session(graph)
    assert session.resume(checkpoint, exact=False)
    session.observe(["model.layers.3.self_attn.o_proj"], lambda n, x: None)
    stale = session.checkpoint()
    assert stale.position == 3 and not stale.faithful
    assert not calibrator.session(graph).resume(stale)  # fingerprints match; the states are not theirs
    assert calibrator.session(graph).resume(stale, exact=False)
    fresh = calibrator.session(graph)
    fresh.observe(["model.layers.3.self_attn.o_proj"], lambda n, x: None)  # from the embedding
    assert fresh.checkpoint().faithful and calibrator.session(graph).resume(fresh.checkpoint())


def gate_passing_from(attempt_number: int, log: list[int], failing: tuple[int, ...] = ()):
    """A gate that fails attempts before `attempt_number` (1: the first attempt) and those in `failing`."""
    def gate(g, floor, *args):
        log.append(1)
        ok = len(log) >= attempt_number and len(log) not in failing
        return GateResult(perplexity=10.0 if ok else 20.0, baseline_perplexity=10.0, kl=0.0, top1=1.0, tokens=100,
                          floor=floor)
    return gate


def test_a_touched_step_that_passes_ships_and_its_recorded_config_rebuilds_it(four_blocks):
    """The default (touched steps): each step keeps its linears as back_off_keep and recalibrates only their
    blocks, every block on the inputs the first attempt gave it; the step that passes ships as it is, and the
    config the manifest records rebuilds it from scratch bit for bit (the calibration without them, then their
    blocks)."""
    graph = load_checkpoint(four_blocks)
    tokens = token_lists(graph.spec.vocab_size)
    lines: list[str] = []
    ctx = context(graph, tokens, lines.append)
    gates: list[int] = []
    ctx.gate = gate_passing_from(3, gates)  # back-off step 2 passes
    config = WeightQuantization(format="nvfp4", method="gptq", act_order=False)
    assert config.ship_exact is False  # the default
    record = run_gated(config, graph, ctx)
    assert record.decision == "backed-off" and len(record.attempts) == 3 and len(gates) == 3  # no shipping gate
    assert record.config["keep"] == [] and len(record.config["back_off_keep"]) == 2
    assert record.config["back_off_scope"] == "touched"
    steps = [line for line in lines if line.startswith("back-off step")]
    assert [s.split(":")[0] for s in steps] == ["back-off step 1", "back-off step 2"]
    rebuilds = "what its config rebuilds (back_off_keep: every block on the inputs the calibration without them gives)"
    full = "every block as a full calibration with this keep list gives it"  # the touched block was the last
    assert all(s.endswith((rebuilds, full)) for s in steps)
    kept = tuple(record.config["back_off_keep"])
    assert all(graph.linears[k].quant is None for k in kept)
    assert all(record.result.skipped[k] == "kept in source precision by the back-off (back_off_keep)" for k in kept)
    from kiln.optimizer.recipes import build_pass

    rebuilt = build_pass(json.loads(json.dumps(record.config)))  # as a recipe file names it
    assert rebuilt.back_off_keep == kept and rebuilt.keep == ()
    rebuild_lines: list[str] = []
    full_graph = load_checkpoint(four_blocks)
    rebuilt.apply(full_graph, context(full_graph, tokens, rebuild_lines.append))
    assert "weight-quant: back_off_keep (2 linears): calibrating without them first, then recalibrating the blocks " \
           "that hold them" in rebuild_lines
    assert any(line.startswith("back_off_keep, rebuilt: kept 2 linears in source precision") for line in rebuild_lines)
    assert not any(line.startswith("back-off step") for line in rebuild_lines)
    assert_identical(stored(graph), stored(full_graph))
    # what a plain keep list gives differs (its later blocks see the kept linears' outputs): that is ship_exact's
    plain_graph, _ = full_build(four_blocks, tokens, replace_config(config, kept))
    assert min(graph.linears[k].layer for k in kept) < 3  # so blocks after it were calibrated otherwise
    assert any(not torch.equal(x, stored(plain_graph)[k]) for k, x in stored(graph).items())


def test_with_ship_exact_a_touched_step_that_passes_is_recalibrated_exactly_before_it_ships(four_blocks):
    """ship_exact: the search steps recalibrate only their blocks; the passing step is redone from its first
    inexact block with its kept linears as `keep`, gated again, and what ships is bit for bit the full
    calibration with that keep list, under the config the manifest records."""
    graph = load_checkpoint(four_blocks)
    tokens = token_lists(graph.spec.vocab_size)
    lines: list[str] = []
    ctx = context(graph, tokens, lines.append)
    gates: list[int] = []
    ctx.gate = gate_passing_from(3, gates)  # back-off step 2 passes
    config = WeightQuantization(format="nvfp4", method="gptq", act_order=False, ship_exact=True)
    record = run_gated(config, graph, ctx)
    assert record.decision == "backed-off" and len(record.attempts) == 4 and len(gates) == 4
    assert "weight-quant: the back-off passed the gate; redoing its shortcuts before it ships (gated again)" in lines
    assert record.config["back_off_scope"] == "downstream" and record.config["ship_exact"] is True
    assert [a["config"]["back_off_scope"] for a in record.attempts] == ["touched"] * 3 + ["downstream"]
    steps = [line for line in lines if line.startswith("back-off step")]
    assert [s.split(":")[0] for s in steps] == ["back-off step 1", "back-off step 2", "back-off step 2, as it ships"]
    assert steps[-1].endswith("every block as a full calibration with this keep list gives it")
    assert "what its config rebuilds" in steps[1]
    keep = tuple(record.config["keep"])
    assert len(keep) == 2 and all(graph.linears[k].quant is None for k in keep)
    from kiln.optimizer.recipes import build_pass

    rebuilt = build_pass(json.loads(json.dumps(record.config)))  # as a recipe file names it
    assert rebuilt.keep == keep and rebuilt.back_off_keep == () and rebuilt.back_off_scope == "downstream"
    full_graph, _ = full_build(four_blocks, tokens, rebuilt)
    assert_identical(stored(graph), stored(full_graph))


def test_when_the_exact_recalibration_fails_the_gate_the_back_off_goes_on(four_blocks):
    graph = load_checkpoint(four_blocks)
    tokens = token_lists(graph.spec.vocab_size)
    lines: list[str] = []
    ctx = context(graph, tokens, lines.append)
    gates: list[int] = []
    ctx.gate = gate_passing_from(2, gates, failing=(3,))  # step 1 passes touched, fails exact; step 2 passes
    record = run_gated(WeightQuantization(format="nvfp4", method="gptq", act_order=False, ship_exact=True), graph,
                       ctx)
    assert "weight-quant: without its shortcuts the back-off fails the gate; backing off further" in lines
    assert record.decision == "backed-off" and len(record.config["keep"]) == 2
    assert record.config["back_off_keep"] == [] and record.config["back_off_scope"] == "downstream"
    # step 2 reused the exact product of the failed shipping attempt; it passed, and ships (exact or redone)
    full_graph, _ = full_build(four_blocks, tokens, WeightQuantization(
        format="nvfp4", method="gptq", act_order=False, keep=tuple(record.config["keep"])))
    assert_identical(stored(graph), stored(full_graph))


def test_with_ship_exact_off_the_touched_product_ships():
    cfg = WeightQuantization(format="nvfp4", method="gptq")  # ship_exact off: the default
    cache = CalibrationCache(cfg._config_key(), (), [], 1.0)
    from kiln.passes.calibration_cache import BlockProduct

    cache.blocks = [BlockProduct(0, frozenset(), {}, {}, {}, {}, [], [], 0.0, exact=False)]
    from kiln.passes.weight_quant import WeightQuantResult

    res = WeightQuantResult("weight-quant")
    res.calibration = cache
    assert cfg.shipping(res) is None
    exact_cfg = WeightQuantization(format="nvfp4", method="gptq", ship_exact=True, keep=("a",), back_off_keep=("b",))
    ship = exact_cfg.shipping(res)
    assert ship.back_off_scope == "downstream" and ship.reuse is cache and ship.keep == ("a", "b")
    assert ship.back_off_keep == ()
    cache.blocks[0].exact = True
    assert ship.shipping(res) is None  # already a full calibration's under its keep list
    assert exact_cfg.shipping(res).keep == ("a", "b")  # nothing to redo, but what ships names them keep
    from kiln.kernels.errors import KilnError

    with pytest.raises(KilnError, match="ship_exact must be true or false"):
        WeightQuantization(format="nvfp4", ship_exact="yes")


def test_unsequential_touched_steps_are_exact(four_blocks):
    """sequential=False calibrates every block on the source's inputs: a touched step moves no other block's
    inputs, so it is already the full calibration's and nothing is redone to ship it."""
    graph = load_checkpoint(four_blocks)
    tokens = token_lists(graph.spec.vocab_size)
    lines: list[str] = []
    ctx = context(graph, tokens, lines.append)
    gates: list[int] = []
    ctx.gate = gate_passing_from(2, gates)
    config = WeightQuantization(format="nvfp4", method="gptq", act_order=False, sequential=False)
    record = run_gated(config, graph, ctx)
    assert record.decision == "backed-off" and len(record.attempts) == 2  # no shipping attempt
    assert record.config["back_off_scope"] == "touched" and len(record.config["back_off_keep"]) == 1
    full_graph, _ = full_build(four_blocks, tokens, replace_config(config, tuple(record.config["back_off_keep"])))
    assert_identical(stored(graph), stored(full_graph))  # the same as a plain keep list: nothing moved


def test_back_off_keep_is_checked_and_not_part_of_the_cache_key(four_blocks):
    from kiln.kernels.errors import KilnError

    a = WeightQuantization(format="nvfp4", back_off_keep=("x", "y", "x"))
    assert a.back_off_keep == ("x", "y") and a._config_key() == WeightQuantization(format="nvfp4")._config_key()
    with pytest.raises(KilnError, match="back_off_keep must be a list of module names"):
        WeightQuantization(format="nvfp4", back_off_keep="model.layers.0.mlp.up_proj")
    graph = load_checkpoint(four_blocks)
    with pytest.raises(KilnError, match="back_off_keep names modules that do not exist: nope"):
        replace_config(a, (), back_off_keep=("nope",)).check(graph, get_target("hopper"))


def test_back_off_keep_rebuilds_bit_for_bit_when_the_cache_keeps_only_some_block_inputs(four_blocks, monkeypatch):
    """A model whose calibration states do not all fit CHECKPOINT_BYTES keeps every k-th block's inputs: a block
    between them is reached by replaying from the one before. A back_off_keep block whose replay runs through a
    block a later step recalibrates is recalibrated with it, so the steps' product is still what the recorded
    config rebuilds in one go."""
    from kiln.passes import block_calibration

    monkeypatch.setattr(block_calibration, "CHECKPOINT_BYTES", 1)  # only block 0's inputs are kept
    graph, tokens, lines, ctx, _, state, cache = first_attempt(four_blocks)
    assert [b.checkpoint is not None for b in cache.blocks] == [True, False, False, False]
    # step 1 keeps a linear of block 2; step 2 adds one of block 1, which block 2's replayed inputs run through
    later, earlier = "model.layers.2.mlp.up_proj", "model.layers.1.self_attn.o_proj"
    for kept in ((later,), (later, earlier)):
        graph.restore(state)
        WeightQuantization(format="nvfp4", method="gptq", act_order=False, back_off_keep=kept).reusing(cache).apply(
            graph, ctx)
    step2 = [line for line in lines if line.startswith("back-off step 2")]
    assert step2 and "recalibrated blocks 1..2 (" in step2[0]  # block 2 again, though its own linears are the same
    rebuilt = load_checkpoint(four_blocks)
    WeightQuantization(format="nvfp4", method="gptq", act_order=False, back_off_keep=(later, earlier)).apply(
        rebuilt, context(rebuilt, tokens))
    assert_identical(stored(graph), stored(rebuilt))
