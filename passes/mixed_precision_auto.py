"""Mixed precision: FP8 / NVFP4 / MXFP4 / BF16 chosen per layer group from measured sensitivity.

Two passes, one per policy (the config's type selects it):
    AutoPrecision        least total sensitivity under a weight budget (`weight_bits` or `weight_bytes`),
                         solved exactly (calibration.sensitivity.solve_assignment)
    ProductionPrecision  a fixed policy: FP4 for MLPs and experts, FP8 for attention, BF16 for the
                         `keep_most_sensitive` groups that lose most

Preconditions: a loaded graph; `ctx.logit_kl` (the build driver sets it) unless the config carries a
precomputed `sensitivity`; `ctx.calibrator` when an option needs calibrated activation scales (NVFP4 W4A4).
Groups are `passes.graph.Linear.group`: a layer's q/k/v (MLA: q_a/q_b/kv_a/kv_b) share a format, gate/up share
one, a layer's routed experts share one. Routers and norms stay in source precision; the lm_head follows
`lm_head`; groups an earlier pass already quantized are skipped.

    stats = input range and token count of every linear on the calibration text (ctx.calibrator)
    for each group g, for each candidate option o of g (bf16 is not measured: it loses nothing):
        quantize g alone to o
        sensitivity[g][o] = KL(source || graph) - KL(source || graph before this pass)    # ctx.logit_kl
    options = policy(sensitivity)                      # the budget solver, or the production policy
    for g in promote: options[g] = next_rung(g)         # back-off steps carried in the config
    quantize every group to its option, sequentially (`sequential`, with calibration text and a method other
        than rtn): block by block, stage by stage (q/k/v, o, gate/up, down), each linear on the Hessian of its
        inputs with everything before it already quantized
    then, with tune_steps, tune the FP4 ones end to end (KL to the source; FP8's fine grid overfits the text)
    next_rung(g) = the cheapest candidate of g that loses less than options[g]
                   (e.g. nvfp4-w4a4 -> nvfp4 -> fp8-w8a8 -> bf16)
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

from kiln.calibration.gptq import gptq_quantize
from kiln.calibration.grids import WeightLayout
from kiln.calibration.observers import InputObserver
from kiln.calibration.scale_search import mse_scales
from kiln.calibration.sensitivity import Choice, SensitivityTable, cheapest_bytes, solve_assignment
from kiln.kernels.errors import KilnError
from kiln.kernels.mxfp4 import MXFP4_BLOCK_SIZE
from kiln.kernels.nvfp4 import E2M1_MAX, E4M3_MAX, NVFP4_BLOCK_SIZE, nvfp4_quantize
from kiln.kernels.targets import Target
from kiln.passes.base import Pass, PassContext, PassResult
from kiln.passes.graph import Linear, ModelGraph, QuantizedWeight
from kiln.passes.mixed_precision import (
    MLP_INPUT_STAGE,
    fusion_key,
    quantize_linear_weight,
    relative_error,
    shared_global_scales,
    stage_of,
    tune_end_to_end,
)

BF16 = "bf16"


@dataclass(frozen=True)
class PrecisionOption:
    """One way to store and run a linear: its weight format and what happens to its input activations.

    Attributes:
        name: what recipes, reports and the sensitivity table call it.
        weight: "dense" (BF16), "fp8" (E4M3, one FP32 scale per output channel), "nvfp4" or "mxfp4".
        activations: "none" (weight-only), "dynamic" (scales computed per call) or "static" (NVFP4's
            per-tensor activation scale calibrated on the calibration text; block scales stay dynamic).
    """

    name: str
    weight: str
    activations: str

    @property
    def runtime_activation(self) -> str:
        """The activation entry of the artifact's format table (runtime.weights)."""
        if self.activations == "none":
            return "none"
        return "fp8_dynamic_per_token" if self.weight == "fp8" else self.weight

    @property
    def quantizes_activations(self) -> bool:
        return self.activations != "none"

    def check(self, target: Target) -> None:
        if self.weight == "dense":
            return
        if self.quantizes_activations:
            target.check_weight_activation(self.weight)
        else:
            target.check_weight_only(self.weight)

    def stored_bytes(self, out_features: int, in_features: int) -> int:
        """Bytes of one [out, in] linear in this option, scales and block padding included."""
        n, k = out_features, in_features
        if self.weight == "dense":
            return 2 * n * k
        if self.weight == "fp8":
            return n * k + 4 * n
        block = NVFP4_BLOCK_SIZE if self.weight == "nvfp4" else MXFP4_BLOCK_SIZE
        padded = -(-k // block) * block
        if self.weight == "nvfp4":
            return n * padded // 2 + n * padded // NVFP4_BLOCK_SIZE + 4 + (4 if self.activations == "static" else 0)
        return n * padded // 2 + n * padded // MXFP4_BLOCK_SIZE


# fmt: off
OPTIONS: dict[str, PrecisionOption] = {o.name: o for o in (
    PrecisionOption(BF16, "dense", "none"),
    PrecisionOption("fp8", "fp8", "none"),              # W8A16
    PrecisionOption("fp8-w8a8", "fp8", "dynamic"),      # per-token activation scales
    PrecisionOption("nvfp4", "nvfp4", "none"),          # W4A16
    PrecisionOption("nvfp4-w4a4", "nvfp4", "static"),
    PrecisionOption("mxfp4", "mxfp4", "none"),          # W4A16
    PrecisionOption("mxfp4-w4a4", "mxfp4", "dynamic"),
)}
# fmt: on

ATTENTION_ROLES = ("q", "k", "v", "o", "q_a", "q_b", "kv_a", "kv_b")
LM_HEAD_POLICIES = ("keep", "search", *OPTIONS)
METHODS = ("rtn", "mse", "gptq")


def target_fp4(target: Target) -> str:
    """The FP4 option a target runs fastest: NVFP4 W4A4 on FP4 tensor cores, else NVFP4 weight-only."""
    return "nvfp4-w4a4" if "nvfp4" in target.weight_activation_formats else "nvfp4"


def default_candidates(target: Target) -> tuple[str, ...]:
    """What `AutoPrecision` searches when `candidates` is empty: every option the target runs. FP8 W8A16 and
    W8A8 store the same bytes (what decode reads); the table decides between them (on stories260K at 5.0 bits
    weight-only FP8 loses less: 0.9853 recovery with it among the candidates, 0.9840 without)."""
    return tuple(name for name, o in OPTIONS.items() if _runs(o, target))


def _runs(option: PrecisionOption, target: Target) -> bool:
    try:
        option.check(target)
    except KilnError:
        return False
    return True


def option(name: str) -> PrecisionOption:
    try:
        return OPTIONS[name]
    except KeyError:
        raise KilnError(f"unknown precision option {name!r}; choose one of {', '.join(OPTIONS)}") from None


def _choice(field_name: str, value, allowed) -> None:
    if value not in allowed:
        raise KilnError(f"{field_name}={value!r} is not allowed; choose one of {', '.join(map(str, allowed))}")


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


# --- the passes ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _PrecisionPass(Pass):
    """What both policies share. Not a pass on its own (no policy)."""

    lm_head: str = "keep"
    method: str = "rtn"
    sensitivity_paragraphs: int = 64
    sensitivity: tuple[tuple[str, str, float], ...] = ()
    promote: tuple[str, ...] = ()
    max_back_offs: int | None = None
    tune_steps: int = 0
    tune_lr: float = 3e-4
    tune_batch_tokens: int = 4096
    sequential: bool = True
    act_order: bool | None = None

    default_floor: ClassVar[float] = 0.98

    def _validate_common(self) -> None:
        _choice("lm_head", self.lm_head, LM_HEAD_POLICIES)
        _choice("method", self.method, METHODS)
        if isinstance(self.sensitivity_paragraphs, bool) or not isinstance(self.sensitivity_paragraphs, int) \
                or self.sensitivity_paragraphs <= 0:
            raise KilnError(f"sensitivity_paragraphs must be a positive integer, got {self.sensitivity_paragraphs!r}")
        if self.max_back_offs is not None and (isinstance(self.max_back_offs, bool)
                                               or not isinstance(self.max_back_offs, int) or self.max_back_offs < 0):
            raise KilnError(f"max_back_offs must be a non-negative integer or None (until every group is at "
                            f"its most precise option), got {self.max_back_offs!r}")
        object.__setattr__(self, "sensitivity", tuple(tuple(e) for e in self.sensitivity))
        SensitivityTable.from_entries(self.sensitivity)  # validates the shape of every entry
        object.__setattr__(self, "promote", tuple(self.promote))
        if isinstance(self.tune_steps, bool) or not isinstance(self.tune_steps, int) or self.tune_steps < 0:
            raise KilnError(f"tune_steps must be a non-negative integer, got {self.tune_steps!r}")
        if isinstance(self.tune_lr, bool) or not isinstance(self.tune_lr, int | float) or not self.tune_lr > 0:
            raise KilnError(f"tune_lr must be a positive number, got {self.tune_lr!r}")
        if not isinstance(self.sequential, bool):
            raise KilnError(f"sequential must be true or false, got {self.sequential!r}")
        if self.act_order is not None and not isinstance(self.act_order, bool):
            raise KilnError(f"act_order must be true, false or null (by format), got {self.act_order!r}")
        if isinstance(self.tune_batch_tokens, bool) or not isinstance(self.tune_batch_tokens, int) \
                or self.tune_batch_tokens < 1:
            raise KilnError(f"tune_batch_tokens must be a positive integer, got {self.tune_batch_tokens!r}")

    def gptq_act_order(self, fmt: str) -> bool:
        """GPTQ's act-order for a weight format: `act_order`, or by default what the uniform recipes use (NVFP4
        without: its block scales are then chosen as GPTQ reaches each block, after earlier updates)."""
        return self.act_order if self.act_order is not None else fmt != "nvfp4"

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
        teacher = None
        if self.tune_steps:
            if ctx.calibrator is None:
                raise KilnError(f"{self.name}: tune_steps needs calibration text (--calib-data)")
            teacher = ctx.calibrator.session(graph)  # before anything changes: the distillation's source
        stats = self._input_stats(graph, ctx, plan, result)
        experts = self._expert_coverage(graph, plan, stats, ctx, result)
        cache: dict[tuple[str, str], dict[str, QuantizedWeight]] = {}
        if self.sensitivity:  # carried from the first attempt by back-off (or given by the user)
            tokens = sum(max(len(t) - 1, 0) for t in list(ctx.calibration_tokens)[: self.sensitivity_paragraphs])
            table = SensitivityTable.from_entries(self.sensitivity, tokens=tokens)
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
            reasons[group] = (f"back-off step {step}: promoted from {before} (KL {_loss(table, group, before):.3g}) "
                              f"to {after} (KL {_loss(table, group, after):.3g}), the most sensitive remaining group")
        sequential = self.sequential and ctx.calibrator is not None and self.method != "rtn"
        if sequential:
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
                    result.metrics[lin_name] = relative_error(quantized[lin_name], w)
        if teacher is not None:
            # FP4 grid points only: FP8's grid is 8x finer, and tuning it fits the calibration text instead (FP8
            # W8A8 on stories260K: 0.9951 -> 0.9907 held-out recovery with 200 steps; auto at 5.0 bits: 0.9825
            # with its FP8 groups tuned, 0.9840 without)
            fp4 = [n for g in plan for n in plan[g].linears
                   if graph.linears[n].quant is not None and graph.linears[n].quant.format in ("nvfp4", "mxfp4")]
            if fp4:
                self._tune(graph, teacher, fp4, result, ctx.log)
        experts.update(self._check_experts(graph, plan, options, result))
        result.table, result.options = table, dict(options)
        total_bytes = sum(plan[g].cost[o] for g, o in options.items())
        weights = sum(p.weights for p in plan.values())
        result.notes.append(f"{len(plan)} groups: " + ", ".join(
            f"{n}x {o}" for o, n in sorted(_count(options.values()).items())))
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
                           "kl": round(_loss(table, g, options[g]), 10)} for g in plan},
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
            group = max(movable, key=lambda g: (_loss(table, g, options[g]), g))
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
        if ctx.calibrator is None:
            if needs_scales or needs_hessian:
                raise KilnError(f"{self.name}: {'method ' + repr(self.method) if needs_hessian else 'NVFP4 W4A4'} "
                                "needs calibration text (--calib-data); or use method 'rtn' and leave nvfp4-w4a4 "
                                "out of the candidates")
            result.notes.append("no calibration text: expert token counts unknown")
            return {}
        stats: dict[str, InputRange] = {}
        by_layer: dict[int | None, list[str]] = {}
        for p in plan.values():
            for name in p.linears:
                by_layer.setdefault(graph.linears[name].layer, []).append(name)
        for lin in graph.iter_linears(("router",)):
            by_layer.setdefault(lin.layer, []).append(lin.name)  # an MoE layer's input: the experts' fallback
        session = ctx.calibrator.session(graph)

        def observe(name: str, x: torch.Tensor) -> None:
            if name not in stats:
                lin = graph.linears[name]
                stats[name] = InputRange(observer=InputObserver(lin.in_features) if needs_hessian
                                         and lin.role != "router" else None)
            stats[name].update(x)

        for layer in sorted(by_layer, key=lambda v: math.inf if v is None else v):
            session.observe(by_layer[layer], observe)
        return stats

    def _measure(self, graph: ModelGraph, ctx: PassContext, plan: dict[str, GroupPlan],
                 stats: dict[str, InputRange], cache: dict) -> SensitivityTable:
        if ctx.logit_kl is None:
            raise KilnError(f"{self.name} measures sensitivity through ctx.logit_kl, which this context lacks "
                            "(optimizer.build sets it from the calibration text); or pass `sensitivity`")
        paragraphs = self.sensitivity_paragraphs
        tokens = sum(max(len(t) - 1, 0) for t in list(ctx.calibration_tokens)[:paragraphs])
        offset = ctx.logit_kl(graph, paragraphs)
        losses: dict[str, dict[str, float]] = {}
        measured = 0
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
                    kl = ctx.logit_kl(graph, paragraphs)
                finally:
                    for n, q in before.items():
                        graph.linears[n].quant = q
                losses[group][name] = max(kl - offset, 0.0)
                measured += 1
        ctx.log(f"{self.name}: sensitivity of {len(plan)} groups measured ({measured} KL evaluations, "
                f"{paragraphs} calibration paragraphs)")
        return SensitivityTable(losses, "kl-logits", tokens, offset)

    def _check_table(self, plan: dict[str, GroupPlan], table: SensitivityTable) -> None:
        for group, p in plan.items():
            for name in p.candidates:
                if name != BF16:
                    table.loss(group, name)  # raises a one-line error for a missing entry

    def _quantize_group(self, graph: ModelGraph, p: GroupPlan, opt: PrecisionOption,
                        stats: Mapping[str, InputRange]) -> dict[str, QuantizedWeight]:
        """linear -> QuantizedWeight for every linear of the group ({} for BF16)."""
        if opt.weight == "dense":
            return {}
        lins = [graph.linears[n] for n in p.linears]
        input_amax = _input_amax(graph, lins, stats) if opt.activations == "static" else {}
        sets: dict[str, list[Linear]] = {}
        for lin in lins:
            sets.setdefault(fusion_key(lin), []).append(lin)
        out: dict[str, QuantizedWeight] = {}
        for key, members in sets.items():
            weights = {lin.name: graph.weight(lin).float() for lin in members}
            global_scales = {}
            input_scale = None
            if opt.weight == "nvfp4":
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
                fmt = "fp8_e4m3" if opt.weight == "fp8" else opt.weight
                out[lin.name] = QuantizedWeight(fmt, tensors, opt.runtime_activation,
                                                in_features=None if opt.weight == "fp8" else lin.in_features,
                                                method=method)
        return out

    def _quantize_sequential(self, graph: ModelGraph, ctx: PassContext, plan: dict[str, GroupPlan],
                             options: Mapping[str, str]) -> dict[str, QuantizedWeight]:
        """Every assigned linear quantized block by block, stage by stage (mixed_precision.STAGES): each on the
        Hessian of its inputs with everything before it already quantized. Linears are set on the graph as they
        are quantized, so later stages see them; the caller stores the returned weights."""
        session = ctx.calibrator.session(graph)
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
        for (layer, stage), members in sorted(stages.items()):
            names = [n for _, n in members]
            observed = names + (routers.get(None if layer == math.inf else int(layer), []) if stage == MLP_INPUT_STAGE
                                  else [])
            stats: dict[str, InputRange] = {}

            def observe(name: str, x: torch.Tensor, stats=stats) -> None:
                if name not in stats:
                    lin = graph.linears[name]
                    stats[name] = InputRange(observer=None if lin.role == "router" else InputObserver(lin.in_features))
                stats[name].update(x)

            session.observe(observed, observe)
            for group in dict.fromkeys(g for g, _ in members):
                part = replace(plan[group], linears=tuple(n for g, n in members if g == group))
                for n, q in self._quantize_group(graph, part, OPTIONS[options[group]], stats).items():
                    graph.linears[n].quant = out[n] = q
        return out

    def _tune(self, graph: ModelGraph, session, names: list[str], result: PassResult, log) -> None:
        """End-to-end tuning of the linears `names` and the norms (mixed_precision.tune_end_to_end)."""
        tuned = tune_end_to_end(graph, session, names, self.tune_steps, self.tune_lr, self.tune_batch_tokens, log)
        for name in names:
            lin = graph.linears[name]
            lin.quant = replace(lin.quant, tensors=tuned.tensors[name], method=f"{lin.quant.method}+tuned")
            result.metrics[name] = relative_error(lin.quant, graph.weight(lin).float())
        for name, weight in tuned.norms.items():
            graph.tensors[name] = weight.to(graph.tensors[name].dtype)
        result.notes.append(tuned.note)

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


def calibrated_weight(w: torch.Tensor, fmt: str, method: str, hessian: torch.Tensor | None,
                      global_scale: torch.Tensor | None, act_order: bool = True) -> tuple[dict[str, torch.Tensor], str]:
    """(stored tensors, the method actually used) for one [N, K] weight in `fmt` (fp8 per channel, nvfp4,
    mxfp4). The algorithms are calibration's (scale_search.mse_scales, gptq.gptq_quantize); `global_scale`
    pins NVFP4's per-tensor scale (fused siblings share one: mixed_precision.shared_global_scales).
    Without a Hessian (a linear that saw no calibration token) "gptq" falls back to "mse" on the weights
    alone and "mse" to unweighted MSE: weight-only statistics."""
    layout = WeightLayout(fmt)
    if method == "rtn":
        if fmt == "nvfp4":
            return dict(nvfp4_quantize(w, global_scale=global_scale).tensors()), "rtn"
        return dict(quantize_linear_weight(w, fmt, "per_channel").tensors), "rtn"
    if method == "gptq" and hessian is not None:
        result = gptq_quantize(w, hessian, layout, scales="mse", global_scale=global_scale, act_order=act_order)
        return dict(layout.pack(result.values, result.scales)), "gptq"
    importance = torch.diagonal(hessian).float() if hessian is not None else None
    scales = mse_scales(layout, w, importance, global_scale)
    return dict(layout.pack(layout.quantize(w, scales), scales)), "mse" if hessian is not None or method == "mse" \
        else "mse (weight-only)"


def next_rung(p: GroupPlan, table: SensitivityTable, current: str) -> str | None:
    """The cheapest candidate that loses less than `current` (None at the top). Each step strictly lowers the
    group's loss, so promotion ends at BF16 at the latest. (NVFP4 W4A16 costs 4 bytes less than W4A4, which
    stores an input scale, so "no fewer bytes" would wrongly skip it.)"""
    loss = _loss(table, p.name, current)
    better = [o for o in p.candidates if o != current and _loss(table, p.name, o) < loss]
    if not better:
        return None
    return min(better, key=lambda o: (p.cost[o], _loss(table, p.name, o)))


def _loss(table: SensitivityTable, group: str, name: str) -> float:
    return 0.0 if name == BF16 else table.loss(group, name)


def _count(values) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def _input_amax(graph: ModelGraph, lins: Sequence[Linear], stats: Mapping[str, InputRange]) -> dict[str, float]:
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


@dataclass(frozen=True)
class AutoPrecision(_PrecisionPass):
    """Per-group precision of least total sensitivity under a weight budget.

    Fields:
        weight_bits   budget in effective bits per weight (scales included; see the module doc), or
        weight_bytes  budget in bytes of the assigned linears' weights and scales (exactly one of the two)
        candidates    option names to choose from (see OPTIONS); empty: every option the target runs
                      (`default_candidates`). BF16 is always a candidate.
        lm_head       "keep" (source precision, outside the budget), "search" (a candidate group) or an
                      option name (fixed, inside the budget)
        method        how a format's values are chosen: "rtn" (round to nearest, absmax scales), "mse"
                      (scales searched for the least input-weighted error), "gptq" (GPTQ with MSE scales,
                      on the calibration inputs' Hessian); both from calibration/
        sensitivity_paragraphs  calibration paragraphs the KL is measured on
        sensitivity   (group, option, KL) entries measured before (back-off carries them); empty: measure
        promote       groups promoted one rung each after solving, in order (what back-off adds)
        max_back_offs promotions to try before the pass is reverted; None: until every group is at its
                      most precise candidate (one gate evaluation per step)
        tune_steps    after the assignment, steps of end-to-end tuning of every FP4 linear's grid points
                      (each on its own format's grid, scales fixed) and of the norms, by KL to the source model
                      on the calibration text (calibration.tuning); 0: none
        tune_lr       the tuning's Adam learning rate (cosine decay to 0)
        tune_batch_tokens  calibration tokens per tuning step (whole paragraphs, padded)
        act_order     GPTQ act-order; None: on, except for NVFP4 (as the uniform recipes)
        sequential    quantize the assigned groups block by block on the quantized prefix's inputs (see the
                      module doc); False: every linear on the source model's inputs
    """

    weight_bits: float | None = None
    weight_bytes: int | None = None
    candidates: tuple[str, ...] = ()

    name: ClassVar[str] = "auto-precision"

    def __post_init__(self):
        self._validate_common()
        if (self.weight_bits is None) == (self.weight_bytes is None):
            raise KilnError("auto-precision needs exactly one budget: weight_bits (e.g. --weight-bits 5.0) or "
                            f"weight_bytes; got weight_bits={self.weight_bits!r}, weight_bytes={self.weight_bytes!r}")
        if self.weight_bits is not None:
            if isinstance(self.weight_bits, bool) or not isinstance(self.weight_bits, (int, float)) \
                    or not 0 < self.weight_bits <= 16:
                raise KilnError(f"weight_bits must be a number in (0, 16], got {self.weight_bits!r}")
            object.__setattr__(self, "weight_bits", float(self.weight_bits))
        if self.weight_bytes is not None and (isinstance(self.weight_bytes, bool)
                                              or not isinstance(self.weight_bytes, int) or self.weight_bytes <= 0):
            raise KilnError(f"weight_bytes must be a positive integer, got {self.weight_bytes!r}")
        object.__setattr__(self, "candidates", tuple(self.candidates))
        for name in self.candidates:
            _choice("candidates entry", name, tuple(OPTIONS))

    def group_candidates(self, lin_roles: set[str], group: str, target: Target) -> tuple[str, ...]:
        names = self.candidates or default_candidates(target)
        return tuple(dict.fromkeys((*names, BF16)))

    def budget_bytes(self, plan: dict[str, GroupPlan]) -> int:
        if self.weight_bytes is not None:
            return self.weight_bytes
        return math.floor(self.weight_bits * sum(p.weights for p in plan.values()) / 8)

    def check_plan(self, plan: dict[str, GroupPlan]) -> None:
        if not plan:
            return
        choices = {g: {o: Choice(p.cost[o], 0.0) for o in p.candidates} for g, p in plan.items()}
        weights = sum(p.weights for p in plan.values())
        floor = cheapest_bytes(choices)
        budget = self.budget_bytes(plan)
        if floor > budget:
            asked = (f"--weight-bits {self.weight_bits:g}" if self.weight_bits is not None
                     else f"--weight-bytes {self.weight_bytes}")
            raise KilnError(f"{asked} is impossible: the narrowest allowed formats need {8 * floor / weights:.3f} "
                            f"effective bits ({floor} bytes for {weights} weights)")

    def choose(self, plan, table, graph, target):
        choices = {g: {o: Choice(p.cost[o], _loss(table, g, o)) for o in p.candidates} for g, p in plan.items()}
        budget = self.budget_bytes(plan)
        solved = solve_assignment(choices, budget)
        weights = sum(p.weights for p in plan.values())
        reasons = {}
        for g, o in solved.options.items():
            cheaper = [c for c in plan[g].candidates if plan[g].cost[c] < plan[g].cost[o]]
            why = f"budget solver ({_budget_text(self)}): least total KL; {o} loses {_loss(table, g, o):.3g}"
            if cheaper:
                c = min(cheaper, key=lambda c: plan[g].cost[c])
                why += f" vs {_loss(table, g, c):.3g} at {c}"
            reasons[g] = why
        summary = {"kind": "budget", "weight_bits": self.weight_bits, "weight_bytes": self.weight_bytes,
                   "budget_bytes": budget, "budget_bits": round(8 * budget / weights, 6),
                   "solver": {"exact": solved.exact, "frontier_states": solved.frontier_states,
                              "total_kl": round(solved.total_loss, 10), "total_bytes": solved.total_bytes}}
        return dict(solved.options), reasons, summary


def _budget_text(p: AutoPrecision) -> str:
    return f"{p.weight_bits:g} bits" if p.weight_bits is not None else f"{p.weight_bytes} bytes"


@dataclass(frozen=True)
class ProductionPrecision(_PrecisionPass):
    """A fixed production policy: FP4 for MLPs and experts, FP8 for attention, BF16 for the most sensitive.

    Fields:
        mlp                 option for dense MLP, shared-expert and expert groups; "fp4" is the target's
                            fastest FP4 (`target_fp4`: NVFP4 W4A4 on Blackwell, NVFP4 W4A16 on Hopper)
        attention           option for attention groups (q/k/v, o; MLA projections)
        keep_most_sensitive how many groups (the ones that lose most at their policy option) stay BF16
        lm_head, method, sensitivity_paragraphs, sensitivity, promote, max_back_offs, tune_steps, tune_lr,
        tune_batch_tokens, sequential, act_order: as AutoPrecision
    Back-off ladder of a group: its policy option, then (for W4A4) the same format weight-only, FP8 W8A8, BF16.
    """

    mlp: str = "fp4"
    attention: str = "fp8-w8a8"
    keep_most_sensitive: int = 2

    name: ClassVar[str] = "production-precision"

    def __post_init__(self):
        self._validate_common()
        _choice("mlp", self.mlp, ("fp4", *OPTIONS))
        _choice("attention", self.attention, tuple(OPTIONS))
        if self.lm_head == "search":
            raise KilnError("lm_head='search' is for auto-precision; production-precision takes 'keep' or an "
                            f"option name ({', '.join(OPTIONS)})")
        if isinstance(self.keep_most_sensitive, bool) or not isinstance(self.keep_most_sensitive, int) \
                or self.keep_most_sensitive < 0:
            raise KilnError(f"keep_most_sensitive must be a non-negative integer, got {self.keep_most_sensitive!r}")

    def policy_option(self, roles: set[str], target: Target) -> str:
        if roles <= set(ATTENTION_ROLES):
            return self.attention
        if self.mlp == "fp4":
            return target_fp4(target)
        return self.mlp

    def group_candidates(self, lin_roles: set[str], group: str, target: Target) -> tuple[str, ...]:
        start = self.policy_option(lin_roles, target)
        ladder = [start]
        opt = OPTIONS[start]
        if opt.weight in ("nvfp4", "mxfp4") and opt.quantizes_activations:
            ladder.append(opt.weight)  # the same format weight-only
        if opt.weight != "fp8" and opt.weight != "dense":
            ladder.append("fp8-w8a8" if _runs(OPTIONS["fp8-w8a8"], target) else "fp8")
        ladder.append(BF16)
        return tuple(dict.fromkeys(ladder))

    def choose(self, plan, table, graph, target):
        options, reasons = {}, {}
        for g, p in plan.items():
            roles = {graph.linears[n].role for n in p.linears}
            if g == "lm_head" and self.lm_head not in ("keep", "search"):
                options[g], reasons[g] = self.lm_head, f"lm_head policy {self.lm_head!r}"
                continue
            o = self.policy_option(roles, target)
            options[g] = o
            kind = "attention" if roles <= set(ATTENTION_ROLES) else ("experts" if p.is_experts else "MLP")
            reasons[g] = f"production policy: {kind} -> {o} (KL {_loss(table, g, o):.3g})"
        # Expert groups hold most of an MoE model's bytes: this rule never keeps one whole in BF16 (back-off may).
        ranked = sorted((g for g in plan if options[g] != BF16 and not plan[g].is_experts),
                        key=lambda g: -_loss(table, g, options[g]))
        kept = ranked[: self.keep_most_sensitive]
        for rank, g in enumerate(kept, 1):
            reasons[g] = (f"production policy: sensitivity rank {rank} of {len(ranked)} (KL "
                          f"{_loss(table, g, options[g]):.3g} at {options[g]}): kept BF16")
            options[g] = BF16
        summary = {"kind": "production", "mlp": self.policy_option({"gate"}, target),
                   "attention": self.attention, "kept_bf16": kept}
        return options, reasons, summary
