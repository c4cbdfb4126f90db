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

from kiln.kernels import fp8
from kiln.kernels.formats import WeightFormat, parse_weight_format
from kiln.kernels.fp4 import e2m1_decode, e2m1_encode
from kiln.kernels.mxfp4 import MXFP4_BLOCK_SIZE, e8m0_to_float32, mxfp4_block_scales, mxfp4_quantize
from kiln.kernels.mxfp6 import e2m3_decode, e2m3_encode, mxfp6_quantize
from kiln.kernels.nvfp4 import (
    NVFP4_BLOCK_SIZE,
    nvfp4_block_scales,
    nvfp4_global_scale,
    nvfp4_quantize,
)

FORMATS = ("fp8", "nvfp4", "mxfp4", "mxfp6")
E8M0_FORMATS = (WeightFormat.MXFP4, WeightFormat.MXFP6)  # power-of-two block scales, one per 32
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
        if self.format not in (*FORMATS, WeightFormat.FP8_E4M3):
            raise ValueError(f"format={self.format!r} is not one of {FORMATS}")
        object.__setattr__(self, "format", parse_weight_format(self.format))
        if self.granularity not in FP8_GRANULARITIES:
            raise ValueError(f"granularity={self.granularity!r} is not one of {FP8_GRANULARITIES}")

    # --- shapes --------------------------------------------------------------------------------------------
    def block_size(self, in_features: int) -> int:
        if self.format == WeightFormat.NVFP4:
            return NVFP4_BLOCK_SIZE
        if self.format in E8M0_FORMATS:
            return MXFP4_BLOCK_SIZE
        return in_features

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
        if self.format == WeightFormat.FP8_E4M3:
            scaled.clamp_(-fp8.E4M3_MAX, fp8.E4M3_MAX)
            return scaled.copy_(scaled.to(fp8.FP8_DTYPE))
        if self.format == WeightFormat.MXFP6:
            return scaled.copy_(e2m3_decode(e2m3_encode(scaled)))
        return scaled.copy_(e2m1_decode(e2m1_encode(scaled)))

    def quantize(self, w: Tensor, scales: Scales) -> Tensor:
        """Fake-quantized fp32 values of w [N, K] with the given scales (the kernels' arithmetic)."""
        m = scales.multiplier.unsqueeze(-1)  # [N, blocks, 1]
        q = self.round_(self.blocks(w) / m).mul_(m)
        return q.reshape(w.shape[0], -1)[:, : w.shape[1]]

    # --- scales --------------------------------------------------------------------------------------------
    def absmax_scales(self, w: Tensor, global_scale: Tensor | None = None) -> Scales:
        """The kernels' default scales (block maximum onto the grid maximum)."""
        w = w.float()
        if self.format == WeightFormat.FP8_E4M3:  # the kernel's scales, without quantizing
            if self.granularity == "per_channel":
                scale = fp8.fp8_scale_per_channel(w)
                return Scales(scale.reshape(-1, 1), {"weight_scale": scale})
            return self.fp8_scales(fp8.fp8_scale_per_tensor(w), rows=w.shape[0])
        if self.format == WeightFormat.NVFP4:
            g = nvfp4_global_scale(w) if global_scale is None else global_scale.float().reshape(())
            return self.nvfp4_scales(nvfp4_block_scales(self.padded(w), g), g)
        return self.mxfp4_scales(mxfp4_block_scales(self.padded(w)))

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
        if self.format == WeightFormat.FP8_E4M3:
            return self.fp8_scales(tensors["weight_scale"], rows=rows)
        if self.format == WeightFormat.NVFP4:
            return self.nvfp4_scales(tensors["weight_scale"], tensors["weight_scale_2"])
        return self.mxfp4_scales(tensors["weight_scale"])

    # --- storage -------------------------------------------------------------------------------------------
    def pack(self, values: Tensor, scales: Scales) -> dict[str, Tensor]:
        """Stored tensors (ModelOpt names) for `values` [N, K] that already lie on the grid of `scales`.

        The kernel references re-encode the values with the given scales; values on the grid come back
        unchanged, so dequantizing the result gives `values` again.
        """
        values = values.float()
        if self.format == WeightFormat.FP8_E4M3:
            scale = scales.stored["weight_scale"]
            q = (values / scale).clamp(-fp8.E4M3_MAX, fp8.E4M3_MAX).to(fp8.FP8_DTYPE)
            return {"weight": q, "weight_scale": scale}
        if self.format == WeightFormat.NVFP4:
            q = nvfp4_quantize(values, global_scale=scales.stored["weight_scale_2"],
                               block_scale=scales.stored["weight_scale"])
            return q.tensors()
        quantize = mxfp6_quantize if self.format == WeightFormat.MXFP6 else mxfp4_quantize
        return quantize(values, scale_e8m0=scales.stored["weight_scale"]).tensors()
