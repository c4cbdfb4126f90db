"""What each deployment target runs natively, and the figures the cost model needs.

A plain table, not a plugin system: passes look a target up here and refuse, with a clear message, any
format the target cannot execute.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.kernels.errors import KilnError
from kiln.kernels.registry import WEIGHT_FORMATS


@dataclass(frozen=True)
class Device:
    name: str
    hbm_bytes: int
    hbm_bytes_per_second: float
    dense_bf16_flops: float
    dense_fp8_flops: float
    dense_fp4_flops: float  # 0 where there are no FP4 tensor cores


@dataclass(frozen=True)
class Target:
    """A GPU generation: the weight/activation modes its tensor cores run, and its devices."""

    name: str
    # Weight-only modes: weights stored narrow, dequantized inside the GEMM to bf16 (any generation).
    weight_only_formats: frozenset[str]
    # Modes where both operands are narrow and the tensor cores compute in that precision.
    weight_activation_formats: frozenset[str]
    devices: tuple[Device, ...]

    def check_weight_only(self, fmt: str) -> None:
        if fmt not in self.weight_only_formats:
            raise KilnError(
                f"target {self.name} cannot run {fmt} weights; it runs {sorted(self.weight_only_formats)}"
            )

    def check_weight_activation(self, fmt: str) -> None:
        if fmt not in self.weight_activation_formats:
            raise KilnError(
                f"target {self.name} has no {fmt} tensor cores for W{fmt}A{fmt}; it runs "
                f"{sorted(self.weight_activation_formats)} activations"
                + (" (FP4 on Hopper is weight-only: use a -w4a16 recipe or --target blackwell)"
                   if self.name == "hopper" and "fp4" in fmt else "")
            )


H100 = Device("H100-80GB", 80 * 10**9, 3.35e12, 989e12, 1979e12, 0.0)
H200 = Device("H200-141GB", 141 * 10**9, 4.8e12, 989e12, 1979e12, 0.0)
B200 = Device("B200-192GB", 192 * 10**9, 8.0e12, 2250e12, 4500e12, 9000e12)

def _target(name: str, devices: tuple[Device, ...]) -> Target:
    """A target's modes as the formats' objects state them (WeightCodec.weight_only_targets, ...): Hopper runs FP4
    and FP6 weight-only, decoded to BF16 in the GEMM's kernel (no FP4/FP6 tensor cores)."""
    quantized = [c for c in WEIGHT_FORMATS.values() if c.recipe_name is not None]
    return Target(name=name,
                  weight_only_formats=frozenset(c.recipe_name for c in quantized if name in c.weight_only_targets),
                  weight_activation_formats=frozenset(c.recipe_name for c in quantized
                                                      if name in c.weight_activation_targets),
                  devices=devices)


TARGETS: dict[str, Target] = {
    "hopper": _target("hopper", (H100, H200)),
    "blackwell": _target("blackwell", (B200,)),
}


def get_target(name: str) -> Target:
    try:
        return TARGETS[name]
    except KeyError:
        raise KilnError(f"unknown target {name!r}; supported: {', '.join(sorted(TARGETS))}") from None
