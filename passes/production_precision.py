"""Production-precision: a fixed policy, FP4 for MLPs and experts, FP8 for attention, BF16 for the
`keep_most_sensitive` groups that lose most at their policy option.

What is measured, how the groups are quantized and how the pass backs off: precision_plan.PrecisionPass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kiln.kernels.errors import KilnError, check_choice
from kiln.kernels.registry import weight_format
from kiln.kernels.targets import Target
from kiln.passes.base import check_range
from kiln.passes.precision_options import ATTENTION_ROLES, BF16, OPTIONS, runs_on, target_fp4
from kiln.passes.precision_plan import PrecisionPass, group_loss


@dataclass(frozen=True)
class ProductionPrecision(PrecisionPass):
    """A fixed production policy: FP4 for MLPs and experts, FP8 for attention, BF16 for the most sensitive.

    Fields:
        mlp                 option for dense MLP, shared-expert and expert groups; "fp4" is the target's
                            fastest FP4 (`target_fp4`: NVFP4 W4A4 on Blackwell, NVFP4 W4A16 on Hopper)
        attention           option for attention groups (q/k/v, o; MLA projections)
        keep_most_sensitive how many groups (the ones that lose most at their policy option) stay BF16
        lm_head, method, sensitivity_paragraphs, sensitivity_method, sensitivity, promote, max_back_offs,
        tune_steps, tune_lr, tune_batch_tokens, tune_budget, sequential, act_order: as AutoPrecision
    Back-off ladder of a group: its policy option, then (for W4A4) the same format weight-only, FP8 W8A8, BF16.
    """

    mlp: str = "fp4"
    attention: str = "fp8-w8a8"
    keep_most_sensitive: int = 2

    name: ClassVar[str] = "production-precision"
    # the floors of auto-precision (passes/auto_precision.py), whose 0.98 recovery floor it shares: the production
    # recipe costs about what auto does on stories260K (benchmarks/results/precision.md)
    default_max_kl: ClassVar[float] = 0.04
    default_min_top1: ClassVar[float] = 0.9

    def __post_init__(self):
        self._validate_common()
        check_choice("mlp", self.mlp, ("fp4", *OPTIONS))
        check_choice("attention", self.attention, tuple(OPTIONS))
        if self.lm_head == "search":
            raise KilnError("lm_head='search' is for auto-precision; production-precision takes 'keep' or an "
                            f"option name ({', '.join(OPTIONS)})")
        check_range("keep_most_sensitive", self.keep_most_sensitive, 0, integer=True)

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
        codec = weight_format(opt.weight)
        if codec.coarse_grid and opt.quantizes_activations:
            ladder.append(opt.weight)  # the same format weight-only
        if codec.bits_per_weight < weight_format(OPTIONS["fp8"].weight).bits_per_weight:  # FP8 is a rung up
            ladder.append("fp8-w8a8" if runs_on(OPTIONS["fp8-w8a8"], target) else "fp8")
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
            reasons[g] = f"production policy: {kind} -> {o} (KL {group_loss(table, g, o):.3g})"
        # Expert groups hold most of an MoE model's bytes: this rule never keeps one whole in BF16 (back-off may).
        ranked = sorted((g for g in plan if options[g] != BF16 and not plan[g].is_experts),
                        key=lambda g: -group_loss(table, g, options[g]))
        kept = ranked[: self.keep_most_sensitive]
        for rank, g in enumerate(kept, 1):
            reasons[g] = (f"production policy: sensitivity rank {rank} of {len(ranked)} (KL "
                          f"{group_loss(table, g, options[g]):.3g} at {options[g]}): kept BF16")
            options[g] = BF16
        summary = {"kind": "production", "mlp": self.policy_option({"gate"}, target),
                   "attention": self.attention, "kept_bf16": kept}
        return options, reasons, summary
