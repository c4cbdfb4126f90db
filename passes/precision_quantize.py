"""How the precision passes quantize a group to an option: at once from the measured statistics, or block by
block, stage by stage, each linear on the Hessian of its inputs with everything before it quantized.

    InputRange                  a linear's input range, token count and (for GPTQ) Hessian on the calibration text
    calibrated_input_amax       the input range per linear (an expert that saw no token borrows its layer's)
    GroupQuantization           a mixin of precision_plan.PrecisionPass: `_quantize_group`, `_quantize_sequential`
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from kiln.calibration import progress
from kiln.calibration.observers import InputObserver
from kiln.calibration.quantize import calibrated_weight, shared_global_scales
from kiln.kernels.errors import KilnError
from kiln.kernels.registry import weight_format
from kiln.passes.base import PassContext
from kiln.passes.graph import Linear, ModelGraph, QuantizedWeight
from kiln.passes.linear_quant import MLP_INPUT_STAGE, fusion_key, sibling_leaders, stage_of
from kiln.passes.precision_options import BF16, OPTIONS, GroupPlan, PrecisionOption


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


class GroupQuantization:
    """Group quantization for PrecisionPass (a mixin: `self` is the pass)."""

    def _quantize_group(self, graph: ModelGraph, p: GroupPlan, opt: PrecisionOption,
                        stats: Mapping[str, InputRange]) -> dict[str, QuantizedWeight]:
        """linear -> QuantizedWeight for every linear of the group ({} for BF16)."""
        codec = weight_format(opt.weight)
        if codec.recipe_name is None:  # BF16: kept as it is
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
            if codec.takes_global_scale:
                global_scales = shared_global_scales(weights, dict.fromkeys(weights, key))
            if opt.activations == "static":
                input_scale = codec.static_input_scale(torch.tensor(max(input_amax[lin.name] for lin in members)))
            for lin in members:
                seen = stats.get(lin.name)
                hessian = seen.hessian if seen is not None else None
                tensors, method = calibrated_weight(weights[lin.name], opt.weight, self.method, hessian,
                                                    global_scales.get(lin.name), self.gptq_act_order(opt.weight))
                if input_scale is not None:
                    tensors["input_scale"] = input_scale.clone()
                out[lin.name] = QuantizedWeight(opt.weight_format, tensors, opt.runtime_activation,
                                                in_features=lin.in_features if codec.blocked else None,
                                                method=method)
        return out

    def _quantize_sequential(self, graph: ModelGraph, ctx: PassContext, plan: dict[str, GroupPlan],
                             options: Mapping[str, str]) -> dict[str, QuantizedWeight]:
        """Every assigned linear quantized block by block, stage by stage (linear_quant.STAGES): each on the
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
