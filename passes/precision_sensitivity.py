"""How the precision passes measure sensitivity: each group's loss at each candidate option.

`SensitivityMeasurement` is a mixin of `precision_plan.PrecisionPass` (`self` is the pass, its fields the
config): the input statistics of every linear on the calibration text (`_input_stats`), then one KL probe per
group and option (`_measure`, ctx.runner.logit_kl) or, past MEASURED_PROBE_BUDGET, one gradient pass
(`_estimate`, ctx.runner.estimated_kl); and how many routed experts the calibration text reached.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from kiln.calibration import progress
from kiln.calibration.observers import InputObserver
from kiln.calibration.sensitivity import SensitivityTable
from kiln.kernels.errors import KilnError
from kiln.passes.base import PassContext, PassResult
from kiln.passes.end_to_end_tuning import linear_weight_count
from kiln.passes.graph import ModelGraph
from kiln.passes.linear_quant import sibling_leaders
from kiln.passes.precision_options import BF16, OPTIONS, GroupPlan
from kiln.passes.precision_quantize import InputRange
from kiln.passes.tensor_store import release_freed_memory

SENSITIVITY_METHODS = ("auto", "kl", "fisher")
# "auto" measures every probe (one forward of the model per group and option) while probes x linear weights
# stays within this, and estimates from gradients beyond: stories260K (about 100 probes of a 0.26M-weight
# model) is measured in seconds; SmolLM2-135M (720 probes of 134M weights, about 8 s each on 2 cores: 95 min)
# is estimated in a few minutes
MEASURED_PROBE_BUDGET = 10**10


class SensitivityMeasurement:
    """Sensitivity tables for PrecisionPass (a mixin: `self` is the pass)."""

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
