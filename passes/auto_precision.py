"""Auto-precision: per layer group, the precision of least total sensitivity under a weight budget.

The budget is `weight_bits` or `weight_bytes` (scales included); the assignment is solved exactly
(calibration.sensitivity.solve_assignment) over the measured table. What is measured, how the groups are
quantized and how the pass backs off: precision_plan.PrecisionPass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from kiln.calibration.sensitivity import Choice, cheapest_bytes, solve_assignment
from kiln.kernels.errors import KilnError, check_choice
from kiln.kernels.targets import Target
from kiln.passes.base import check_range
from kiln.passes.precision_options import BF16, OPTIONS, GroupPlan, default_candidates
from kiln.passes.precision_plan import PrecisionPass, group_loss


@dataclass(frozen=True)
class AutoPrecision(PrecisionPass):
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
        sensitivity_method  "kl" (one probe per group and option, measured), "fisher" (estimated from one
                      gradient pass, optimizer.measure.fisher) or "auto" (measured up to MEASURED_PROBE_BUDGET)
        sensitivity   (group, option, KL) entries measured before (back-off carries them); empty: measure
        promote       groups promoted one rung each after solving, in order (what back-off adds)
        max_back_offs promotions to try before the pass is reverted; None: until every group is at its
                      most precise candidate (one gate evaluation per step)
        tune_steps    after the assignment, steps of end-to-end tuning of every FP4 linear's grid points
                      (each on its own format's grid, scales fixed) and of the norms, by KL to the source model
                      on the calibration text (calibration.tuning); 0: none
        tune_lr       the tuning's Adam learning rate (cosine decay to 0)
        tune_batch_tokens  calibration tokens per tuning step (whole paragraphs, padded)
        tune_budget   tuning runs only if tune_steps x tune_batch_tokens x the model's linear weights is at
                      most this (None: end_to_end_tuning.TUNE_BUDGETS of the device it runs on: small models on a
                      CPU, 2^50 on cuda); otherwise it is skipped
        tune_embedding  the tuning moves the embedding's rows too (and so a tied, unquantized lm_head's),
                      stored back in the embedding's dtype: it stays outside the budget
        tune_samples  paragraphs the source model writes (temperature 1, prompted by calibration paragraphs'
                      first tokens) that the tuning fits beside the calibration text (end_to_end_tuning.source_samples);
                      made only when the tuning runs, at most 4 per calibration paragraph
        act_order     GPTQ act-order; None: on, except for NVFP4 (as the uniform recipes)
        sequential    quantize the assigned groups block by block on the quantized prefix's inputs (see the
                      module doc); False: every linear on the source model's inputs
    """

    weight_bits: float | None = None
    weight_bytes: int | None = None
    candidates: tuple[str, ...] = ()

    name: ClassVar[str] = "auto-precision"
    # beside PrecisionPass's 0.98 recovery floor: a KL ceiling of twice what `auto --weight-bits 5.0` costs on
    # stories260K before its tuning fitted the model's own samples, a top-1 floor allowing 1.5 times that
    # disagreement (figures: benchmarks/results/precision.md)
    default_max_kl: ClassVar[float] = 0.04
    default_min_top1: ClassVar[float] = 0.9

    def __post_init__(self):
        self._validate_common()
        if (self.weight_bits is None) == (self.weight_bytes is None):
            raise KilnError("auto-precision needs exactly one budget: weight_bits (e.g. --weight-bits 5.0) or "
                            f"weight_bytes; got weight_bits={self.weight_bits!r}, weight_bytes={self.weight_bytes!r}")
        if self.weight_bits is not None:
            check_range("weight_bits", self.weight_bits, 0, 16, low_open=True)
            object.__setattr__(self, "weight_bits", float(self.weight_bits))
        check_range("weight_bytes", self.weight_bytes, 1, integer=True, optional=True)
        object.__setattr__(self, "candidates", tuple(self.candidates))
        for name in self.candidates:
            check_choice("candidates entry", name, tuple(OPTIONS))

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
        choices = {g: {o: Choice(p.cost[o], group_loss(table, g, o)) for o in p.candidates} for g, p in plan.items()}
        budget = self.budget_bytes(plan)
        solved = solve_assignment(choices, budget)
        weights = sum(p.weights for p in plan.values())
        reasons = {}
        for g, o in solved.options.items():
            cheaper = [c for c in plan[g].candidates if plan[g].cost[c] < plan[g].cost[o]]
            why = f"budget solver ({_budget_text(self)}): least total KL; {o} loses {group_loss(table, g, o):.3g}"
            if cheaper:
                c = min(cheaper, key=lambda c: plan[g].cost[c])
                why += f" vs {group_loss(table, g, c):.3g} at {c}"
            reasons[g] = why
        summary = {"kind": "budget", "weight_bits": self.weight_bits, "weight_bytes": self.weight_bytes,
                   "budget_bytes": budget, "budget_bits": round(8 * budget / weights, 6),
                   "solver": {"exact": solved.exact, "frontier_states": solved.frontier_states,
                              "total_kl": round(solved.total_loss, 10), "total_bytes": solved.total_bytes}}
        return dict(solved.options), reasons, summary


def _budget_text(p: AutoPrecision) -> str:
    return f"{p.weight_bits:g} bits" if p.weight_bits is not None else f"{p.weight_bytes} bytes"
