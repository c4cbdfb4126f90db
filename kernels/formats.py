"""Format names: one typed value per format, spelled as the artifact's manifest spells it.

    WeightFormat      a stored linear weight: dense, fp8_e4m3, nvfp4, mxfp4, mxfp6
    ActivationFormat  what happens to a linear's input: none, fp8_dynamic_per_token, fp8_static_per_tensor,
                      nvfp4, mxfp4
    KvFormat          a layer's stored KV cache: bf16, fp8_e4m3, nvfp4

They are `StrEnum`s: a member equals its string and JSON-serializes as it, so manifests keep their bytes.
Recipes and configs also say "fp8" (and "bf16" for a dense weight); `parse_weight_format` / `parse_kv_format`
map those spellings to the one member and refuse anything else in one line naming the allowed set.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum

from kiln.kernels.errors import KilnError


class WeightFormat(StrEnum):
    DENSE = "dense"
    FP8_E4M3 = "fp8_e4m3"
    NVFP4 = "nvfp4"
    MXFP4 = "mxfp4"
    MXFP6 = "mxfp6"  # weight-only (W6A16): no activation format of its own


class ActivationFormat(StrEnum):
    NONE = "none"
    FP8_DYNAMIC_PER_TOKEN = "fp8_dynamic_per_token"
    FP8_STATIC_PER_TENSOR = "fp8_static_per_tensor"
    NVFP4 = "nvfp4"
    MXFP4 = "mxfp4"


class KvFormat(StrEnum):
    BF16 = "bf16"
    FP8_E4M3 = "fp8_e4m3"
    NVFP4 = "nvfp4"


WEIGHT_SPELLINGS: dict[str, WeightFormat] = {
    "dense": WeightFormat.DENSE, "bf16": WeightFormat.DENSE,
    "fp8": WeightFormat.FP8_E4M3, "fp8_e4m3": WeightFormat.FP8_E4M3,
    "nvfp4": WeightFormat.NVFP4, "mxfp4": WeightFormat.MXFP4,
    "mxfp6": WeightFormat.MXFP6,
}
KV_SPELLINGS: dict[str, KvFormat] = {
    "bf16": KvFormat.BF16, "fp8": KvFormat.FP8_E4M3, "fp8_e4m3": KvFormat.FP8_E4M3, "nvfp4": KvFormat.NVFP4,
}


def parse_kv_format(value, allowed: Iterable[str] | None = None) -> KvFormat:
    """The KvFormat a spelling names ("fp8" and "fp8_e4m3" are one)."""
    return parse_spelling("KV format", value, KV_SPELLINGS, allowed)


def parse_spelling(what: str, value, spellings: dict, allowed: Iterable[str] | None):
    names = tuple(allowed) if allowed is not None else tuple(spellings)
    if not isinstance(value, str) or value not in names or value not in spellings:
        raise KilnError(f"unknown {what} {value!r}; choose one of {', '.join(names)}")
    return spellings[value]
