"""MSE scale search: never worse than absmax (absmax is candidate 0), every chosen scale is storable, and on
heavy-tailed blocks the "4 over 6" choice is actually taken."""

from __future__ import annotations

import pytest
import torch

from kiln.calibration.grids import WeightLayout
from kiln.calibration.scale_search import block_errors, mse_scales
from kiln.passes.linear_quant import quantize_linear_weight

CASES = [("fp8", "per_channel"), ("fp8", "per_tensor"), ("nvfp4", "per_channel"), ("mxfp4", "per_channel"),
         ("mxfp6", "per_channel")]


def weighted_error(layout, w, scales, importance):
    d = (layout.quantize(w, scales) - w).pow(2)
    return float((d * importance).sum())


@pytest.mark.parametrize("fmt, granularity", CASES)
@pytest.mark.parametrize("seed", range(4))
def test_mse_never_worse_than_absmax(fmt, granularity, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(40, 100, generator=g) * torch.rand(40, 1, generator=g)
    w = w * (1 + 4 * (torch.rand(40, 100, generator=g) > 0.97))  # outliers
    importance = torch.rand(100, generator=g) + 0.01
    layout = WeightLayout(fmt, granularity)
    best = mse_scales(layout, w, importance)
    absmax = layout.absmax_scales(w)
    assert weighted_error(layout, w, best, importance) <= weighted_error(layout, w, absmax, importance)
    # per block too, for the block formats, given the per-tensor scale (each block is searched on its own)
    if fmt != "fp8":
        g = absmax.stored.get("weight_scale_2")
        best = mse_scales(layout, w, importance, g) if g is not None else best
        e_best = block_errors(layout, w, best.multiplier.unsqueeze(-1), importance)
        e_abs = block_errors(layout, w, absmax.multiplier.unsqueeze(-1), importance)
        assert bool((e_best <= e_abs).all())


@pytest.mark.parametrize("fmt, granularity", CASES)
def test_searched_scales_are_stored_exactly(fmt, granularity):
    w = torch.randn(24, 70)
    stored = quantize_linear_weight(w, fmt, granularity, method="mse")
    layout = WeightLayout(fmt, granularity)
    assert torch.equal(stored.dequantize(), layout.quantize(w, mse_scales(layout, w)))


def test_nvfp4_search_scales_up_where_the_block_maximum_on_6_loses():
    # a block of 16 whose maximum is 1.0 and the rest 0.8: the maximum on 6 puts 0.8 at 4.8, between 4 and 6;
    # a larger scale (the maximum on 4, or 0.8 right on 4) does much better. The block holds the tensor
    # maximum, so this needs the larger per-tensor scale too.
    w = torch.full((1, 16), 0.8)
    w[0, 0] = 1.0
    layout = WeightLayout("nvfp4")
    best, absmax = mse_scales(layout, w), layout.absmax_scales(w)
    assert float(best.multiplier[0, 0]) > 1.15 * float(absmax.multiplier[0, 0])
    assert float(best.stored["weight_scale_2"]) > float(absmax.stored["weight_scale_2"])
    assert weighted_error(layout, w, best, torch.ones(16)) < 0.5 * weighted_error(layout, w, absmax, torch.ones(16))


def test_mxfp4_search_moves_the_exponent_up_when_floor_clips():
    w = torch.full((1, 32), 0.1)
    w[0, :4] = 7.5  # FLOOR puts 7.5 at 7.5 / 2^0 = 7.5 > 6: clipped to 6
    layout = WeightLayout("mxfp4")
    best = mse_scales(layout, w)
    assert int(best.stored["weight_scale"][0, 0]) == int(layout.absmax_scales(w).stored["weight_scale"][0, 0]) + 1
