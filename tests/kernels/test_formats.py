"""Format names: one typed value per format, equal to (and serialized as) the manifest's string."""

from __future__ import annotations

import json

import pytest

from kiln.kernels.errors import KilnError
from kiln.kernels.formats import (
    ActivationFormat,
    KvFormat,
    WeightFormat,
    parse_kv_format,
)
from kiln.kernels.registry import parse_weight_format


def test_members_are_the_manifest_strings():
    assert [str(f) for f in WeightFormat] == ["dense", "fp8_e4m3", "nvfp4", "mxfp4", "mxfp6"]
    assert [str(f) for f in ActivationFormat] == ["none", "fp8_dynamic_per_token", "fp8_static_per_tensor",
                                                  "nvfp4", "mxfp4"]
    assert [str(f) for f in KvFormat] == ["bf16", "fp8_e4m3", "nvfp4"]
    entry = {"format": WeightFormat.NVFP4, "activation": ActivationFormat.NONE, "kv": KvFormat.FP8_E4M3}
    assert json.dumps(entry) == json.dumps({"format": "nvfp4", "activation": "none", "kv": "fp8_e4m3"})
    assert {"nvfp4": 1}[WeightFormat.NVFP4] == 1 and WeightFormat.FP8_E4M3 in frozenset({"fp8_e4m3"})


def test_recipe_spellings_parse_to_one_member():
    assert parse_weight_format("fp8") is parse_weight_format("fp8_e4m3") is WeightFormat.FP8_E4M3
    assert parse_weight_format("bf16") is WeightFormat.DENSE
    assert parse_kv_format("fp8") is KvFormat.FP8_E4M3


@pytest.mark.parametrize("bad", ["fp4", "FP8", None, 8, ["nvfp4"]])
def test_unknown_spellings_are_one_line_errors_naming_the_allowed_set(bad):
    with pytest.raises(KilnError, match=r"^unknown weight format .*; choose one of fp8, nvfp4, mxfp4$"):
        parse_weight_format(bad, ("fp8", "nvfp4", "mxfp4"))
