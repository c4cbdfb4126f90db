"""Scale layouts and element grids of Kiln's weight formats, in the form calibration algorithms need.

Every weight format is "one scale per block of columns, values on a fixed grid":

    Q[n, k] = grid(W[n, k] / m[n, k // B]) * m[n, k // B]        # m: the block's fp32 multiplier
    format   grid                       B                   m, and how it is stored
    fp8      E4M3, saturating at 448    K (per channel)     free fp32 per row          weight_scale [N, 1]
             E4M3                       K, all rows         free fp32 per tensor       weight_scale 0-dim
    nvfp4    E2M1, saturating at 6      16                  float(e4m3 code) * g       weight_scale [N, Kp/16],
                                                                                       weight_scale_2 = g
    mxfp4    E2M1                       32                  2^(e - 127)                weight_scale [N, Kp/32]
    mxfp6    E2M3, saturating at 7.5    32                  2^(e - 127)                weight_scale [N, Kp/32]

K is padded with zero columns to a multiple of B (padding never raises a block's maximum). The
arithmetic here is the kernels' own (divide by m, round, multiply by m, all in fp32), and `pack` hands the
chosen values and scales to the kernel references, so what a calibration algorithm optimizes is bit for bit
what the artifact stores. Calibration algorithms choose the scales (`scale_search`) and the grid points
(`gptq`); `Scales` carries both the fp32 multipliers and their stored form.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kiln.kernels.formats import WeightFormat
from kiln.kernels.mxfp4 import e8m0_to_float32
from kiln.kernels.registry import WEIGHT_FORMATS, WEIGHT_SPELLINGS, quantized_spellings
from kiln.kernels.weight_codec import WeightCodec

FORMATS = quantized_spellings()
FP8_GRANULARITIES = ("per_channel", "per_tensor")


@dataclass(frozen=True)
class Scales:
    """Per-block scales of one [N, K] weight.

    Attributes:
        multiplier: fp32 [N, blocks]: the value one grid unit stands for in each (row, block).
        stored: the stored form: fp8 {"weight_scale"}, nvfp4 {"weight_scale" (e4m3), "weight_scale_2"},
            mxfp4 and mxfp6 {"weight_scale" (uint8 E8M0 codes)}.
    """

    multiplier: Tensor
    stored: dict[str, Tensor]


@dataclass(frozen=True)
class WeightLayout:
    """How one format lays scales over a weight [N, K]: block width along K and the scale's constraints."""

    format: WeightFormat  # also given as the recipes' spelling "fp8"
    granularity: str = "per_channel"  # fp8 only

    def __post_init__(self) -> None:
        codec = WEIGHT_SPELLINGS.get(self.format) if isinstance(self.format, str) else None
        if codec is None or codec.recipe_name is None:
            raise ValueError(f"format={self.format!r} is not one of {FORMATS}")
        object.__setattr__(self, "format", codec.name)
        if self.granularity not in FP8_GRANULARITIES:
            raise ValueError(f"granularity={self.granularity!r} is not one of {FP8_GRANULARITIES}")

    @property
    def codec(self) -> WeightCodec:
        """The format's object (kernels/registry.py): its grid, scales and storage."""
        return WEIGHT_FORMATS[self.format]

    # --- shapes --------------------------------------------------------------------------------------------
    def block_size(self, in_features: int) -> int:
        return self.codec.grid_block_size(in_features)

    def num_blocks(self, in_features: int) -> int:
        return -(-in_features // self.block_size(in_features))

    def padded(self, w: Tensor) -> Tensor:
        """w [..., K] padded with zero columns to a whole number of blocks."""
        kp = self.num_blocks(w.shape[-1]) * self.block_size(w.shape[-1])
        return w if kp == w.shape[-1] else torch.nn.functional.pad(w, (0, kp - w.shape[-1]))

    def blocks(self, w: Tensor) -> Tensor:
        """w [N, K] -> [N, blocks, B] (zero-padded)."""
        bs = self.block_size(w.shape[-1])
        return self.padded(w.float()).reshape(w.shape[0], -1, bs)

    # --- the grid ------------------------------------------------------------------------------------------
    def round_(self, scaled: Tensor) -> Tensor:
        """Nearest grid value (saturating) of fp32 values already divided by their multiplier, in place (the
        tensor is returned): no fp32 temporaries, which at an 8B model's sizes cost more in page faults than the
        rounding itself."""
        return self.codec.grid_round_(scaled)

    def quantize(self, w: Tensor, scales: Scales) -> Tensor:
        """Fake-quantized fp32 values of w [N, K] with the given scales (the kernels' arithmetic)."""
        m = scales.multiplier.unsqueeze(-1)  # [N, blocks, 1]
        q = self.round_(self.blocks(w) / m).mul_(m)
        return q.reshape(w.shape[0], -1)[:, : w.shape[1]]

    # --- scales --------------------------------------------------------------------------------------------
    def absmax_scales(self, w: Tensor, global_scale: Tensor | None = None) -> Scales:
        """The kernels' default scales (block maximum onto the grid maximum)."""
        w = w.float()
        return Scales(*self.codec.grid_absmax_scales(w, self.padded(w), self.granularity, global_scale))

    def fp8_scales(self, scale: Tensor, rows: int | None = None) -> Scales:
        """From fp32 scales: [N, 1] per channel, or 0-dim per tensor (then `rows` gives N)."""
        scale = scale.float()
        if self.granularity == "per_tensor":
            scale = scale.reshape(())
            n = rows if rows is not None else 1
            return Scales(scale.expand(n, 1).clone(), {"weight_scale": scale})
        return Scales(scale.reshape(-1, 1), {"weight_scale": scale.reshape(-1, 1)})

    @staticmethod
    def nvfp4_scales(block_scale: Tensor, global_scale: Tensor) -> Scales:
        g = global_scale.float().reshape(())
        return Scales(block_scale.float() * g, {"weight_scale": block_scale, "weight_scale_2": g})

    @staticmethod
    def mxfp4_scales(scale_e8m0: Tensor) -> Scales:
        return Scales(e8m0_to_float32(scale_e8m0), {"weight_scale": scale_e8m0})

    def scales_from_stored(self, tensors: dict[str, Tensor], rows: int) -> Scales:
        """The Scales of an already stored weight (its ModelOpt-named tensors; extra keys are ignored)."""
        return Scales(*self.codec.grid_scales(tensors, self.granularity, rows))

    # --- storage -------------------------------------------------------------------------------------------
    def pack(self, values: Tensor, scales: Scales) -> dict[str, Tensor]:
        """Stored tensors (ModelOpt names) for `values` [N, K] that already lie on the grid of `scales`.

        The kernel references re-encode the values with the given scales; values on the grid come back
        unchanged, so dequantizing the result gives `values` again.
        """
        return self.codec.grid_pack(values.float(), scales.stored)
