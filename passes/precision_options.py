"""The precision options the mixed-precision passes choose from: one weight format and what happens to the
input activations, with what each costs in stored bytes and which targets run it.

    OPTIONS              name -> PrecisionOption (bf16, fp8, fp8-w8a8, nvfp4, nvfp4-w4a4, mxfp4, mxfp4-w4a4,
                         mxfp6)
    default_candidates   every option a target runs (what auto-precision searches by default)
    target_fp4           the FP4 option a target runs fastest (production-precision's "fp4")
    GroupPlan            one layer group's linears and candidate options, with what each costs
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kiln.kernels.errors import KilnError
from kiln.kernels.formats import ActivationFormat, WeightFormat
from kiln.kernels.registry import parse_weight_format, weight_format
from kiln.kernels.targets import Target

BF16 = "bf16"


@dataclass(frozen=True)
class PrecisionOption:
    """One way to store and run a linear: its weight format and what happens to its input activations.

    Attributes:
        name: what recipes, reports and the sensitivity table call it.
        weight: "dense" (BF16), "fp8" (E4M3, one FP32 scale per output channel), "nvfp4", "mxfp4" or "mxfp6".
        activations: "none" (weight-only), "dynamic" (scales computed per call) or "static" (NVFP4's
            per-tensor activation scale calibrated on the calibration text; block scales stay dynamic).
    """

    name: str
    weight: str
    activations: str

    @property
    def weight_format(self) -> WeightFormat:
        return parse_weight_format(self.weight)

    @property
    def runtime_activation(self) -> ActivationFormat:
        """The activation entry of the artifact's format table (runtime.weights)."""
        return weight_format(self.weight).activation_format(self.activations)

    @property
    def quantizes_activations(self) -> bool:
        return self.activations != "none"

    def check(self, target: Target) -> None:
        if weight_format(self.weight).recipe_name is None:  # dense: every target runs it
            return
        if self.quantizes_activations:
            target.check_weight_activation(self.weight)
        else:
            target.check_weight_only(self.weight)

    def stored_bytes(self, out_features: int, in_features: int) -> int:
        """Bytes of one [out, in] linear in this option, scales and block padding included."""
        # a static activation scale (NVFP4 W4A4's calibrated per-tensor scale) is one fp32 more
        return (weight_format(self.weight).stored_bytes(out_features, in_features)
                + (4 if self.activations == "static" else 0))


# fmt: off
OPTIONS: dict[str, PrecisionOption] = {o.name: o for o in (
    PrecisionOption(BF16, "dense", "none"),
    PrecisionOption("fp8", "fp8", "none"),              # W8A16
    PrecisionOption("fp8-w8a8", "fp8", "dynamic"),      # per-token activation scales
    PrecisionOption("nvfp4", "nvfp4", "none"),          # W4A16
    PrecisionOption("nvfp4-w4a4", "nvfp4", "static"),
    PrecisionOption("mxfp4", "mxfp4", "none"),          # W4A16
    PrecisionOption("mxfp4-w4a4", "mxfp4", "dynamic"),
    PrecisionOption("mxfp6", "mxfp6", "none"),          # W6A16
)}
# fmt: on

ATTENTION_ROLES = ("q", "k", "v", "o", "q_a", "q_b", "kv_a", "kv_b")
LM_HEAD_POLICIES = ("keep", "search", *OPTIONS)


def target_fp4(target: Target) -> str:
    """The FP4 option a target runs fastest: NVFP4 W4A4 on FP4 tensor cores, else NVFP4 weight-only."""
    return "nvfp4-w4a4" if "nvfp4" in target.weight_activation_formats else "nvfp4"


def default_candidates(target: Target) -> tuple[str, ...]:
    """What `AutoPrecision` searches when `candidates` is empty: every option the target runs. FP8 W8A16 and
    W8A8 store the same bytes (what decode reads); the table decides between them (on stories260K weight-only
    FP8 loses less: benchmarks/results/precision.md)."""
    return tuple(name for name, o in OPTIONS.items() if runs_on(o, target))


def runs_on(option: PrecisionOption, target: Target) -> bool:
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


@dataclass(frozen=True)
class GroupPlan:
    """One layer group a precision pass assigns an option: its linears and candidate options, with what each
    costs in stored bytes."""

    name: str
    linears: tuple[str, ...]
    candidates: tuple[str, ...]  # option names, cheapest first
    weights: int  # number of weight elements
    cost: Mapping[str, int]  # option -> stored bytes

    @property
    def is_experts(self) -> bool:
        return self.name.endswith(".experts")
