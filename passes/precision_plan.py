"""The mixed-precision plan: FP8 / NVFP4 / MXFP4 / MXFP6 / BF16 chosen per layer group from measured sensitivity.

This module holds what the two precision passes share: the plan's result (PrecisionResult), the back-off
ladder (next_rung) and `PrecisionPass`, which measures (precision_sensitivity.py), applies a policy's choice
(quantized by precision_quantize.py) and backs off; the groups and their candidates are
precision_options.GroupPlan. Two passes, one file each, are the policies (the config's type selects it):
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
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import ClassVar

from kiln.calibration.metrics import relative_error
from kiln.calibration.quantize import METHODS
from kiln.calibration.sensitivity import SensitivityTable
from kiln.kernels.errors import KilnError, check_choice
from kiln.kernels.registry import weight_format
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
    over_budget,
    source_samples,
    tune_end_to_end,
)
from kiln.passes.graph import Linear, ModelGraph, QuantizedWeight
from kiln.passes.precision_options import BF16, LM_HEAD_POLICIES, OPTIONS, GroupPlan, option
from kiln.passes.precision_quantize import GroupQuantization
from kiln.passes.precision_sensitivity import SENSITIVITY_METHODS, SensitivityMeasurement
from kiln.passes.tensor_store import release_freed_memory


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


@dataclass(frozen=True)
class PrecisionPass(SensitivityMeasurement, GroupQuantization, Pass):
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
        return self.act_order if self.act_order is not None else weight_format(fmt).gptq_act_order_default

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
        teacher, samples = self._distillation_source(graph, ctx)
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
        self._promote(plan, table, options, reasons)
        self._store_options(graph, ctx, plan, options, reasons, stats, cache, result)
        if teacher is not None:
            # FP4 grid points only: beside FP4, tuning FP8's 8x finer grid fits the calibration text instead,
            # with no clear gain (benchmarks/results/precision.md). An all-FP8 model is another matter: the
            # uniform FP8 recipes tune (optimizer.recipes)
            fp4 = [n for g in plan for n in plan[g].linears
                   if graph.linears[n].quant is not None and weight_format(graph.linears[n].quant.format).coarse_grid]
            if fp4:
                self._tune(graph, teacher, fp4, result, ctx.log, samples)
        experts.update(self._check_experts(graph, plan, options, result))
        result.table, result.options = table, dict(options)
        self._record(graph, plan, table, options, reasons, summary, experts, result)
        return result

    def _distillation_source(self, graph: ModelGraph, ctx: PassContext) -> tuple[object, list[list[int]]]:
        """With tune_steps: the session on the graph before anything changes (the distillation's source) and the
        source model's own samples (`tune_samples`); (None, []) otherwise."""
        if not self.tune_steps:
            return None, []
        if ctx.runner is None:
            raise KilnError(f"{self.name}: tune_steps needs calibration text (--calib-data)")
        teacher = ctx.runner.session(graph)  # before anything changes: the distillation's source
        samples = []
        if self.tune_samples and over_budget(graph, self.tune_steps, self.tune_batch_tokens,
                                             self.tune_budget, teacher.device) is None:
            # the source's, before changes; at most SAMPLES_PER_PARAGRAPH per calibration paragraph tuned on
            count = min(self.tune_samples, SAMPLES_PER_PARAGRAPH * len(teacher.all_token_lists))
            samples = source_samples(graph, ctx.runner, count)
        return teacher, samples

    def _promote(self, plan: dict[str, GroupPlan], table: SensitivityTable, options: dict[str, str],
                 reasons: dict[str, str]) -> None:
        """The back-off steps carried in `promote`: each group named moves to its next rung."""
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

    def _store_options(self, graph: ModelGraph, ctx: PassContext, plan: dict[str, GroupPlan],
                       options: Mapping[str, str], reasons: Mapping[str, str], stats: dict, cache: dict,
                       result: PassResult) -> None:
        """Every group quantized to its option and set on the graph, sequentially or from the candidates
        measured; the statistics and candidates are freed (tuning wants the memory)."""
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

    def _record(self, graph: ModelGraph, plan: dict[str, GroupPlan], table: SensitivityTable,
                options: Mapping[str, str], reasons: Mapping[str, str], summary: dict, experts: dict,
                result: PassResult) -> None:
        """The plan's notes, and `graph.metadata["precision"]` (the manifest's record of every decision)."""
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
