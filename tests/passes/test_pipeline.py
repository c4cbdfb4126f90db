"""Pass protocol and Pipeline: validation, ordering rules, zero matches, gate back-off and revert."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from kiln.kernels.errors import KilnError
from kiln.kernels.targets import get_target
from kiln.passes.base import Pass, PassContext, PassResult, Pipeline
from kiln.passes.gate_result import GateResult
from kiln.passes.weight_quant import WeightQuantization
from tests.passes.destructive import Scramble


@dataclass(frozen=True)
class Named(Pass):
    tag: str = ""
    name: ClassVar[str] = "named"

    def apply(self, graph, ctx):
        return PassResult(self.name, changed={"x": self.tag})


@dataclass(frozen=True)
class NeedsNamed(Named):
    name: ClassVar[str] = "needs-named"
    runs_after: ClassVar[frozenset[str]] = frozenset({"named"})


@dataclass(frozen=True)
class Last(Named):
    name: ClassVar[str] = "last"
    must_be_last: ClassVar[bool] = True


def test_ordering_rules_are_checked_before_anything_runs():
    Pipeline([Named(), NeedsNamed(), Last()])  # fine
    with pytest.raises(KilnError, match="'needs-named' must run after 'named'"):
        Pipeline([NeedsNamed(), Named()])
    with pytest.raises(KilnError, match="'last' must be the last pass"):
        Pipeline([Last(), Named()])
    # nested pipelines are flattened for the rules
    with pytest.raises(KilnError, match="must run after"):
        Pipeline([Pipeline([NeedsNamed()]), Named()])


@pytest.mark.parametrize("kwargs, message", [
    ({"format": "int3"}, "format='int3' is not allowed; choose one of fp8, nvfp4, mxfp4"),
    ({"activations": "sometimes"}, "activations='sometimes' is not allowed"),
    ({"roles": ("q", "attention")}, "roles entry='attention' is not allowed"),
    ({"granularity": "per_block"}, "granularity='per_block' is not allowed"),
])
def test_config_validation_names_value_and_allowed_set(kwargs, message):
    with pytest.raises(KilnError, match=message.replace("(", r"\(")):
        WeightQuantization(**kwargs)


def test_target_refuses_fp4_activations_on_hopper(tiny_checkpoints):
    from kiln.optimizer.loader import load_checkpoint

    graph = load_checkpoint(tiny_checkpoints["llama"])
    with pytest.raises(KilnError, match="hopper has no nvfp4 tensor cores"):
        WeightQuantization(format="nvfp4", activations="dynamic").check(graph, get_target("hopper"))
    WeightQuantization(format="nvfp4", activations="dynamic").check(graph, get_target("blackwell"))
    WeightQuantization(format="nvfp4").check(graph, get_target("hopper"))  # weight-only is fine


def test_matching_zero_layers_is_an_error(tiny_checkpoints):
    from kiln.optimizer.loader import load_checkpoint

    graph = load_checkpoint(tiny_checkpoints["llama"])
    ctx = PassContext(target=get_target("hopper"))
    with pytest.raises(KilnError, match="matched no layers"):
        Pipeline([WeightQuantization(roles=("expert",))]).run(graph, ctx)


class FakeGate:
    """Recovery falls with the total squared change of the linear weights (no model run needed)."""

    def __init__(self, graph):
        self.reference = {n: graph.weight(lin).clone() for n, lin in graph.linears.items()}
        self.calls = 0

    def __call__(self, graph, floor):
        self.calls += 1
        change = sum(float((graph.weight(lin) - self.reference[n]).pow(2).mean())
                     for n, lin in graph.linears.items())
        ppl = 5.0 * (1 + 1000 * change)
        return GateResult(ppl, 5.0, kl=change, top1=1.0, tokens=100, floor=floor)


def test_destructive_pass_backs_off_then_reverts_and_restores_weights(tiny_checkpoints):
    from kiln.optimizer.loader import load_checkpoint

    graph = load_checkpoint(tiny_checkpoints["llama"])
    before = {k: v.clone() for k, v in graph.tensors.items()}
    gate = FakeGate(graph)
    ctx = PassContext(target=get_target("hopper"), gate=gate)
    (record,) = Pipeline([Scramble()]).run(graph, ctx)
    assert record.decision == "reverted"
    assert gate.calls == 3  # the pass, then both back-offs
    assert [a["config"]["noise"] for a in record.attempts] == [1.0, 0.5, 0.5]
    assert [a["config"]["layers"] for a in record.attempts] == [99, 99, 1]
    for k, v in before.items():
        assert torch.equal(graph.tensors[k], v), f"{k} not restored after revert"


def test_first_back_off_that_passes_is_kept(tiny_checkpoints):
    from kiln.optimizer.loader import load_checkpoint

    probe = load_checkpoint(tiny_checkpoints["llama"])
    (trial,) = Pipeline([Scramble()]).run(probe, PassContext(get_target("hopper"), gate=FakeGate(probe), floor=1.0))
    r_full, r_half, r_one_layer = (a["gate"].recovery for a in trial.attempts)
    assert r_full < r_half < r_one_layer
    # a floor between the first and second attempt: the first back-off is kept
    graph = load_checkpoint(tiny_checkpoints["llama"])
    floor = (r_full + r_half) / 2
    (record,) = Pipeline([Scramble()]).run(graph, PassContext(get_target("hopper"), gate=FakeGate(graph), floor=floor))
    assert record.decision == "backed-off"
    assert record.config["noise"] == 0.5 and record.config["layers"] == 99
    assert record.gate.passed and record.gate.recovery == pytest.approx(r_half)
    fresh = load_checkpoint(tiny_checkpoints["llama"])
    name = "model.layers.1.self_attn.q_proj"  # layer 1: scrambled by the kept back-off, not by the one-layer one
    assert not torch.equal(graph.weight(name), fresh.weight(name))


@dataclass(frozen=True)
class CopyNorms(Pass):
    """Replaces norm tensors with equal copies: changes nothing the FakeGate measures."""

    name: ClassVar[str] = "copy-norms"
    default_floor: ClassVar[float] = 0.999

    def apply(self, graph, ctx):
        result = PassResult(self.name)
        for name in graph.blocks[0].norms:
            graph.tensors[name] = graph.tensors[name].clone()
            result.changed[name] = "copied"
        return result


def test_each_pass_is_judged_on_its_own_cost(tiny_checkpoints):
    """A later pass's floor applies to its recovery against the graph it started from, not the source."""
    from kiln.optimizer.loader import load_checkpoint

    graph = load_checkpoint(tiny_checkpoints["llama"])
    scramble, copy = Pipeline([Scramble(noise=0.05, layers=1), CopyNorms()]).run(
        graph, PassContext(get_target("hopper"), gate=FakeGate(graph)))
    assert scramble.decision == "kept" and 0.95 <= scramble.gate.recovery < 0.999
    # cumulative recovery is below copy-norms' floor of 0.999, yet the pass itself costs nothing
    assert copy.gate.recovery == pytest.approx(scramble.gate.recovery)
    assert copy.gate.pass_recovery == pytest.approx(1.0)
    assert copy.decision == "kept"
