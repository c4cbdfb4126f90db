"""What the NVFP4 and MXFP4 tests share: the E2M1 grid, bit views, weights with a spread of magnitudes, and
the round-to-nearest error bound."""

from __future__ import annotations

import torch

from kiln.kernels.fp4 import E2M1_VALUES

GRID = torch.tensor(E2M1_VALUES[:8])


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.float().contiguous().view(torch.int32)


def spread_weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Gaussian rows with a spread of magnitudes, so blocks get many different scales."""
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=generator) * 0.02
    return w * torch.logspace(-3, 1, cols).roll(seed)[None, :]


def half_step(magnitude_over_scale: torch.Tensor) -> torch.Tensor:
    """Half the E2M1 grid spacing around |w| / scale; beyond 6 the error is the saturation overshoot."""
    r = magnitude_over_scale
    half = torch.where(r <= 2, 0.25, torch.where(r <= 4, 0.5, 1.0))
    return torch.maximum(half, r - 6)
