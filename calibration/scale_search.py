"""MSE-optimal scale search: per block for NVFP4/MXFP4, per channel (or tensor) for FP8.

For each (row, block), try a few scales that the format can store and keep the one with the lowest
importance-weighted squared error  sum_k importance[k] * (w[k] - Q(w)[k])^2 ; importance is the diagonal
of the layer's input Hessian (E[x_k^2]) when calibration data is available, else 1. The absmax scale is
always candidate 0 and ties keep the earlier candidate, so the search is never worse than absmax.

    nvfp4   E4M3 block-scale codes from the absmax code - 1 up to the code that maps the block maximum onto
            4 (instead of 6) + 1, i.e. the "4 over 6" choice plus every E4M3 step between; with the
            per-tensor scale amax / (6 * 448) and with one 6/4 larger (the block holding the tensor maximum
            needs it to map onto 4), keeping the better
    mxfp4   E8M0 exponents absmax - 1, absmax, absmax + 1 (the default FLOOR exponent clips values in (6, 8));
    mxfp6   the same (FLOOR clips values in (7.5, 8))
    fp8     amax * r / 448 for r in a grid from 1 down to `fp8_min_ratio` (E4M3 is floating point: clipping
            the largest weights rarely pays, but it costs nothing to check)
"""

from __future__ import annotations

import torch
from torch import Tensor

from kiln.calibration.grids import Scales, WeightLayout
from kiln.kernels.fp4 import E2M1_MAX
from kiln.kernels.mxfp4 import e8m0_to_float32

NVFP4_CODE_OFFSETS = (0, -1, 1, 2, 3, 4, 5, 6)  # e4m3 code steps from the absmax code; 4/6 is ~4.7 steps
MXFP4_EXPONENT_OFFSETS = (0, 1, -1)
FP8_RATIOS = tuple(1.0 - 0.02 * i for i in range(16))  # 1.00 ... 0.70
_E4M3_MAX_CODE = 0x7E  # 448
_E4M3_MIN_CODE = 0x01  # 2^-9


CHUNK_ELEMENTS = 1 << 24
"""Most candidate values [rows, blocks, C, B] materialised at once (64 MiB fp32): rows are searched in chunks,
so an 8B model's 14336 x 4096 weight costs no more memory than a small one's."""


def block_errors(layout: WeightLayout, w: Tensor, multipliers: Tensor, importance: Tensor | None) -> Tensor:
    """Weighted squared error of every candidate: multipliers [N, blocks, C] -> errors [N, blocks, C]."""
    blocks = layout.blocks(w).unsqueeze(2)  # [N, blocks, 1, B]
    imp = None
    if importance is not None:
        imp = layout.padded(importance.float().reshape(1, -1)).reshape(1, blocks.shape[1], 1, -1)
    per_row = blocks.shape[1] * multipliers.shape[-1] * blocks.shape[-1]
    step = max(1, CHUNK_ELEMENTS // per_row)
    out = []
    for r in range(0, blocks.shape[0], step):
        b = blocks[r:r + step]
        m = multipliers[r:r + step].unsqueeze(-1)  # [n, blocks, C, 1]
        err = layout.round_(b / m).mul_(m).sub_(b).square_()  # [n, blocks, C, B], one buffer
        if imp is not None:
            err.mul_(imp)
        out.append(err.sum(-1))
    return torch.cat(out) if len(out) > 1 else out[0]


def mse_scales(layout: WeightLayout, w: Tensor, importance: Tensor | None = None,
               global_scale: Tensor | None = None) -> Scales:
    """The stored scales, per block, that minimize the importance-weighted squared error of w [N, K]."""
    w = w.float()
    if layout.codec.takes_global_scale:
        if global_scale is not None:
            return _nvfp4_block_search(layout, w, importance, global_scale)[0]
        # The per-tensor scale maps the largest block scale onto E4M3's 448, which leaves the block holding the
        # tensor maximum no room to map it onto 4; a per-tensor scale 6/4 larger gives every block both choices.
        g6 = layout.absmax_scales(w).stored["weight_scale_2"]
        found = [_nvfp4_block_search(layout, w, importance, g) for g in (g6, g6 * (E2M1_MAX / 4))]
        return min(found, key=lambda f: f[1])[0]  # ties keep the absmax per-tensor scale
    base = layout.absmax_scales(w, global_scale)
    if layout.codec.power_of_two_block_scales:
        codes = base.stored["weight_scale"].to(torch.int16)
        offsets = torch.tensor(MXFP4_EXPONENT_OFFSETS, dtype=torch.int16)
        cand = (codes.unsqueeze(-1) + offsets).clamp(0, 254).to(torch.uint8)  # [N, blocks, C]
        best = _argmin(block_errors(layout, w, e8m0_to_float32(cand), importance))
        return layout.mxfp4_scales(cand.gather(-1, best.unsqueeze(-1)).squeeze(-1))
    # fp8: free fp32 scales, absmax * ratio
    ratios = torch.tensor(FP8_RATIOS, dtype=torch.float32)
    if layout.granularity == "per_channel":
        amax = w.abs().amax(dim=1)  # [N]
        cand = _safe(amax.unsqueeze(-1) * ratios / layout.codec.grid_max)  # [N, C]
        cand[:, 0] = base.multiplier[:, 0]  # exactly the kernel's absmax scale
        best = _argmin(block_errors(layout, w, cand.unsqueeze(1), importance))[:, 0]
        return layout.fp8_scales(cand.gather(-1, best.view(-1, 1)))
    amax = w.abs().amax()
    cand = _safe(amax * ratios / layout.codec.grid_max)
    cand[0] = base.stored["weight_scale"]
    err = block_errors(layout, w, cand.expand(w.shape[0], 1, -1), importance).sum(dim=(0, 1))  # [C]
    return layout.fp8_scales(cand[_argmin(err)], rows=w.shape[0])


def _nvfp4_block_search(layout: WeightLayout, w: Tensor, importance: Tensor | None,
                        global_scale: Tensor) -> tuple[Scales, float]:
    base = layout.absmax_scales(w, global_scale)
    codes = base.stored["weight_scale"].view(torch.uint8).to(torch.int16)  # e4m3 codes are monotone
    offsets = torch.tensor(NVFP4_CODE_OFFSETS, dtype=torch.int16)
    cand = (codes.unsqueeze(-1) + offsets).clamp(_E4M3_MIN_CODE, _E4M3_MAX_CODE).to(torch.uint8)
    g = base.stored["weight_scale_2"]  # cand: [N, blocks, C] e4m3 codes
    errors = block_errors(layout, w, cand.view(torch.float8_e4m3fn).float() * g, importance)
    best = _argmin(errors)
    chosen = cand.gather(-1, best.unsqueeze(-1)).squeeze(-1).view(torch.float8_e4m3fn)
    return layout.nvfp4_scales(chosen, g), float(errors.gather(-1, best.unsqueeze(-1)).sum())


def _safe(scale: Tensor) -> Tensor:
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _argmin(err: Tensor) -> Tensor:
    """argmin over the last dim, ties to the lowest index (candidate 0 is absmax)."""
    best_err = err.amin(dim=-1, keepdim=True)
    idx = torch.arange(err.shape[-1]).expand_as(err)
    return torch.where(err <= best_err, idx, err.shape[-1]).amin(dim=-1)
