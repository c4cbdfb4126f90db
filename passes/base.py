"""The pass protocol, pass results, the gate hook and `Pipeline` (a sequence of passes is itself a pass).

A pass is a frozen dataclass whose fields are its config, validated in `__post_init__` with messages that
name the bad value and the allowed set, plus `apply(graph, ctx) -> PassResult`. It keeps no state between
runs. It declares:
    name            how recipes and reports call it
    default_floor   the minimum recovery its gate accepts unless the user sets one
    default_max_kl  the most mean KL (nats/token) it may add, unless the user sets a ceiling
    default_min_top1  the least top-1 agreement it may keep, unless the user sets a floor
    runs_after      names of passes that must come earlier when both are in a pipeline
    must_be_last    e.g. kernel fusion
    back_offs()     an ordered series of more conservative configs to try when the gate fails

`Pipeline.apply` checks the ordering rules before anything runs, then for each pass: snapshot, apply, gate;
on failure, restore and try each back-off in turn; if none passes, restore and record "reverted".
A gate passes when all three floors hold (recovery, KL, top-1) and every figure the pass declares clears its
own: recovery alone is fooled by text the model barely predicts, where a candidate can match the baseline's
perplexity while disagreeing with it everywhere. What the gate measures and returns: passes/gate_result.py.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from kiln.calibration import progress
from kiln.kernels.errors import KilnError
from kiln.kernels.targets import Target
from kiln.passes.gate_result import Gate, GateResult, PassMetric
from kiln.passes.graph import ModelGraph, QuantizedWeight


def _shown(value: object) -> str:
    """A config value as a recipe writes it, for a one-line message (YAML's true/false/null, a clipped repr)."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    text = repr(value)
    return text if len(text) <= 60 else text[:59] + "…"


def _bound(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


def check_range(field_name: str, value: object, low: float | None = None, high: float | None = None, *,
                integer: bool = False, low_open: bool = False, high_open: bool = False, optional: bool = False,
                why: str = "") -> None:
    """Refuse a numeric config field outside its range, in one line naming the value and the range: a bool is
    not a number, a number is finite, an integer field takes integers only (2.5 is not a width), `high` bounds
    a field whose cost grows with it (`why` says what grows). None passes when `optional`. Every pass config
    validates its numbers through this in __post_init__, so a recipe is refused when it is parsed."""
    if optional and value is None:
        return
    kinds = int if integer else (int, float)
    ok = not isinstance(value, bool) and isinstance(value, kinds)
    if ok and isinstance(value, float):
        ok = math.isfinite(value)  # not for ints: a huge one would overflow the conversion, and is compared below
    if ok:
        ok = (low is None or (value > low if low_open else value >= low)) and \
             (high is None or (value < high if high_open else value <= high))
    if ok:
        return
    kind = ("an integer" if integer else "a finite number")
    if low is not None and high is not None:
        where = f"in {'(' if low_open else '['}{_bound(low)}, {_bound(high)}{')' if high_open else ']'}"
    elif low is not None:
        where = f"{'>' if low_open else '>='} {_bound(low)}"
    elif high is not None:
        where = f"{'<' if high_open else '<='} {_bound(high)}"
    else:
        where = ""
    extra = f"{' or null' if optional else ''}{f' ({why})' if why else ''}"
    raise KilnError(f"{field_name} must be {kind} {where}{extra}, got {_shown(value)}".replace("  ", " "))


# Upper bounds of the config fields whose cost grows with them (check_range states them in its message): far
# above any recipe's (the built-ins tune 200-1200 steps of 2048-4096 tokens), far below a run that never ends
MAX_STEPS = 100_000  # tuning, healing and draft-training steps
MAX_BATCH_TOKENS = 1 << 20  # tokens per tuning / healing / training step
MAX_PARAGRAPHS = 100_000  # calibration paragraphs a sensitivity probe or a logit check runs on
MAX_SAMPLES = 100_000  # texts a pass generates to train on
MAX_BACK_OFFS = 64  # back-off steps, each one more gate evaluation
MAX_SEED = 2**32 - 1  # seeds: what every generator takes (numpy's legacy one stops at 2^32 - 1)
MAX_LR = 1.0  # learning rates: Adam's step is about lr per parameter; above 1 it only diverges
STEPS_WHY = "each step costs a forward and a backward pass"


@dataclass
class PassResult:
    """What a pass did: every module it changed (and to what), every one it skipped (and why)."""

    name: str
    changed: dict[str, str] = field(default_factory=dict)  # module -> what it became
    skipped: dict[str, str] = field(default_factory=dict)  # module -> why it was left alone
    metrics: dict[str, float] = field(default_factory=dict)  # e.g. module -> relative weight error
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"name": self.name, "changed": dict(sorted(self.changed.items())),
                "skipped": dict(sorted(self.skipped.items())),
                "metrics": {k: round(float(v), 8) for k, v in sorted(self.metrics.items())},
                "notes": list(self.notes)}


class Distillation(Protocol):
    """KL(source || graph with tuned weights and norms swapped in), batch by batch, differentiable."""

    def loss(self, step: int) -> Any:
        """The loss of step `step`'s batch (batches cycle over the calibration tokens)."""

    def __len__(self) -> int:
        """Number of batches."""

    def batch_tokens(self, step: int) -> int:
        """The real (non-padding) tokens of step `step`'s batch."""


class CalibrationSession(Protocol):
    """Per-linear inputs on the calibration tokens, one block at a time, through the graph as it stands; its
    source (for distillation) is the graph as it stood when the session was opened."""

    tokens: int  # the real (non-padding) tokens an observation sees
    all_token_lists: Sequence[Sequence[int]]  # every calibration paragraph the distillation fits
    device: Any  # a torch.device: where observed inputs arrive and the distillation's parameters must live

    def observe(self, linears: Sequence[str], callback: Callable[[str, Any], None]) -> None:
        """Call callback(name, x [tokens, in_features]) with the inputs of `linears` (all in one block, or the
        lm_head), batch by batch; the blocks before theirs run as the graph is now (sequential calibration:
        what a pass already quantized is quantized)."""

    def distillation(self, weights: Mapping[str, Callable[[], Any]], norms: Mapping[str, Any],
                     max_batch_tokens: int = 4096, extra_token_lists: Sequence[Sequence[int]] = ()) -> Distillation:
        """The end-to-end tuning objective: `weights` (linear -> its current fp32 weight) and `norms` (norm
        weight -> a parameter) replace the graph's in the student; the teacher is the session's source. It fits
        every calibration paragraph plus `extra_token_lists` (e.g. the source model's own samples)."""


class ModelRunner(Protocol):
    """Everything a pass asks of the model, answered by running it with the runtime's numerics on the
    calibration tokens; implemented in optimizer/measure/runner.py (passes/ never imports the runtime)."""

    calibration_tokens: Sequence[Sequence[int]]  # tokenized calibration paragraphs (calibration.txt)
    # every calibration paragraph the build tokenized: what distillation fits (calibration_tokens, which
    # observation runs on, may be the first few hundred of them)
    all_token_lists: Sequence[Sequence[int]]

    def session(self, graph: ModelGraph) -> CalibrationSession:
        """Open a calibration session on the graph as it stands (observe linears' inputs; distillation)."""

    def capture_kv(self, graph: ModelGraph) -> dict[int, tuple[Any, ...]]:
        """K/V activations on the calibration tokens, as the runtime's cache would receive them (post-RoPE):
        layer -> one [tokens, heads, dim] tensor per cached stream."""

    def logit_kl(self, graph: ModelGraph, paragraphs: int) -> float:
        """Mean per-token KL(source model || graph as it stands) of the final logits on the first
        `paragraphs` calibration paragraphs: what precision passes rank groups by."""

    def estimated_kl(self, graph: ModelGraph, candidates: Mapping[Any, Mapping[str, QuantizedWeight | None]],
                     paragraphs: int) -> dict[Any, float]:
        """Per candidate key (a set of linears with the quantized weight each would take), the KL(graph as it
        stands || graph with that candidate) estimated to second order from one gradient pass on the first
        `paragraphs` calibration paragraphs: a cheaper, noisier stand-in for one logit_kl probe per key."""

    def logits(self, graph: ModelGraph, token_lists: Sequence[Sequence[int]]) -> list[Any]:
        """Full-sequence logits [len, vocab] of the graph as it stands, per token list."""

    def generate(self, graph: ModelGraph, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 temperature: float = 0.0, seed: int | None = None,
                 stop_ids: Sequence[int] = ()) -> list[list[int]]:
        """Continuations (token ids) of `prompts` by the graph as it stands, through the runtime: greedy, or
        sampled at `temperature` (prompt i with its own generator seeded `seed + i`), each ending at one of
        `stop_ids` (included) or after `max_new_tokens`."""

    def draft_distillation(self, graph: ModelGraph, module: Any, init: Mapping[str, Any],
                           extra_token_lists: Sequence[Sequence[int]], max_batch_tokens: int = 2048,
                           unroll: int = 2) -> Any:
        """A draft module's self-distillation objective on every calibration paragraph plus `extra_token_lists`
        (e.g. the graph's own generations), against the graph as it stands, drafting `unroll` steps ahead (EAGLE-3's
        training-time test):
        `.parameters` (tensor name -> trainable tensor, from `init`), `.loss(step)` (forward and backward on one
        batch), `len()` and `.batch_tokens(step)` (optimizer.measure.draft_training)."""

    def resumed_head(self, path: str, graph: ModelGraph, module: Any,
                     init: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
        """The draft head of artifact `path`, of `module`'s structure and from `graph`'s source, under `init`'s
        names in place of it, and a note saying where it came from; a one-line KilnError when it cannot be
        (optimizer.measure.draft_resume)."""


@dataclass
class PassContext:
    """What the driver hands every pass. Passes read it; they never keep it."""

    target: Target
    gate: Gate | None = None  # evaluates the graph through the runtime's numerics
    floor: float | None = None  # overrides every pass's default_floor when set
    max_kl: float | None = None  # overrides every pass's default_max_kl when set
    min_top1: float | None = None  # overrides every pass's default_min_top1 when set
    runner: ModelRunner | None = None  # runs the model on calibration text; None: no calibration text
    log: Callable[[str], None] = lambda message: None


@dataclass
class PassRecord:
    """One pass's life in a pipeline: the configs tried, their results and gates, and the decision."""

    name: str
    config: dict
    decision: str  # "kept", "backed-off", "reverted", "ungated"
    result: PassResult
    gate: GateResult | None
    attempts: list[dict] = field(default_factory=list)

    def to_json(self, timings: bool = True) -> dict:
        return {"name": self.name, "config": self.config, "decision": self.decision,
                "result": self.result.to_json(),
                "gate": None if self.gate is None else self.gate.to_json(timings),
                "attempts": [{**{k: v for k, v in a.items() if timings or k != "apply_seconds"},
                              "gate": None if a["gate"] is None else a["gate"].to_json(timings)}
                             for a in self.attempts]}


def config_dict(p: Pass) -> dict:
    return {"pass": p.name, **{f.name: _jsonable(getattr(p, f.name)) for f in dataclasses.fields(p)}}


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, Pass):
        return config_dict(value)
    return value


class Pass(abc.ABC):
    """Base for passes. Subclasses are `@dataclass(frozen=True)` and implement `apply`."""

    name: ClassVar[str] = "pass"
    default_floor: ClassVar[float] = 0.99
    # beside a 0.99 recovery floor, the KL and top-1 floors of FP8 W8A8 (passes/weight_quant.py
    # DEFAULT_MAX_KL): a pass that declares none is held to what FP8 costs
    default_max_kl: ClassVar[float] = 0.02
    default_min_top1: ClassVar[float] = 0.91
    runs_after: ClassVar[frozenset[str]] = frozenset()
    must_be_last: ClassVar[bool] = False
    # what the pass rewrites that a second such pass in one pipeline could not rewrite again (the weights' format,
    # the KV cache's format, the attention's structure, the draft module): two passes that claim the same are
    # refused before anything runs (Pipeline), instead of one silently overriding the other or failing late
    exclusive: ClassVar[str | None] = None

    @abc.abstractmethod
    def apply(self, graph: ModelGraph, ctx: PassContext) -> PassResult:
        """Rewrite `graph` in place and report every change and skip."""

    def back_offs(self, graph: ModelGraph, result: PassResult) -> Iterator[Pass]:
        """More conservative configs, most aggressive first. The default: none (a failed gate reverts)."""
        return iter(())

    def shipping(self, result: PassResult) -> Pass | None:
        """For a back-off config whose attempt (`result`) passed the gate: the config to apply and gate again in
        its place before it ships, or None (it ships as it is; the default). A pass whose back-off steps take
        shortcuts (WeightQuantization: blocks on an earlier attempt's inputs) redoes them here."""
        return None

    def check(self, graph: ModelGraph, target: Target) -> None:
        """Refuse, before anything runs, what this graph or target cannot do. Raise KilnError."""

    def conflict(self, earlier: Pass) -> str | None:
        """Why this pass cannot follow `earlier` in one pipeline, or None. The default: both claim the same
        `exclusive` part of the model."""
        if self.exclusive is not None and self.exclusive == earlier.exclusive:
            return f"both set the {self.exclusive}"
        return None

    def floor(self, ctx: PassContext) -> float:
        return ctx.floor if ctx.floor is not None else self.default_floor

    def max_kl(self, ctx: PassContext) -> float:
        return ctx.max_kl if ctx.max_kl is not None else self.default_max_kl

    def min_top1(self, ctx: PassContext) -> float:
        return ctx.min_top1 if ctx.min_top1 is not None else self.default_min_top1

    def metrics(self) -> tuple[PassMetric, ...]:
        """Figures this pass's gate checks beside recovery. The default: none."""
        return ()


@dataclass(frozen=True)
class Pipeline(Pass):
    """An ordered list of passes; itself a pass. Ordering rules are checked on construction."""

    passes: tuple[Pass, ...] = ()
    name: ClassVar[str] = "pipeline"

    def __post_init__(self):
        object.__setattr__(self, "passes", tuple(self.passes))
        for p in self.passes:
            if not isinstance(p, Pass):
                raise TypeError(f"Pipeline takes Pass instances, got {type(p).__name__}")
        flat = self.flat()
        names = [p.name for p in flat]
        for i, p in enumerate(flat):
            for earlier in p.runs_after:
                if earlier in names[i + 1:]:
                    raise KilnError(f"pass order: {p.name!r} must run after {earlier!r}; "
                                    f"got order {' -> '.join(names)}")
            if p.must_be_last and i != len(flat) - 1:
                raise KilnError(f"pass order: {p.name!r} must be the last pass; got order {' -> '.join(names)}")
            for earlier in flat[:i]:
                why = p.conflict(earlier)
                if why is not None:
                    both = f"two {p.name!r} passes" if p.name == earlier.name else f"{earlier.name!r} and {p.name!r}"
                    raise KilnError(f"recipe conflict: {both} {why}; only one can apply, keep one (got order "
                                    f"{' -> '.join(names)})")

    def flat(self) -> list[Pass]:
        out: list[Pass] = []
        for p in self.passes:
            out.extend(p.flat() if isinstance(p, Pipeline) else [p])
        return out

    def check(self, graph: ModelGraph, target: Target) -> None:
        for p in self.flat():
            p.check(graph, target)

    def apply(self, graph: ModelGraph, ctx: PassContext) -> PassResult:
        records = self.run(graph, ctx)
        result = PassResult(self.name)
        for rec in records:
            for module, what in rec.result.changed.items():
                result.changed[module] = f"{rec.name}: {what}"
            result.notes.append(f"{rec.name}: {rec.decision}")
        return result

    def run(self, graph: ModelGraph, ctx: PassContext) -> list[PassRecord]:
        """Apply every pass with its gate and back-offs; return one record per pass."""
        self.check(graph, ctx.target)
        records: list[PassRecord] = []
        reference: GateResult | None = None
        for p in self.flat():
            with progress.stage(f"pass {p.name}"):
                record = run_gated(p, graph, ctx, reference)
            if record.gate is not None and record.decision != "reverted":
                reference = record.gate
            records.append(record)
        return records


def run_gated(p: Pass, graph: ModelGraph, ctx: PassContext, reference: GateResult | None = None) -> PassRecord:
    """Apply `p`, gate it, back off or revert. The floors apply to what the pass costs relative to
    `reference`, the source-relative gate figures of the graph as the pass found it (None: the source)."""
    state = graph.snapshot()
    before = graph.copy_of(state) if p.metrics() else None
    floor, max_kl, min_top1 = p.floor(ctx), p.max_kl(ctx), p.min_top1(ctx)
    judged = {"max_kl": max_kl, "min_top1": min_top1}
    if reference is not None:
        judged.update(reference_recovery=reference.recovery, reference_kl=reference.kl,
                      reference_top1=reference.top1)
    attempts: list[dict] = []

    def attempt(candidate: Pass) -> tuple[PassResult, GateResult | None]:
        start = time.perf_counter()
        result = candidate.apply(graph, ctx)
        if not result.changed:
            raise KilnError(f"pass {candidate.name!r} matched no layers: "
                            + ("; ".join(f"{k}: {v}" for k, v in list(result.skipped.items())[:3]) or "nothing to do"))
        gate = None
        if ctx.gate is not None:
            metrics = candidate.metrics()
            gate = ctx.gate(graph, floor, metrics, before) if metrics else ctx.gate(graph, floor)
        if gate is not None:
            gate = dataclasses.replace(gate, **judged)
        attempts.append({"config": config_dict(candidate), "changed": len(result.changed),
                         "skipped": len(result.skipped), "gate": gate,
                         "apply_seconds": round(time.perf_counter() - start, 3)})
        if gate is not None:
            ctx.log(f"{candidate.name}: recovery {gate.recovery:.4f}, this pass {gate.pass_recovery:.4f} (floor {floor}), "
                    f"KL {gate.pass_kl:.4g} (max {max_kl:g}), top-1 {gate.pass_top1:.4f} (min {min_top1:g}); "
                    f"ppl {gate.perplexity:.4f} vs {gate.baseline_perplexity:.4f} -> "
                    f"{'pass' if gate.passed else 'FAIL'}")
        return result, gate

    result, gate = attempt(p)
    if gate is None:
        return PassRecord(p.name, config_dict(p), "ungated", result, None, attempts)
    if gate.passed:
        return PassRecord(p.name, config_dict(p), "kept", result, gate, attempts)
    for candidate in p.back_offs(graph, result):
        graph.restore(state)
        ctx.log(f"{p.name}: gate failed; backing off")
        cand_result, cand_gate = attempt(candidate)
        final = candidate.shipping(cand_result) if cand_gate.passed else None
        if final is not None:  # what ships is applied and gated in its own right
            graph.restore(state)
            ctx.log(f"{p.name}: the back-off passed the gate; redoing its shortcuts before it ships (gated again)")
            candidate, (cand_result, cand_gate) = final, attempt(final)
            if not cand_gate.passed:
                ctx.log(f"{p.name}: without its shortcuts the back-off fails the gate; backing off further")
        if cand_gate.passed:
            return PassRecord(p.name, config_dict(candidate), "backed-off", cand_result, cand_gate, attempts)
    graph.restore(state)
    ctx.log(f"{p.name}: no back-off passed the gate; reverted")
    return PassRecord(p.name, config_dict(p), "reverted", result, gate, attempts)
