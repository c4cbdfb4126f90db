"""The runtime's linear layers: `QuantLinear` over a dequantized weight, `PackedLinear` over the stored bytes.

    linear = QuantLinear(weight, bias, input_quantizer)     # weight [out, in] fp32; y = x @ W^T (+ bias)
    linear.prepack_onednn()                                 # CPU: a oneDNN copy of the weight, when it fits
    packed = PackedLinear("nvfp4", stored, in_features, "none", None, bias, None)

A QuantLinear holds the dequantized weight and the activation fake-quantizer its format asks for, so a
Triton kernel reading packed bytes (PackedLinear, kiln.kernels.gpu) can replace it one module at a time.
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from kiln.kernels import gpu
from kiln.kernels.registry import WEIGHT_FORMATS
from kiln.kernels.registry import weight_format as weight_format_object
from kiln.runtime.weights import InputTransform


class QuantLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 input_quantizer: Callable[[torch.Tensor], torch.Tensor] | None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out, in] fp32
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.input_quantizer = input_quantizer
        self.onednn: torch.Tensor | None = None  # prepack_onednn()
        self.onednn_handle = -1

    def prepack_onednn(self) -> int:
        """Keep a copy of the weight in oneDNN's blocked layout too, through which every product on the CPU is
        faster than MKL's from the dense weight (ONEDNN_BATCH_HINT); the bytes it adds (0: not this linear: one
        with an input quantizer, not fp32, or not on the CPU)."""
        w = self.weight
        if self.input_quantizer is not None or w.dtype != torch.float32 or w.device.type != "cpu":
            return 0
        self.onednn = torch.ops.mkldnn._reorder_linear_weight(w.detach(), ONEDNN_BATCH_HINT)
        self.onednn_handle = next(_ONEDNN_HANDLES)
        _ONEDNN_LINEARS[self.onednn_handle] = self
        return w.numel() * w.element_size()

    def drop_onednn(self) -> None:
        """Free the oneDNN copy, if any: products go through the dense weight again (equal within fp32
        rounding)."""
        _ONEDNN_LINEARS.pop(self.onednn_handle, None)
        self.onednn, self.onednn_handle = None, -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_quantizer is not None:
            x = self.input_quantizer(x).to(self.weight.dtype)
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if self.onednn is not None and x.device.type == "cpu" and x.dtype == torch.float32 and rows \
                and not (x.requires_grad and torch.is_grad_enabled()):  # (the op has no backward)
            # compiled: one opaque op around the same product, so a compiled step multiplies as an eager one
            product = torch.ops.kiln.onednn_linear if torch.compiler.is_compiling() else onednn_product
            out = product(x.reshape(rows, -1), self.onednn_handle).view(*x.shape[:-1], -1)
            return out if self.bias is None else out + self.bias
        if SKINNY_ROWS[0] <= rows <= SKINNY_ROWS[1] and x.device.type == "cpu":
            # a decode step's few rows without a oneDNN copy: W @ x^T streams the weight through MKL ~30% faster
            # on CPU than x @ W^T (benchmarks/decode.py; equal within fp32 rounding)
            out = torch.mm(self.weight, x.reshape(rows, -1).t()).t().contiguous().view(*x.shape[:-1], -1)
            return out if self.bias is None else out + self.bias
        return F.linear(x, self.weight, self.bias)


_ONEDNN_HANDLES = itertools.count()
_ONEDNN_LINEARS: weakref.WeakValueDictionary[int, QuantLinear] = weakref.WeakValueDictionary()
"""QuantLinears with a oneDNN copy, by handle (`kiln::onednn_linear` takes the handle: oneDNN tensors do not
trace)."""


def available_memory() -> int:
    """Bytes of memory still available (Linux MemAvailable; elsewhere 0, so nothing optional is allocated)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def onednn_fits(linear_bytes: int) -> bool:
    """Whether oneDNN copies of `linear_bytes` of fp32 linears may be kept: oneDNN is built in, and they fit a
    quarter of the memory still available (they double the linears' bytes)."""
    return torch.backends.mkldnn.is_available() and 0 < linear_bytes <= available_memory() // 4


def prepack_onednn(module: nn.Module) -> int:
    """QuantLinear.prepack_onednn for every QuantLinear in `module` (itself included); the bytes added."""
    return sum(m.prepack_onednn() for m in module.modules() if isinstance(m, QuantLinear))


ONEDNN_BATCH_HINT = 8
"""The rows oneDNN lays a prepacked weight out for (torch.ops.mkldnn._reorder_linear_weight). One thread on this
project's AMD EPYC (AVX-512), SmolLM2's linears out of cache, ms for the 210 of one step: 1 row 15.0, 2-4 rows
17.2, 8 rows 21.1, 32 rows 43.7, 1024 rows 1039; MKL from the dense weight: 21 (two columns), 20-24, 46, 93, 2239
(hint 1 or 32: slower at every row count but 32 rows)."""

SKINNY_ROWS = (2, 32)
"""Row counts (batch x tokens) for which a QuantLinear without a oneDNN copy multiplies as W @ x^T on CPU;
F.linear outside them (one row: the two are equally fast; many rows: a regular GEMM)."""


ONEDNN_ONE_ROW = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
"""Whether a one-row product (a decode step at batch 1) goes through the oneDNN copy too. One thread, SmolLM2's
210 block linears out of cache, ms: on an AMD EPYC with AVX-512, oneDNN 15.0 against MKL's 21; on an AMD EPYC
with AVX2 only, oneDNN 32.5-34.5 against MKL's 27.5-29.7, while at 8 rows oneDNN still leads there (47.8 against
58.3). So without AVX-512 one row multiplies through MKL from the dense weight (benchmarks/results/decode.md)."""


def onednn_product(x: torch.Tensor, handle: int) -> torch.Tensor:
    """x [rows, K] @ weight^T in fp32 through the oneDNN copy of QuantLinear `handle` (prepack_onednn), or for
    one row on a CPU where MKL is faster there (ONEDNN_ONE_ROW) through MKL from its dense weight. The choice
    is made here, inside the op a compiled step calls too, so compiled and eager steps multiply alike."""
    linear = _ONEDNN_LINEARS[handle]
    if x.shape[0] == 1 and not ONEDNN_ONE_ROW:
        return F.linear(x, linear.weight)
    return torch.ops.mkldnn._linear_pointwise(x, linear.onednn, None, "none", [], "")


@torch.library.custom_op("kiln::onednn_linear", mutates_args=())
def _onednn_linear(x: torch.Tensor, handle: int) -> torch.Tensor:
    return onednn_product(x, handle)


@_onednn_linear.register_fake
def _(x, handle):
    return x.new_empty(x.shape[0], _ONEDNN_LINEARS[handle].weight.shape[0])


class PackedLinear(nn.Module):
    """A linear that keeps its weight as the artifact stores it and multiplies through kiln.kernels.gpu: a
    Triton kernel on CUDA tensors (or on CPU under TRITON_INTERPRET=1), else that kernel's torch reference.

    FP8 weights (bytes and a per-tensor or per-channel scale) with FP8 activations run the W8A8 GEMM; without
    activation quantization (W8A16) the weight is dequantized for each product, in the activation's dtype.
    NVFP4/MXFP4 weights (nibbles and block scales) run the W4A16 GEMM, or W4A4 with activations in the weight's
    own format; MXFP6 weights (E2M3 codes, four in three bytes, and E8M0 block scales) the W6A16 GEMM. What it computes is QuantLinear's product on the dequantized weight, within fp32 rounding."""

    def __init__(self, weight_format: str, tensors: Mapping[str, torch.Tensor], in_features: int,
                 activation: str, input_scale: torch.Tensor | None, bias: torch.Tensor | None,
                 rotation: InputTransform | None):
        super().__init__()
        self.weight_format, self.activation, self.rotation = weight_format, activation, rotation
        self.codec = weight_format_object(weight_format)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.register_buffer("input_scale", None if input_scale is None else input_scale.float().reshape(()))
        # the weight as the format's kernel takes it (Fp8Weight, Nvfp4Weight, ...); its tensors are buffers
        self.packed_weight = self.codec.packed_weight(tensors, in_features)
        for name, value in vars(self.packed_weight).items():
            if isinstance(value, torch.Tensor):
                self.register_buffer(f"packed_{name}", value)

    def _apply(self, fn, recurse=True):  # .to(device) moves the packed weight's tensors with the buffers
        super()._apply(fn, recurse)
        if getattr(self, "packed_weight", None) is not None:
            # the same checked values, moved (re-checking them would read every block scale back to the host)
            fields = {f.name: getattr(self.packed_weight, f.name) for f in dataclasses.fields(self.packed_weight)}
            fields.update({name[len("packed_"):]: buffer for name, buffer in self.named_buffers(recurse=False)
                           if name.startswith("packed_")})
            self.packed_weight = gpu.unchecked_weight(type(self.packed_weight), **fields)
        return self

    @property
    def stored_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype  # the output's: the rotation computes in fp32
        if self.rotation is not None:
            x = self.rotation.rotate(x).to(dtype)
        out = gpu.packed_linear(self.codec.gpu_kernel, x, self.packed_weight, self.activation,
                                self.input_scale).to(dtype)
        return out if self.bias is None else out + self.bias.to(dtype)


PACKED_ACTIVATIONS = {name: codec.activations for name, codec in WEIGHT_FORMATS.items() if codec.activations}
"""The activation formats PackedLinear runs with each stored weight format (the kernels' combinations)."""
