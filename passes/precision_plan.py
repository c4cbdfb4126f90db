"""The mixed-precision plan: FP8 / NVFP4 / MXFP4 / MXFP6 / BF16 chosen per layer group from measured sensitivity.

This module holds what the two precision passes share: the plan of groups and candidates (GroupPlan), its
result (PrecisionResult), the back-off ladder (next_rung) and `PrecisionPass`, which measures, applies a
policy's choice and backs off. Two passes, one file each, are the policies (the config's type selects it):
    AutoPrecision        least total sensitivity under a weight budget (`weight_bits` or `weight_bytes`),
                         solved exactly (calibration.sensitivity.solve_assignment): auto_precision.py
    ProductionPrecision  a fixed policy: FP4 for MLPs and experts, FP8 for attention, BF16 for the
                         `keep_most_sensitive` groups that lose most: production_precision.py

Preconditions: a loaded graph; `ctx.runner` (the build driver sets it: its logit_kl) unless the config carries a
precomputed `sensitivity`, and (its session) when an option needs calibrated activation scales (NVFP4 W4A4).
Groups are `passes.graph.Linear.group`: a layer's q/k/v (MLA: q_a/q_b/kv_a/kv_b) share a format, gate/up share
one, a layer's routed experts share one. Routers and norms stay in source precision; the lm_head follows
`lm_head`; groups an earlier pass already quantized are skipped.

    stats = input range and token count of every linear on the calibration text (ctx.runner.session)
    for each group g, for each candidate option o of g (bf16 is not measured: it loses nothing):
        quantize g alone to o
        sensitivity[g][o] = KL(source || graph) - KL(source || graph before this pass)    # ctx.runner.logit_kl
      or, on models where that many probes cost too much (`sensitivity_method`, MEASURED_PROBE_BUDGET):
        sensitivity[g][o] = ½ E[(∇ log p · Δy)²], from one gradient pass    # ctx.runner.estimated_kl
    options = policy(sensitivity)                      # the budget solver, or the production policy
    for g in promote: options[g] = next_rung(g)         # back-off steps carried in the config
    quantize every group to its option, sequentially (`sequential`, with calibration text and a method other
        than rtn): block by block, stage by stage (q/k/v, o, gate/up, down), each linear on the Hessian of its
        inputs with everything before it already quantized
    then, with tune_steps, tune the FP4 ones end to end (KL to the source; FP8's fine grid overfits the text)
    next_rung(g) = the cheapest candidate of g that loses less than options[g]
                   (e.g. nvfp4-w4a4 -> nvfp4 -> mxfp6 -> fp8-w8a8 -> bf16)
Back-off: step k promotes the group that loses most at its current option (the most sensitive remaining
group) to its next rung, re-using the measured table (carried in `sensitivity`), until the gate passes.

Fused siblings (q/k/v; q_a/kv_a; gate/up; an expert's gate/up) share NVFP4's per-tensor scale and input
scale, as serving engines run each set as one GEMM with one global scale (ModelOpt's export does the same).
MoE: an expert that saw no calibration tokens gets weight-only statistics (its input scale is the largest
of its layer's calibrated experts, else the router input's range) and the pass logs how many; the number of
quantized experts is checked against the plan (quantizing no expert of an MoE model when the plan asks for
experts is an error).
Effective bits: 8 x stored bytes (weights + every scale, padding included) / weights, over the linears the
pass assigns; BF16 counts 16 bits (the deployment dtype), kept routers and a kept lm_head are left out.
What it does not handle: embeddings (kept), FP8 with per-tensor weights or static activation scales (use
weight-quant), AWQ (use weight-quant). Sensitivity is measured with each group quantized on the source model's
inputs (one observation of every linear), not sequentially.
"""


from __future__ import annotations

import abc
import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from kiln.calibration.metrics import relative_error
from kiln.calibration.observers import InputObserver
from kiln.calibration.quantize import METHODS, calibrated_weight, shared_global_scales
from kiln.calibration.sensitivity import SensitivityTable
from kiln.kernels import progress
from kiln.kernels.errors import KilnError, check_choice
from kiln.kernels.formats import WeightFormat
from kiln.kernels.nvfp4 import E2M1_MAX, E4M3_MAX
from kiln.kernels.registry import parse_weight_format
from kiln.kernels.targets import Target
from kiln.passes.base import (
    MAX_BACK_OFFS,
    MAX_BATCH_TOKENS,
    MAX_LR,
    MAX_PARAGRAPHS,
    MAX_SAMPLES,
    MAX_STEPS,
    STEPS_WHY,
    Pass,
    PassContext,
    PassResult,
    check_range,
)
from kiln.passes.end_to_end_tuning import (
    SAMPLES_PER_PARAGRAPH,
    check_tune_budget,
    linear_weight_count,
    over_budget,
    source_samples,
    tune_end_to_end,
)
from kiln.passes.graph import Linear, ModelGraph, QuantizedWeight
from kiln.passes.precision_options import BF16, LM_HEAD_POLICIES, OPTIONS, PrecisionOption, option
from kiln.passes.tensor_store import release_freed_memory
from kiln.passes.weight_quant import MLP_INPUT_STAGE, fusion_key, sibling_leaders, stage_of

SENSITIVITY_METHODS = ("auto", "kl", "fisher")
# "auto" measures every probe (one forward of the model per group and option) while probes x linear weights
# stays within this, and estimates from gradients beyond: stories260K (about 100 probes of a 0.26M-weight
# model) is measured in seconds; SmolLM2-135M (720 probes of 134M weights, about 8 s each on 2 cores: 95 min)
# is estimated in a few minutes
MEASURED_PROBE_BUDGET = 10**10

# --- the plan: which groups, which linears, which candidates ---------------------------------------------------


@dataclass(frozen=True)
class GroupPlan:
    name: str
    linears: tuple[str, ...]
    candidates: tuple[str, ...]  # option names, cheapest first
    weights: int  # number of weight elements
    cost: Mapping[str, int]  # option -> stored bytes

    @property
    def is_experts(self) -> bool:
        return self.name.endswith(".experts")


@dataclass
class PrecisionResult(PassResult):
    """PassResult plus the precision decisions, kept for back-off and written into the manifest."""

    table: SensitivityTable = field(default_factory=SensitivityTable)
    options: dict[str, str] = field(default_factory=dict)  # group -> final option
    plan: dict[str, GroupPlan] = field(default_factory=dict)

    def to_json(self) -> dict:
        out = super().to_json()
        out["precision"] = {g: o for g, o in sorted(self.options.items())}
        return out


@dataclass
class InputRange:
    """What a linear's inputs looked like on the calibration text: their range, token count and, for the
    methods that need it, the input Hessian X^T X / tokens (calibration.observers.InputObserver)."""

    amax: float = 0.0
    tokens: int = 0
    observer: InputObserver | None = None

    def update(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1])
        x = x[x.abs().amax(dim=1) > 0]  # padding rows
        if x.shape[0]:
            self.amax = max(self.amax, float(x.abs().amax()))
            self.tokens += x.shape[0]
            if self.observer is not None:
                self.observer.update(x)

    @property
    def hessian(self) -> torch.Tensor | None:
        return self.observer.hessian if self.observer is not None and self.tokens > 0 else None


@dataclass(frozen=True)
class PrecisionPass(Pass):
    """What both policies (auto_precision, production_precision) share. Not a pass on its own (no policy)."""

    lm_head: str = "keep"
    method: str = "rtn"
    sensitivity_paragraphs: int = 64
    sensitivity_method: str = "auto"
    sensitivity: tuple[tuple[str, str, float], ...] = ()
    promote: tuple[str, ...] = ()
    max_back_offs: int | None = None
    tune_steps: int = 0
    tune_lr: float = 3e-4
    tune_batch_tokens: int = 4096
    tune_budget: float | None = None
    tune_embedding: bool = False
    tune_samples: int = 0
    sequential: bool = True
    act_order: bool | None = None

    default_floor: ClassVar[float] = 0.98
    runs_after: ClassVar[frozenset[str]] = frozenset({"mla"})  # so MLA's new projections are quantized too
    # after a weight-quant pass it assigns the linears that pass left (build_plan skips quantized ones); a second
    # precision pass would find none (Pass.conflict's default)
    exclusive: ClassVar[str | None] = "weights' format"

    def conflict(self, earlier: Pass) -> str | None:
        if earlier.name == "weight-quant":
            return None  # it takes the linears the weight pass left
        return super().conflict(earlier)

    def _validate_common(self) -> None:
        check_choice("lm_head", self.lm_head, LM_HEAD_POLICIES)
        check_choice("method", self.method, METHODS)
        check_choice("sensitivity_method", self.sensitivity_method, SENSITIVITY_METHODS)
        check_range("sensitivity_paragraphs", self.sensitivity_paragraphs, 1, MAX_PARAGRAPHS, integer=True,
                    why="each group's probe runs on them")
        check_range("max_back_offs", self.max_back_offs, 0, MAX_BACK_OFFS, integer=True, optional=True,
                    why="null: until every group is at its most precise option; each is a gate run")
        object.__setattr__(self, "sensitivity", tuple(tuple(e) for e in self.sensitivity))
        SensitivityTable.from_entries(self.sensitivity)  # validates the shape of every entry
        object.__setattr__(self, "promote", tuple(self.promote))
        check_range("tune_steps", self.tune_steps, 0, MAX_STEPS, integer=True, why=STEPS_WHY)
        check_range("tune_lr", self.tune_lr, 0, MAX_LR, low_open=True)
        check_tune_budget(self.tune_budget)
        check_range("tune_samples", self.tune_samples, 0, MAX_SAMPLES, integer=True,
                    why="each is a generation by the source model")
        if not isinstance(self.tune_embedding, bool):
            raise KilnError(f"tune_embedding must be true or false, got {self.tune_embedding!r}")
        if not isinstance(self.sequential, bool):
            raise KilnError(f"sequential must be true or false, got {self.sequential!r}")
        if self.act_order is not None and not isinstance(self.act_order, bool):
            raise KilnError(f"act_order must be true, false or null (by format), got {self.act_order!r}")
        check_range("tune_batch_tokens", self.tune_batch_tokens, 1, MAX_BATCH_TOKENS, integer=True)

    def gptq_act_order(self, fmt: str) -> bool:
        """GPTQ's act-order for a weight format: `act_order`, or by default what the uniform recipes use (NVFP4
        without: its block scales are then chosen as GPTQ reaches each block, after earlier updates)."""
        return self.act_order if self.act_order is not None else parse_weight_format(fmt) != WeightFormat.NVFP4

    # -- policy hooks -------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def group_candidates(self, lin_roles: set[str], group: str, target: Target) -> tuple[str, ...]:
        """The options a group may take on this target, cheapest first."""

    @abc.abstractmethod
    def choose(self, plan: dict[str, GroupPlan], table: SensitivityTable, graph: ModelGraph,
               target: Target) -> tuple[dict[str, str], dict[str, str], dict]:
        """(group -> option, group -> why, summary for the manifest)."""

    # -- the plan -----------------------------------------------------------------------------------------------
    def build_plan(self, graph: ModelGraph, target: Target) -> tuple[dict[str, GroupPlan], dict[str, str]]:
        """(group -> plan, skipped linear -> why)."""
        skipped: dict[str, str] = {}
        members: dict[str, list[Linear]] = {}
        for lin in graph.iter_linears():
            if lin.role == "router":
                skipped[lin.name] = "router: kept in high precision"
            elif lin.role == "lm_head" and self.lm_head == "keep":
                skipped[lin.name] = "lm_head policy 'keep': source precision"
            elif lin.quant is not None:
                skipped[lin.name] = f"already quantized ({lin.quant.format}) by an earlier pass"
            else:
                members.setdefault(lin.group, []).append(lin)
        plan: dict[str, GroupPlan] = {}
        all_groups = graph.groups()
        for group, lins in members.items():
            if any(lin.quant is not None for lin in all_groups[group]):
                for lin in lins:
                    skipped[lin.name] = "its group is partly quantized by an earlier pass"
                continue
            if group == "lm_head" and self.lm_head not in ("keep", "search"):
                names = (self.lm_head,)
            else:
                names = self.group_candidates({lin.role for lin in lins}, group, target)
            for name in names:
                option(name).check(target)
            cost = {name: sum(OPTIONS[name].stored_bytes(lin.out_features, lin.in_features) for lin in lins)
                    for name in names}
            ordered = tuple(sorted(names, key=lambda n: (cost[n], n != BF16)))
            plan[group] = GroupPlan(group, tuple(lin.name for lin in lins), ordered,
                                    sum(lin.out_features * lin.in_features for lin in lins), cost)
        return plan, skipped

    def check(self, graph: ModelGraph, target: Target) -> None:
        plan, _ = self.build_plan(graph, target)
        self.check_plan(plan)

    def check_plan(self, plan: dict[str, GroupPlan]) -> None:
        """Refuse what cannot work before anything is measured (e.g. an impossible budget)."""

    # -- apply --------------------------------------------------------------------------------------------------
    def apply(self, graph: ModelGraph, ctx: PassContext) -> PassResult:
        plan, skipped = self.build_plan(graph, ctx.target)
        result = PrecisionResult(self.name, skipped=skipped, plan=plan)
        if not plan:
            return result
        self.check_plan(plan)
        teacher, samples = None, []
        if self.tune_steps:
            if ctx.runner is None:
                raise KilnError(f"{self.name}: tune_steps needs calibration text (--calib-data)")
            teacher = ctx.runner.session(graph)  # before anything changes: the distillation's source
            if self.tune_samples and over_budget(graph, self.tune_steps, self.tune_batch_tokens,
                                                 self.tune_budget, teacher.device) is None:
                # the source's, before changes; at most SAMPLES_PER_PARAGRAPH per calibration paragraph tuned on
                count = min(self.tune_samples, SAMPLES_PER_PARAGRAPH * len(teacher.all_token_lists))
                samples = source_samples(graph, ctx.runner, count)
        stats = self._input_stats(graph, ctx, plan, result)
        experts = self._expert_coverage(graph, plan, stats, ctx, result)
        cache: dict[tuple[str, str], dict[str, QuantizedWeight]] = {}
        if self.sensitivity:  # carried from the first attempt by back-off (or given by the user)
            tokens = self._sensitivity_tokens(ctx)
            metric = "kl-fisher" if self._resolved_sensitivity_method(graph, plan) == "fisher" else "kl-logits"
            table = SensitivityTable.from_entries(self.sensitivity, metric, tokens=tokens)
        else:
            table = self._measure(graph, ctx, plan, stats, cache)
        self._check_table(plan, table)
        options, reasons, summary = self.choose(plan, table, graph, ctx.target)
        for step, group in enumerate(self.promote, 1):
            if group not in plan:
                raise KilnError(f"promote names group {group!r}, which this pass does not assign; "
                                f"groups: {', '.join(list(plan)[:6])}...")
            before = options[group]
            after = next_rung(plan[group], table, before)
            if after is None:
                raise KilnError(f"promote: group {group!r} is already at its most precise option ({before})")
            options[group] = after
            reasons[group] = (f"back-off step {step}: promoted from {before} (KL {group_loss(table, group, before):.3g}) "
                              f"to {after} (KL {group_loss(table, group, after):.3g}), the most sensitive remaining group")
        sequential = self._sequential(ctx)
        if sequential:
            cache.clear()  # the candidates and their Hessians are done with: the stages observe their own
            stats.clear()
            release_freed_memory()
            final = self._quantize_sequential(graph, ctx, plan, options)
        for group, name in options.items():
            if sequential:
                quantized = {n: final[n] for n in plan[group].linears if n in final}
            else:
                quantized = cache.get((group, name)) or self._quantize_group(graph, plan[group], OPTIONS[name], stats)
            for lin_name in plan[group].linears:
                lin = graph.linears[lin_name]
                lin.quant = quantized.get(lin_name)
                if lin.quant is None:
                    result.skipped[lin_name] = f"kept in BF16: {reasons[group]}"
                else:
                    w = graph.weight(lin).float()
                    result.changed[lin_name] = name
                    result.metrics[lin_name] = relative_error(quantized[lin_name].dequantize(), w)
        if not sequential:  # (sequential: cleared before it ran) tuning wants the memory
            cache.clear()
            stats.clear()
            release_freed_memory()
        if teacher is not None:
            # FP4 grid points only: beside FP4, tuning FP8's 8x finer grid fits the calibration text instead,
            # with no clear gain (benchmarks/results/precision.md). An all-FP8 model is another matter: the
            # uniform FP8 recipes tune (optimizer.recipes)
            fp4 = [n for g in plan for n in plan[g].linears
                   if graph.linears[n].quant is not None and graph.linears[n].quant.format in (WeightFormat.NVFP4, WeightFormat.MXFP4)]
            if fp4:
                self._tune(graph, teacher, fp4, result, ctx.log, samples)
        experts.update(self._check_experts(graph, plan, options, result))
        result.table, result.options = table, dict(options)
        total_bytes = sum(plan[g].cost[o] for g, o in options.items())
        weights = sum(p.weights for p in plan.values())
        result.notes.append(f"{len(plan)} groups: " + ", ".join(
            f"{n}x {o}" for o, n in sorted(count_values(options.values()).items())))
        result.notes.append(f"effective bits {8 * total_bytes / weights:.3f} over {weights} weights "
                            f"({total_bytes} bytes)")
        graph.metadata["precision"] = {
            "pass": self.name,
            "policy": summary,
            "effective_bits": round(8 * total_bytes / weights, 6),
            "weight_bytes": total_bytes,
            "weights": weights,
            "groups": {g: {"option": options[g], "reason": reasons[g], "linears": list(plan[g].linears),
                           "bytes": plan[g].cost[options[g]],
                           "kl": round(group_loss(table, g, options[g]), 10)} for g in plan},
            "linears": {name: {"group": g, "option": options[g], "reason": reasons[g]}
                        for g in plan for name in plan[g].linears},
            "kept": {name: why for name, why in sorted(result.skipped.items()) if name not in
                     {n for p in plan.values() for n in p.linears}},
            "sensitivity": table.to_json(),
            "experts": experts,
        }
        return result

    def back_offs(self, graph: ModelGraph, result: PassResult) -> Iterator[Pass]:
        if not isinstance(result, PrecisionResult) or not result.options:
            return
        table, options, plan = result.table, dict(result.options), result.plan
        promote = list(self.promote)
        steps = itertools.count() if self.max_back_offs is None else range(self.max_back_offs)
        for _ in steps:
            movable = [g for g in options if next_rung(plan[g], table, options[g]) is not None]
            if not movable:
                return
            group = max(movable, key=lambda g: (group_loss(table, g, options[g]), g))
            options[group] = next_rung(plan[group], table, options[group])
            promote.append(group)
            yield replace(self, sensitivity=table.entries(), promote=tuple(promote))

    # -- internals ----------------------------------------------------------------------------------------------
    def _input_stats(self, graph: ModelGraph, ctx: PassContext, plan: dict[str, GroupPlan],
                     result: PassResult) -> dict[str, InputRange]:
        needs_scales = any(OPTIONS[o].activations == "static" for p in plan.values() for o in p.candidates)
        has_experts = any(p.is_experts for p in plan.values())
        needs_hessian = self.method != "rtn"
        if not (needs_scales or has_experts or needs_hessian):
            return {}
        if self.sensitivity and self.sequential and ctx.runner is not None and needs_hessian and not has_experts:
            return {}  # nothing to measure (back-off carries the table); the sequential quantization observes
        if ctx.runner is None:
            if needs_scales or needs_hessian:
                raise KilnError(f"{self.name}: {'method ' + repr(self.method) if needs_hessian else 'NVFP4 W4A4'} "
                                "needs calibration text (--calib-data); or use method 'rtn' and leave nvfp4-w4a4 "
                                "out of the candidates")
            result.notes.append("no calibration text: expert token counts unknown")
            return {}
        stats: dict[str, InputRange] = {}
        by_layer: dict[int | None, list[str]] = {}
        # siblings that read one input (q/k/v, gate/up) share the first one's statistics; a router (an MoE
        # layer's input: the experts' fallback) is a set of its own
        leaders = sibling_leaders([*(graph.linears[n] for p in plan.values() for n in p.linears),
                                   *graph.iter_linears(("router",))])
        for name in dict.fromkeys(leaders.values()):
            by_layer.setdefault(graph.linears[name].layer, []).append(name)
        session = ctx.runner.session(graph)

        def observe(name: str, x: torch.Tensor) -> None:
            if name not in stats:
                lin = graph.linears[name]
                stats[name] = InputRange(observer=InputObserver(lin.in_features) if needs_hessian
                                         and lin.role != "router" else None)
            stats[name].update(x)

        with progress.stage(f"{self.name}: observe inputs", total=len(by_layer), unit="layers") as task:
            for layer in sorted(by_layer, key=lambda v: math.inf if v is None else v):
                session.observe(by_layer[layer], observe)
                task.advance()
        for name, leader in leaders.items():
            if leader in stats:
                stats[name] = stats[leader]
        return stats

    def _measure(self, graph: ModelGraph, ctx: PassContext, plan: dict[str, GroupPlan],
                 stats: dict[str, InputRange], cache: dict) -> SensitivityTable:
        if ctx.runner is None:
            raise KilnError(f"{self.name} measures sensitivity through ctx.runner.logit_kl, and this context has no "
                            "runner (optimizer.build sets one from the calibration text); or pass `sensitivity`")
        if self._resolved_sensitivity_method(graph, plan) == "fisher":
            return self._estimate(graph, ctx, plan, stats, cache)
        paragraphs = self.sensitivity_paragraphs
        tokens = self._sensitivity_tokens(ctx)
        offset = ctx.runner.logit_kl(graph, paragraphs)
        losses: dict[str, dict[str, float]] = {}
        measured = 0
        probes = sum(name != BF16 for p in plan.values() for name in p.candidates)
        with progress.stage(f"{self.name}: sensitivity probes", total=probes, unit="probes") as task:
            for group, p in plan.items():
                losses[group] = {}
                for name in p.candidates:
                    if name == BF16:
                        losses[group][name] = 0.0
                        continue
                    quantized = self._quantize_group(graph, p, OPTIONS[name], stats)
                    cache[(group, name)] = quantized
                    before = {n: graph.linears[n].quant for n in p.linears}
                    try:
                        for n in p.linears:
                            graph.linears[n].quant = quantized.get(n)
                        kl = ctx.runner.logit_kl(graph, paragraphs)
                    finally:
                        for n, q in before.items():
                            graph.linears[n].quant = q
                    losses[group][name] = max(kl - offset, 0.0)
                    measured += 1
                    task.advance()
        ctx.log(f"{self.name}: sensitivity of {len(plan)} groups measured ({measured} KL evaluations, "
                f"{paragraphs} calibration paragraphs)")
        return SensitivityTable(losses, "kl-logits", tokens, offset)

    def _sensitivity_tokens(self, ctx: PassContext) -> int:
        """Next-token positions of the first `sensitivity_paragraphs` calibration paragraphs: what the table is
        measured on."""
        given = ctx.runner.calibration_tokens if ctx.runner is not None else ()
        return sum(max(len(t) - 1, 0) for t in list(given)[: self.sensitivity_paragraphs])

    def _sequential(self, ctx: PassContext) -> bool:
        """Whether the final quantization runs block by block on the quantized prefix's inputs."""
        return self.sequential and ctx.runner is not None and self.method != "rtn"

    def _resolved_sensitivity_method(self, graph: ModelGraph, plan: dict[str, GroupPlan]) -> str:
        """"kl" or "fisher": `sensitivity_method`, or by cost for "auto" (see MEASURED_PROBE_BUDGET)."""
        if self.sensitivity_method != "auto":
            return self.sensitivity_method
        probes = sum(name != BF16 for p in plan.values() for name in p.candidates)
        weights = linear_weight_count(graph)
        return "kl" if probes * weights <= MEASURED_PROBE_BUDGET else "fisher"

    def _estimate(self, graph: ModelGraph, ctx: PassContext, plan: dict[str, GroupPlan],
                  stats: dict[str, InputRange], cache: dict) -> SensitivityTable:
        """The table from one gradient pass (ctx.runner.estimated_kl) instead of one probe per entry."""
        paragraphs = self.sensitivity_paragraphs
        tokens = self._sensitivity_tokens(ctx)
        entries = [(g, name) for g, p in plan.items() for name in p.candidates if name != BF16]
        with progress.stage(f"{self.name}: quantize candidates", total=len(entries), unit="candidates") as task:
            for group, name in entries:
                cache[(group, name)] = self._quantize_group(graph, plan[group], OPTIONS[name], stats)
                task.advance()
        if self._sequential(ctx):  # the final quantization observes its own inputs: the Hessians can go now
            stats.clear()
            release_freed_memory()
        candidates = {(g, name): {n: cache[(g, name)].get(n) for n in plan[g].linears} for g, name in entries}
        estimated = ctx.runner.estimated_kl(graph, candidates, paragraphs)
        losses: dict[str, dict[str, float]] = {g: {} for g in plan}
        for g, p in plan.items():
            for name in p.candidates:
                losses[g][name] = 0.0 if name == BF16 else max(float(estimated[(g, name)]), 0.0)
        ctx.log(f"{self.name}: sensitivity of {len(plan)} groups estimated from gradients ({len(entries)} "
                f"candidates, {paragraphs} calibration paragraphs; optimizer.measure.fisher)")
        return SensitivityTable(losses, "kl-fisher", tokens, 0.0)

    def _check_table(self, plan: dict[str, GroupPlan], table: SensitivityTable) -> None:
        for group, p in plan.items():
            for name in p.candidates:
                if name != BF16:
                    table.loss(group, name)  # raises a one-line error for a missing entry

    def _quantize_group(self, graph: ModelGraph, p: GroupPlan, opt: PrecisionOption,
                        stats: Mapping[str, InputRange]) -> dict[str, QuantizedWeight]:
        """linear -> QuantizedWeight for every linear of the group ({} for BF16)."""
        if opt.weight_format == WeightFormat.DENSE:
            return {}
        lins = [graph.linears[n] for n in p.linears]
        input_amax = calibrated_input_amax(graph, lins, stats) if opt.activations == "static" else {}
        sets: dict[str, list[Linear]] = {}
        for lin in lins:
            sets.setdefault(fusion_key(lin), []).append(lin)
        out: dict[str, QuantizedWeight] = {}
        for key, members in sets.items():
            weights = {lin.name: graph.weight(lin).float() for lin in members}
            global_scales = {}
            input_scale = None
            if opt.weight_format == WeightFormat.NVFP4:
                global_scales = shared_global_scales(weights, dict.fromkeys(weights, key))
                if opt.activations == "static":
                    x_amax = max(input_amax[lin.name] for lin in members)
                    input_scale = torch.tensor(x_amax / (E2M1_MAX * E4M3_MAX) if x_amax > 0 else 1.0)
            for lin in members:
                seen = stats.get(lin.name)
                hessian = seen.hessian if seen is not None else None
                tensors, method = calibrated_weight(weights[lin.name], opt.weight, self.method, hessian,
                                                    global_scales.get(lin.name), self.gptq_act_order(opt.weight))
                if input_scale is not None:
                    tensors["input_scale"] = input_scale.clone()
                out[lin.name] = QuantizedWeight(opt.weight_format, tensors, opt.runtime_activation,
                                                in_features=None if opt.weight_format == WeightFormat.FP8_E4M3 else lin.in_features,
                                                method=method)
        return out

    def _quantize_sequential(self, graph: ModelGraph, ctx: PassContext, plan: dict[str, GroupPlan],
                             options: Mapping[str, str]) -> dict[str, QuantizedWeight]:
        """Every assigned linear quantized block by block, stage by stage (weight_quant.STAGES): each on the
        Hessian of its inputs with everything before it already quantized. Linears are set on the graph as they
        are quantized, so later stages see them; the caller stores the returned weights."""
        session = ctx.runner.session(graph)
        stages: dict[tuple[float, int], list[tuple[str, str]]] = {}
        for group, name in options.items():
            if name == BF16:
                continue
            for n in plan[group].linears:
                lin = graph.linears[n]
                key = (math.inf if lin.layer is None else lin.layer, stage_of(lin))
                stages.setdefault(key, []).append((group, n))
        routers: dict[int | None, list[str]] = {}
        for lin in graph.iter_linears(("router",)):
            routers.setdefault(lin.layer, []).append(lin.name)  # experts' fallback input range
        out: dict[str, QuantizedWeight] = {}
        with progress.stage(f"{self.name}: quantize sequentially", total=len(stages), unit="stages") as task:
            for (layer, stage), members in sorted(stages.items()):
                self._quantize_stage(graph, session, plan, options, members, layer, stage, routers, out)
                task.advance()
        return out

    def _quantize_stage(self, graph: ModelGraph, session, plan: dict[str, GroupPlan], options: Mapping[str, str],
                        members: list[tuple[str, str]], layer: float, stage: int, routers: Mapping,
                        out: dict[str, QuantizedWeight]) -> None:
        """One stage of one block (`_quantize_sequential`): observe its inputs now, quantize, set on the graph."""
        leaders = sibling_leaders(graph.linears[n] for _, n in members)  # siblings share one observation
        observed = list(dict.fromkeys(leaders.values())) + (routers.get(None if layer == math.inf else int(layer), [])
                                                            if stage == MLP_INPUT_STAGE else [])
        stats: dict[str, InputRange] = {}

        def observe(name: str, x: torch.Tensor, stats=stats) -> None:
            if name not in stats:
                lin = graph.linears[name]
                stats[name] = InputRange(observer=None if lin.role == "router" else InputObserver(lin.in_features))
            stats[name].update(x)

        session.observe(observed, observe)
        for name, leader in leaders.items():
            if leader in stats:
                stats[name] = stats[leader]
        for group in dict.fromkeys(g for g, _ in members):
            part = replace(plan[group], linears=tuple(n for g, n in members if g == group))
            for n, q in self._quantize_group(graph, part, OPTIONS[options[group]], stats).items():
                graph.linears[n].quant = out[n] = q

    def _tune(self, graph: ModelGraph, session, names: list[str], result: PassResult, log,
              samples: list[list[int]]) -> None:
        """End-to-end tuning of the linears `names` and the norms (end_to_end_tuning.tune_end_to_end), on the
        calibration text and `samples`."""
        tuned = tune_end_to_end(graph, session, names, self.tune_steps, self.tune_lr, self.tune_batch_tokens, log,
                                self.tune_budget, self.tune_embedding, samples)
        result.notes.append(tuned.note)
        if not tuned.tensors:
            return
        for name in names:
            lin = graph.linears[name]
            lin.quant = replace(lin.quant, tensors=tuned.tensors[name], method=f"{lin.quant.method}+tuned")
            result.metrics[name] = relative_error(lin.quant.dequantize(), graph.weight(lin).float())
        for name, weight in tuned.norms.items():
            graph.tensors[name] = weight.to(graph.tensors[name].dtype)

    def _expert_coverage(self, graph: ModelGraph, plan: dict[str, GroupPlan], stats: Mapping[str, InputRange],
                         ctx: PassContext, result: PassResult) -> dict:
        """How many routed experts the calibration text reached; warns about the ones it did not."""
        experts = sorted({(graph.linears[n].layer, graph.linears[n].expert)
                          for p in plan.values() if p.is_experts for n in p.linears})
        if not experts or not stats:
            return {"experts": len(experts)}
        tokens = {}
        for n in (n for p in plan.values() if p.is_experts for n in p.linears):
            lin = graph.linears[n]
            if lin.proj == "gate":
                tokens[(lin.layer, lin.expert)] = stats.get(n, InputRange()).tokens
        idle = [e for e in experts if tokens.get(e, 0) == 0]
        if idle:
            message = (f"warning: {len(idle)} of {len(experts)} routed experts saw no calibration tokens "
                       f"({', '.join(f'layer {layer} expert {e}' for layer, e in idle[:4])}"
                       f"{', ...' if len(idle) > 4 else ''}); they use weight-only statistics")
            ctx.log(message)
            result.notes.append(message)
        return {"experts": len(experts), "without_calibration_tokens": len(idle),
                "tokens_per_expert": {f"{layer}.{e}": tokens.get((layer, e), 0) for layer, e in experts}}

    def _check_experts(self, graph: ModelGraph, plan: dict[str, GroupPlan], options: dict[str, str],
                       result: PassResult) -> dict:
        """The number of quantized experts must be what the plan asked for (and not zero on an MoE model
        whose expert groups the plan quantizes)."""
        expected = {n for g, p in plan.items() if p.is_experts and options[g] != BF16 for n in p.linears}
        actual = {n for n in expected if graph.linears[n].quant is not None}
        planned = {(graph.linears[n].layer, graph.linears[n].expert) for n in expected}
        quantized = {(graph.linears[n].layer, graph.linears[n].expert) for n in actual}
        if actual != expected or len(quantized) != len(planned):
            raise KilnError(f"{self.name}: quantized {len(quantized)} routed experts but the plan asked for "
                            f"{len(planned)}")
        total = {(lin.layer, lin.expert) for lin in graph.iter_linears(("expert",))}
        if total:
            result.notes.append(f"quantized experts: {len(quantized)} of {len(total)}")
        return {"quantized": len(quantized), "total": len(total)}


def next_rung(p: GroupPlan, table: SensitivityTable, current: str) -> str | None:
    """The cheapest candidate that loses less than `current` (None at the top). Each step strictly lowers the
    group's loss, so promotion ends at BF16 at the latest. (NVFP4 W4A16 costs 4 bytes less than W4A4, which
    stores an input scale, so "no fewer bytes" would wrongly skip it.)"""
    loss = group_loss(table, p.name, current)
    better = [o for o in p.candidates if o != current and group_loss(table, p.name, o) < loss]
    if not better:
        return None
    return min(better, key=lambda o: (p.cost[o], group_loss(table, p.name, o)))


def group_loss(table: SensitivityTable, group: str, name: str) -> float:
    return 0.0 if name == BF16 else table.loss(group, name)


def count_values(values) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def calibrated_input_amax(graph: ModelGraph, lins: Sequence[Linear], stats: Mapping[str, InputRange]) -> dict[str, float]:
    """Calibrated input range per linear; an expert that saw no token borrows its layer's (see module doc)."""
    out: dict[str, float] = {}
    for lin in lins:
        seen = stats.get(lin.name)
        if seen is not None and seen.tokens > 0:
            out[lin.name] = seen.amax
            continue
        if lin.role == "expert":
            siblings = [s.amax for name, s in stats.items() if s.tokens > 0
                        and graph.linears[name].role == "expert" and graph.linears[name].layer == lin.layer
                        and graph.linears[name].proj == lin.proj]
            if siblings:
                out[lin.name] = max(siblings)
                continue
            if lin.proj in ("gate", "up"):
                routers = [s.amax for name, s in stats.items() if s.tokens > 0
                           and graph.linears[name].role == "router" and graph.linears[name].layer == lin.layer]
                if routers:
                    out[lin.name] = max(routers)
                    continue
        raise KilnError(f"{lin.name} saw no calibration tokens, so NVFP4 W4A4 has no activation scale for it; "
                        "use more calibration text or a weight-only option")
    return out
