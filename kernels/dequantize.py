"""One stored weight -> its fp32 values: the format object's own reference (kernels/registry.py).

    dequantize(format, tensors, in_features)
        dense     weight.float()
        fp8_e4m3  weight * weight_scale (per tensor or per output channel)
        nvfp4     E2M1 codes * E4M3 block scale * FP32 global scale (kernels.nvfp4)
        mxfp4     E2M1 codes * E8M0 block scale (kernels.mxfp4)
        mxfp6     E2M3 codes * E8M0 block scale (kernels.mxfp6)

`tensors` is keyed by the short names of ModelOpt's unified checkpoint ("weight", "weight_scale",
"weight_scale_2"); other keys (an "input_scale") are ignored. The runtime's loader (runtime.weights) checks an
artifact's tensors first and then calls this; the passes call it on their own QuantizedWeight.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kiln.kernels.registry import weight_format


def dequantize(fmt: str, tensors: Mapping[str, torch.Tensor], in_features: int | None = None) -> torch.Tensor:
    """The fp32 [out, in] weight stored as `tensors` in format `fmt` (`in_features`: the block formats' K
    before padding)."""
    return weight_format(fmt).dequantize(tensors, in_features)
