"""The weight formats' registry and their objects: one object per format, found by any of its spellings, whose
codec, layout and grid agree with the format's own module."""

import pytest
import torch

from kiln.kernels.dequantize import dequantize
from kiln.kernels.errors import KilnError
from kiln.kernels.formats import WeightFormat
from kiln.kernels.registry import WEIGHT_FORMATS, quantized_spellings, weight_format


def test_every_weight_format_name_has_one_object_and_spellings_resolve():
    assert list(WEIGHT_FORMATS)[: len(WeightFormat)] == list(WeightFormat)
    assert weight_format("fp8") is weight_format("fp8_e4m3") is WEIGHT_FORMATS[WeightFormat.FP8_E4M3]
    assert weight_format("bf16") is weight_format("dense")
    assert quantized_spellings()[:4] == ("fp8", "nvfp4", "mxfp4", "mxfp6")
    with pytest.raises(KilnError, match="unknown stored weight format 'int3'; known: dense, fp8_e4m3"):
        weight_format("int3")


@pytest.mark.parametrize("name", [n for n, c in WEIGHT_FORMATS.items() if c.recipe_name is not None])
def test_quantize_dequantize_round_trip_matches_the_grid(name):
    codec = weight_format(name)
    w = torch.randn(8, 40, generator=torch.Generator().manual_seed(0))
    stored = codec.quantize(w)
    assert set(stored) == set(codec.tensor_names)
    in_features = 40 if codec.blocked else None
    values = dequantize(name, stored, in_features)
    assert values.shape == (8, 40)
    # the grid's own arithmetic (what calibration optimizes) reproduces the stored values bit for bit
    padded = w if not codec.blocked else torch.nn.functional.pad(w, (0, -(-40 // codec.grid_block_size(40))
                                                                     * codec.grid_block_size(40) - 40))
    _multiplier, scales = codec.grid_absmax_scales(w, padded, "per_channel", None)
    repacked = codec.grid_pack(values, scales)
    assert torch.equal(dequantize(name, repacked, in_features), values)


@pytest.mark.parametrize("name", list(WEIGHT_FORMATS))
def test_stored_layout_names_every_stored_tensor(name):
    codec = weight_format(name)
    layout = codec.stored_tensors(8, 64, (8, 64))
    assert tuple(t.key for t in layout) == codec.tensor_names
