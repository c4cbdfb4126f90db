"""Stored weight formats -> the fp32 values the CPU reference path multiplies with.

The artifact's manifest has a format entry for every linear; this module turns the packed tensors named
there back into fp32 exactly (the dequantized values are the quantized ones, so the numerics are what
ships) and returns the activation quantizer the format asks for. On GPU, kernels read the packed bytes
instead; the values are the same.

Format entry (manifest "formats"[module]):
    {"format": "dense" | "fp8_e4m3" | "nvfp4" | "mxfp4",
     "activation": "none" | "fp8_dynamic_per_token" | "fp8_static_per_tensor" | "nvfp4" | "mxfp4",
     "in_features": K (for the block formats, before padding),
     "input_rotation": {"kind": "block_hadamard", "block_size": b}   (optional: the stored weight is W R and
                       the input is rotated by the same R before its quantizer; kernels/rotation.py)}
Tensors, named as in ModelOpt's unified checkpoint: `<module>.weight`, `.weight_scale`, `.weight_scale_2`,
`.input_scale`, `.bias`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from kernels import fp8
from kernels.errors import KilnError

WEIGHT_FORMATS = ("dense", "fp8_e4m3", "nvfp4", "mxfp4")
ACTIVATION_FORMATS = ("none", "fp8_dynamic_per_token", "fp8_static_per_tensor", "nvfp4", "mxfp4")


def _need(tensors: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in tensors:
        raise KilnError(f"artifact is missing tensor {name!r}")
    return tensors[name]


def dequantize_weight(module: str, entry: Mapping, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The fp32 [out, in] weight of `module` as stored in format `entry["format"]`."""
    fmt = entry.get("format")
    w = _need(tensors, f"{module}.weight")
    if fmt == "dense":
        return w.float()
    if fmt == "fp8_e4m3":
        return fp8.fp8_dequantize(w, _need(tensors, f"{module}.weight_scale"))
    if fmt == "nvfp4":
        from kernels.nvfp4 import Nvfp4Weight, nvfp4_dequantize

        q = Nvfp4Weight.from_tensors(
            {k: _need(tensors, f"{module}.{k}") for k in ("weight", "weight_scale", "weight_scale_2")},
            in_features=int(entry["in_features"]),
        )
        return nvfp4_dequantize(q)
    if fmt == "mxfp4":
        from kernels.mxfp4 import Mxfp4Weight, mxfp4_dequantize

        q = Mxfp4Weight.from_tensors(
            {k: _need(tensors, f"{module}.{k}") for k in ("weight", "weight_scale")},
            in_features=int(entry["in_features"]),
        )
        return mxfp4_dequantize(q)
    raise KilnError(f"{module}: unknown weight format {fmt!r}; known: {', '.join(WEIGHT_FORMATS)}")


def activation_quantizer(
    module: str, entry: Mapping, tensors: Mapping[str, torch.Tensor]
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The fake-quantizer applied to the linear's input (None for weight-only formats)."""
    act = entry.get("activation", "none")
    if act == "none":
        return None
    if act == "fp8_dynamic_per_token":
        return fp8.fp8_fake_quantize_per_token
    if act == "fp8_static_per_tensor":
        scale = _need(tensors, f"{module}.input_scale").float()
        return lambda x: fp8.fp8_fake_quantize_per_tensor(x, scale)
    if act == "nvfp4":
        from kernels.nvfp4 import nvfp4_fake_quantize

        global_scale = tensors.get(f"{module}.input_scale")
        return lambda x: nvfp4_fake_quantize(x, global_scale)
    if act == "mxfp4":
        from kernels.mxfp4 import mxfp4_fake_quantize

        return mxfp4_fake_quantize
    raise KilnError(f"{module}: unknown activation format {act!r}; known: {', '.join(ACTIVATION_FORMATS)}")



@dataclass(frozen=True)
class InputTransform:
    """A linear's input path: rotate by the artifact's block Hadamard (if any), then fake-quantize (if any)."""

    rotation_block: int  # 0: no rotation
    quantize: Callable[[torch.Tensor], torch.Tensor] | None

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        if not self.rotation_block:
            return x
        from kernels.rotation import block_hadamard

        return block_hadamard(x, self.rotation_block)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = self.rotate(x)
        return x if self.quantize is None else self.quantize(x)


def input_transform(module: str, entry: Mapping, tensors: Mapping[str, torch.Tensor]) -> InputTransform | None:
    """What the linear applies to its input before the product: the entry's rotation, then its activation
    quantizer (None when neither is present)."""
    quantize = activation_quantizer(module, entry, tensors)
    rotation = entry.get("input_rotation")
    if rotation is None:
        return None if quantize is None else InputTransform(0, quantize)
    from kernels.rotation import ROTATION_KINDS

    if not isinstance(rotation, Mapping) or rotation.get("kind") not in ROTATION_KINDS:
        raise KilnError(f"{module}: unknown input_rotation {rotation!r}; known kinds: {', '.join(ROTATION_KINDS)}")
    block_size = rotation.get("block_size")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1 or block_size & (block_size - 1):
        raise KilnError(f"{module}: input_rotation block_size must be a power of two, got {block_size!r}")
    return InputTransform(block_size, quantize)
