"""What a pass's gate measures and decides.

    PassMetric      a figure a pass declares for its own gate, beside recovery (measured on two ExecutedGraphs)
    MetricResult    one such figure measured, against its floor
    GateResult      the gate's verdict on a candidate: recovery, KL and top-1 against their floors, the pass's own
                    figures, and why a result is not plausible
    Gate            what evaluates a graph through the runtime (optimizer.gate builds it)

The pass protocol and the pipeline that calls the gate are passes/base.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class ExecutedGraph(Protocol):
    """A graph as the runtime executes it (the gate hands a pass metric two of these)."""

    def logits(self, token_lists: Sequence[Sequence[int]]) -> list[Any]:
        """Full-sequence logits [len, vocab] per token list."""


@dataclass(frozen=True)
class PassMetric:
    """A figure a pass declares for its own gate, next to recovery: e.g. "logits identical to the graph
    before me" for a fusion, acceptance length for a draft head. The gate measures it through the runtime on
    its held-out text, `measure(candidate, before, token_lists)`, where `before` runs the graph as the pass
    found it, and the pass is kept only when the value clears `floor`."""

    name: str
    floor: float
    measure: Callable[[ExecutedGraph, ExecutedGraph, Sequence[Sequence[int]]], float]
    higher_is_better: bool = True


@dataclass(frozen=True)
class MetricResult:
    name: str
    value: float
    floor: float
    higher_is_better: bool = True

    @property
    def passed(self) -> bool:
        return self.value >= self.floor if self.higher_is_better else self.value <= self.floor

    def to_json(self) -> dict:
        return {"name": self.name, "value": round(float(self.value), 8), "floor": self.floor,
                "higher_is_better": self.higher_is_better, "passed": self.passed}


MAX_PLAUSIBLE_RECOVERY = 1.25
MAX_PLAUSIBLE_KL = 2.0  # nats per token


@dataclass(frozen=True)
class GateResult:
    """Figures against the source model, and the floors a pass is held to. Like recovery, KL and top-1 are
    judged on what the pass costs itself (`pass_kl`, `pass_top1`); max_kl / min_top1 None: not judged."""

    perplexity: float
    baseline_perplexity: float
    kl: float  # mean per-token KL(baseline || candidate), nats
    top1: float  # fraction of positions whose argmax agrees with the baseline
    tokens: int
    floor: float  # least pass_recovery
    seconds: float | None = None
    # recovery of the graph this pass started from (1.0 for the first pass): in a pipeline each pass is
    # judged on what it costs itself, so a KV pass after a weight pass is not charged for the weights
    reference_recovery: float = 1.0
    metrics: tuple[MetricResult, ...] = ()  # the pass's own declared figures (Pass.metrics)
    max_kl: float | None = None  # most pass_kl, nats/token
    min_top1: float | None = None  # least pass_top1
    reference_kl: float = 0.0  # KL and top-1 of the graph this pass started from (0 and 1 for the first pass)
    reference_top1: float = 1.0
    # 95% paired-bootstrap interval on `recovery` over the scored documents (optimizer.measure.gate.recovery_interval)
    recovery_interval: tuple[float, float] | None = None

    @property
    def recovery(self) -> float:
        """Against the source model: ppl_source / ppl_candidate."""
        return self.baseline_perplexity / self.perplexity

    @property
    def pass_recovery(self) -> float:
        """This pass's own cost: recovery relative to the graph before it. The floor applies to this."""
        return self.recovery / self.reference_recovery

    @property
    def pass_kl(self) -> float:
        """The KL this pass added. KL to the source adds up, to first order, over small independent errors,
        so a pass after another is charged for its own."""
        return self.kl - self.reference_kl

    @property
    def pass_top1(self) -> float:
        """Top-1 agreement plus what the graph before this pass had already lost (1 - reference_top1): to first
        order, its own agreement had it run first."""
        return self.top1 + (1.0 - self.reference_top1)

    @property
    def floors_held(self) -> dict[str, bool]:
        """Each floor and whether it held: recovery, KL (a ceiling) and top-1."""
        return {"recovery": self.pass_recovery >= self.floor,
                "kl": self.max_kl is None or self.pass_kl <= self.max_kl,
                "top1": self.min_top1 is None or self.pass_top1 >= self.min_top1}

    @property
    def suspect(self) -> str | None:
        """Why these figures cannot come from a faithful candidate, or None. A rewrite of the same model does
        not beat it by a quarter, and a KL of nats per token is another model: such a result is a bug signal
        (the wrong baseline, an artifact read without its scales), never a pass."""
        if self.recovery > MAX_PLAUSIBLE_RECOVERY:
            return (f"recovery {self.recovery:.4g} is far above 1: the baseline is probably not this "
                    "candidate's source")
        if self.kl > MAX_PLAUSIBLE_KL:
            return f"KL {self.kl:.4g} nats/token: the candidate is not a faithful rewrite of the baseline"
        return None

    @property
    def failures(self) -> list[str]:
        """One phrase per floor that did not hold (empty when all did)."""
        held, out = self.floors_held, []
        if not held["recovery"]:
            out.append(f"recovery {self.pass_recovery:.4f} is below the floor {self.floor}")
        if not held["kl"]:
            out.append(f"KL {self.pass_kl:.4g} nats/token is above the ceiling {self.max_kl}")
        if not held["top1"]:
            out.append(f"top-1 agreement {self.pass_top1:.4f} is below the floor {self.min_top1}")
        return out

    @property
    def passed(self) -> bool:
        return all(self.floors_held.values()) and self.suspect is None and all(m.passed for m in self.metrics)

    def to_json(self, timings: bool = True) -> dict:
        out = {"perplexity": round(self.perplexity, 6), "baseline_perplexity": round(self.baseline_perplexity, 6),
               "recovery": round(self.recovery, 6), "pass_recovery": round(self.pass_recovery, 6),
               "kl": round(self.kl, 8), "pass_kl": round(self.pass_kl, 8), "top1": round(self.top1, 6),
               "pass_top1": round(self.pass_top1, 6), "tokens": self.tokens, "floor": self.floor,
               "max_kl": self.max_kl, "min_top1": self.min_top1, "held": self.floors_held, "passed": self.passed}
        if self.recovery_interval is not None:
            out["recovery_low"], out["recovery_high"] = (round(x, 6) for x in self.recovery_interval)
        if self.suspect:
            out["suspect"] = self.suspect
        if self.metrics:
            out["metrics"] = [m.to_json() for m in self.metrics]
        if timings:
            out["seconds"] = None if self.seconds is None else round(self.seconds, 3)
        return out


Gate = Callable[..., GateResult]
"""gate(graph, floor, metrics=(), before=None): recovery against the source, plus each PassMetric measured
against `before` (the graph as the pass found it)."""
