"""A dense (unquantized) linear weight: stored as the checkpoint's floating-point tensor, computed as it is."""

from __future__ import annotations

from typing import ClassVar

from kiln.kernels.formats import WeightFormat
from kiln.kernels.weight_codec import StoredTensor, WeightCodec


class DenseFormat(WeightCodec):
    """The checkpoint's own floating-point weight (BF16 in practice)."""

    name = WeightFormat.DENSE
    spellings = ("dense", "bf16")
    bits_per_weight = 16.0
    dequantizes = False

    def stored_bytes(self, out, in_features, recorded_in_features=None):
        return 2 * out * in_features

    def quantize(self, w, granularity="per_channel", global_scale=None):
        return {"weight": w}

    def dequantize(self, tensors, in_features=None):
        return tensors["weight"].float()

    def stored_tensors(self, out, in_features, weight_shape):
        return (StoredTensor("weight", "a dense weight", (), None if out is None else ((out, in_features),)),)

    export_names: ClassVar[dict] = {"onnx": "FLOAT"}  # the quantized layouts keep it as it is


DENSE_FORMAT = DenseFormat()
