"""The ONNX export's Q/DQ nodes: each stored weight behind DequantizeLinear in its own number format, the
activation and KV fake quantizers (QuantizeLinear -> DequantizeLinear, or kernels.fp8's dynamic quantizer op for
op), the block-Hadamard input rotation, and the taps the check holds to kernels/ bit for bit.

    w = weight_nodes(g, lin, fmt, tensors)               the fp32 [out, in] weight as the graph computes it
    WEIGHT_LOWERINGS                                     the formats' "onnx" names it lowers
    y = fp8_static(g, x, scale, None, name)              a calibrated per-tensor scale (1-D: along `axis`)
    y = fp8_dynamic(g, x, [1], name)                     one scale per row, amax / 448
    y, tap = kv_store(g, k, stream, name)                what the layer's KV format stores, read back in fp32
(the lowering is in onnx_lowering.py, the graph builder in onnx_graph.py)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial

import ml_dtypes
import numpy as np
import torch
from onnx import TensorProto

from kiln.kernels import fp8
from kiln.kernels.formats import ActivationFormat
from kiln.kernels.fp8 import E4M3_MAX
from kiln.kernels.kv_quant import kv_fake_quantize
from kiln.kernels.registry import weight_format
from kiln.kernels.rotation import block_sizes, hadamard_matrix
from kiln.kernels.weight_codec import WeightCodec
from kiln.optimizer.export.onnx_graph import GraphBuilder, float32, raw_bytes
from kiln.runtime.kv_format import KvStream
from kiln.runtime.spec import LinearSpec


@dataclass(frozen=True)
class Tap:
    """One activation or KV quantizer in the graph: what goes in, what comes out, and how kernels/ compute it."""

    kind: str  # an ActivationFormat, or "kv"
    where: str  # the linear whose input it quantizes, or the layer's cached stream
    x: str
    y: str
    scale: np.ndarray | None = None  # fp8_static_per_tensor
    stream: KvStream | None = None  # kv

    def expected(self, x: np.ndarray) -> np.ndarray:
        """Kiln's own fake quantizer on the graph's input `x` (kernels.fp8, kernels.kv_quant)."""
        t = torch.from_numpy(x)
        if self.kind == ActivationFormat.FP8_DYNAMIC_PER_TOKEN:
            return fp8.fp8_fake_quantize_per_token(t).numpy()
        if self.kind == ActivationFormat.FP8_STATIC_PER_TENSOR:
            return fp8.fp8_fake_quantize_per_tensor(t, torch.from_numpy(self.scale)).numpy()
        s = self.stream  # x [B, H, T, D] -> the kernels' [tokens, H, D] and back
        tokens = t.transpose(1, 2).reshape(-1, *t.shape[1:2], t.shape[3])
        out = kv_fake_quantize(tokens, s.format, s.scaling, s.scale, s.offset)
        return out.reshape(t.shape[0], t.shape[2], t.shape[1], t.shape[3]).transpose(1, 2).numpy()


def weight_nodes(g: GraphBuilder, lin: LinearSpec, fmt: str, tensors: Mapping[str, torch.Tensor]) -> str:
    """The fp32 [out, in] weight of `lin`, stored in format `fmt`, as the graph computes it (the lowering its
    format object names for "onnx")."""
    codec = weight_format(fmt)
    return WEIGHT_LOWERINGS[codec.export_names["onnx"]](g, lin, codec, tensors)


def _float_weight(g: GraphBuilder, lin: LinearSpec, codec: WeightCodec, tensors: Mapping[str, torch.Tensor]) -> str:
    return g.initializer(f"{lin.name}.weight", float32(tensors[f"{lin.name}.weight"]))


def _fp8_weight(g: GraphBuilder, lin: LinearSpec, codec: WeightCodec, tensors: Mapping[str, torch.Tensor]) -> str:
    """FLOAT8E4M3FN codes -> DequantizeLinear with the fp32 scale per tensor, or per output channel (axis 0)."""
    name, w = lin.name, tensors[f"{lin.name}.weight"]
    codes = g.raw(f"{name}.weight", TensorProto.FLOAT8E4M3FN, tuple(w.shape), raw_bytes(w))
    scale = float32(tensors[f"{name}.weight_scale"])
    if scale.size == 1:
        return g.op("DequantizeLinear", [codes, g.initializer(f"{name}.weight_scale", scale.reshape(()))], name)
    return g.op("DequantizeLinear", [codes, g.initializer(f"{name}.weight_scale", scale.reshape(-1))],
                name, axis=0)


def _fp4_weight(g: GraphBuilder, lin: LinearSpec, codec: WeightCodec, tensors: Mapping[str, torch.Tensor],
                e8m0_scales: bool) -> str:
    """FLOAT4E2M1 codes [out, Kp] -> blocked DequantizeLinear (axis 1), then Slice off the padding columns.
    Block scales: FLOAT8E4M3FN times the fp32 global scale (NVFP4), or E8M0 as bfloat16 (MXFP4)."""
    name, w = lin.name, tensors[f"{lin.name}.weight"]
    block = codec.grid_block_size(lin.in_features)
    out, padded = w.shape[0], w.shape[1] * 2
    codes = g.raw(f"{name}.weight", TensorProto.FLOAT4E2M1, (out, padded), raw_bytes(w))
    stored = tensors[f"{name}.weight_scale"]
    if not e8m0_scales:
        block_scale = g.raw(f"{name}.weight_scale", TensorProto.FLOAT8E4M3FN, tuple(stored.shape), raw_bytes(stored))
        global_scale = g.initializer(f"{name}.weight_scale_2",
                                     float32(tensors[f"{name}.weight_scale_2"]).reshape(()))
        scale = g.op("DequantizeLinear", [block_scale, global_scale], f"{name}.weight_scale")
        value = g.op("DequantizeLinear", [codes, scale], name, axis=1, block_size=block)
    else:  # E8M0 code e is 2^(e - 127), exact in bfloat16 (8 exponent bits, subnormals for 2^-127)
        powers = np.ldexp(np.float32(1.0), stored.numpy().astype(np.int32) - 127).astype(np.float32)
        scale = g.initializer(f"{name}.weight_scale", powers.astype(ml_dtypes.bfloat16))
        value = g.op("DequantizeLinear", [codes, scale], name, axis=1, block_size=block,
                     output_dtype=TensorProto.FLOAT)
    if padded == lin.in_features:
        return value
    return g.op("Slice", [value, g.const([0], np.int64), g.const([lin.in_features], np.int64),
                          g.const([1], np.int64)], name)


WEIGHT_LOWERINGS = {
    "FLOAT": _float_weight,
    "FLOAT8E4M3FN": _fp8_weight,
    "FLOAT4E2M1+FLOAT8E4M3FN": partial(_fp4_weight, e8m0_scales=False),
    "FLOAT4E2M1+E8M0": partial(_fp4_weight, e8m0_scales=True),
}
"""A format object's "onnx" name -> how the graph computes its weight (the formats ONNX has types for)."""


def fp8_static(g: GraphBuilder, x: str, scale: np.ndarray, axis: int | None, name: str) -> str:
    """QuantizeLinear -> DequantizeLinear to FLOAT8E4M3FN with a fixed scale (0-dim, or 1-D along `axis`)."""
    zero = g.raw(f"{name}.zero_point", TensorProto.FLOAT8E4M3FN, scale.shape, bytes(scale.size))
    scale_name = g.initializer(f"{name}.scale", scale)
    kw = {} if axis is None else {"axis": axis}
    return g.op("DequantizeLinear", [g.op("QuantizeLinear", [x, scale_name, zero], name, **kw), scale_name],
                name, **kw)


def fp8_dynamic(g: GraphBuilder, x: str, axes: list[int], name: str) -> str:
    """kernels.fp8's dynamic fake quantizer: one scale per slice over `axes` (amax / 448, 1 where 0)."""
    amax = g.op("ReduceMax", [g.op("Abs", [x], name), g.const(axes, np.int64)], name, keepdims=1)
    scale = g.op("Div", [amax, g.const(E4M3_MAX)], name)
    scale = g.op("Where", [g.op("Greater", [scale, g.const(0.0)], name), scale, g.const(1.0)], name)
    scaled = g.op("Clip", [g.op("Div", [x, scale], name), g.const(-E4M3_MAX), g.const(E4M3_MAX)], name)
    codes = g.op("Cast", [scaled], name, to=TensorProto.FLOAT8E4M3FN)
    return g.op("Mul", [g.op("Cast", [codes], name, to=TensorProto.FLOAT), scale], name)


def rotate(g: GraphBuilder, x: str, in_features: int, block_size: int, name: str) -> str:
    """x R for kernels.rotation's block Hadamard R: whole blocks as one MatMul on [tokens, K/b, b], then
    the tail's power-of-two pieces."""
    full = (in_features // block_size) * block_size
    parts, start = [], 0

    def piece(lo: int, hi: int) -> str:
        if lo == 0 and hi == in_features:
            return x
        return g.op("Slice", [x, g.const([lo], np.int64), g.const([hi], np.int64), g.const([1], np.int64)],
                    name)

    if full:
        blocks = g.op("Reshape", [piece(0, full), g.const([-1, full // block_size, block_size], np.int64)], name)
        rotated = g.op("MatMul", [blocks, g.const(hadamard_matrix(block_size).numpy())], name)
        parts.append(g.op("Reshape", [rotated, g.const([-1, full], np.int64)], name))
        start = full
    for size in block_sizes(in_features, block_size)[full // block_size:]:
        parts.append(g.op("MatMul", [piece(start, start + size), g.const(hadamard_matrix(size).numpy())], name))
        start += size
    return parts[0] if len(parts) == 1 else g.op("Concat", parts, name, axis=1)


def kv_store(g: GraphBuilder, x: str, stream: KvStream, name: str) -> tuple[str, Tap]:
    """What an FP8 KV stream stores for new K or V [B, Hkv, T, D], read back in fp32, and its tap."""
    centered, offset = x, None
    if stream.offset is not None:
        offset = g.initializer(f"{name}.offset", float32(stream.offset)[:, None, :])  # [H, 1, D]
        centered = g.op("Sub", [x, offset], name)
    if stream.scaling == "dynamic":
        out = fp8_dynamic(g, centered, [1, 3], name)  # one scale per token, over heads and dims
    elif stream.scaling == "per_head":
        out = fp8_static(g, centered, float32(stream.scale).reshape(-1), 1, name)
    else:
        out = fp8_static(g, centered, float32(stream.scale).reshape(()), None, name)
    out = out if offset is None else g.op("Add", [out, offset], name)
    return out, Tap("kv", name, x, out, stream=stream)
