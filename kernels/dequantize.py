"""One stored weight -> its fp32 values: the dispatcher over the formats' references (fp8, nvfp4, mxfp4, mxfp6).

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

from kiln.kernels import fp8
from kiln.kernels.errors import KilnError
from kiln.kernels.formats import WeightFormat


def dequantize(fmt: str, tensors: Mapping[str, torch.Tensor], in_features: int | None = None) -> torch.Tensor:
    """The fp32 [out, in] weight stored as `tensors` in format `fmt` (`in_features`: the block formats' K
    before padding)."""
    if fmt == WeightFormat.DENSE:
        return tensors["weight"].float()
    if fmt == WeightFormat.FP8_E4M3:
        return fp8.fp8_dequantize(tensors["weight"], tensors["weight_scale"])
    if fmt == WeightFormat.NVFP4:
        from kiln.kernels.nvfp4 import NVFP4_TENSOR_NAMES, Nvfp4Weight, nvfp4_dequantize

        return nvfp4_dequantize(Nvfp4Weight.from_tensors({k: tensors[k] for k in NVFP4_TENSOR_NAMES},
                                                         in_features=in_features))
    if fmt == WeightFormat.MXFP4:
        from kiln.kernels.mxfp4 import MXFP4_TENSOR_NAMES, Mxfp4Weight, mxfp4_dequantize

        return mxfp4_dequantize(Mxfp4Weight.from_tensors({k: tensors[k] for k in MXFP4_TENSOR_NAMES},
                                                         in_features=in_features))
    if fmt == WeightFormat.MXFP6:
        from kiln.kernels.mxfp6 import MXFP6_TENSOR_NAMES, Mxfp6Weight, mxfp6_dequantize

        return mxfp6_dequantize(Mxfp6Weight.from_tensors({k: tensors[k] for k in MXFP6_TENSOR_NAMES},
                                                         in_features=in_features))
    raise KilnError(f"unknown stored weight format {fmt!r}; known: {', '.join(WeightFormat)}")
