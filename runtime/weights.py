"""Stored weight formats -> the fp32 values the CPU reference path multiplies with.

The artifact's manifest has a format entry for every linear; this module turns the packed tensors named
there back into fp32 exactly (the dequantized values are the quantized ones, so the numerics are what
ships) and returns the activation quantizer the format asks for. On GPU, kernels read the packed bytes
instead; the values are the same.

Format entry (manifest "formats"[module]):
    {"format": "dense" | "fp8_e4m3" | "nvfp4" | "mxfp4" | "mxfp6",
     "activation": "none" | "fp8_dynamic_per_token" | "fp8_static_per_tensor" | "nvfp4" | "mxfp4",
     "in_features": K (for the block formats, before padding),
     "input_rotation": {"kind": "block_hadamard", "block_size": b}   (optional: the stored weight is W R and
                       the input is rotated by the same R before its quantizer; kernels/rotation.py)}
Tensors, named as in ModelOpt's unified checkpoint: `<module>.weight`, `.weight_scale`, `.weight_scale_2`,
`.input_scale`, `.bias`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from kiln.kernels import fp8
from kiln.kernels.dequantize import dequantize
from kiln.kernels.errors import KilnError, clip
from kiln.kernels.formats import ActivationFormat
from kiln.kernels.mxfp4 import mxfp4_fake_quantize
from kiln.kernels.nvfp4 import nvfp4_fake_quantize
from kiln.kernels.registry import WEIGHT_FORMATS as REGISTERED_FORMATS
from kiln.kernels.registry import weight_format
from kiln.kernels.rotation import ROTATION_KINDS, block_hadamard

WEIGHT_FORMATS = tuple(REGISTERED_FORMATS)
ACTIVATION_FORMATS = tuple(ActivationFormat)


def _shape(shape) -> str:
    return str(tuple(int(d) for d in shape))


def need_tensor(tensors: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in tensors:
        raise KilnError(f"artifact is missing tensor {clip(name)!r}")
    return tensors[name]


def check_shape(name: str, tensor: torch.Tensor, *expected: tuple[int, ...]) -> None:
    """Refuse `tensor` unless its shape is one of `expected` (one line naming the tensor and both shapes)."""
    if tuple(tensor.shape) not in [tuple(e) for e in expected]:
        needs = " or ".join(_shape(e) for e in expected)
        raise KilnError(f"artifact tensor {clip(name)} has shape {_shape(tensor.shape)}, the architecture needs {needs}")


def check_dtype(name: str, tensor: torch.Tensor, what: str, *dtypes: torch.dtype) -> None:
    """Refuse `tensor` unless its dtype is one of `dtypes` (none given: any floating-point dtype)."""
    ok = tensor.dtype in dtypes if dtypes else tensor.is_floating_point()
    if not ok:
        needs = " or ".join(str(d).removeprefix("torch.") for d in dtypes) if dtypes else "floating point"
        raise KilnError(f"artifact tensor {clip(name)} has dtype {str(tensor.dtype).removeprefix('torch.')}; "
                        f"{what} must be {needs}")


def check_finite(name: str, values: torch.Tensor) -> None:
    """Refuse a floating tensor holding NaN or Inf. One reduction (aminmax reads the data once, and NaN
    propagates through it); the runtime calls it on what it dequantizes at load, never per token."""
    if values.numel() == 0:
        return
    low, high = torch.aminmax(values if values.dtype.itemsize > 1 else values.float())
    if not (math.isfinite(float(low)) and math.isfinite(float(high))):
        raise KilnError(f"artifact tensor {clip(name)} holds non-finite values (NaN or Inf)")


def check_format(module: str, entry: Mapping) -> str:
    """The entry's weight format, or a one-line KilnError naming the module and the known formats."""
    fmt = entry.get("format") if isinstance(entry, Mapping) else None
    if fmt not in WEIGHT_FORMATS:
        raise KilnError(f"{clip(module)}: unknown weight format {clip(repr(fmt), 40)} in the manifest's format "
                        f"table; known: {', '.join(WEIGHT_FORMATS)}")
    return fmt


def _in_features(module: str, entry: Mapping, fmt: str, shape: tuple[int, int] | None) -> int:
    """K for a block format: the architecture's when known (the entry must agree), else the entry's."""
    stored = entry.get("in_features")
    if shape is not None:
        if stored is not None and stored != shape[1]:
            raise KilnError(f"manifest formats[{clip(module)}].in_features is {clip(repr(stored), 20)}, "
                            f"the architecture needs {shape[1]}")
        return shape[1]
    if isinstance(stored, bool) or not isinstance(stored, int) or stored < 1:
        raise KilnError(f"manifest formats[{clip(module)}] ({fmt}) needs in_features, a positive integer; "
                        f"got {clip(repr(stored), 20)}")
    return stored


def _check_stored(module: str, tensors: Mapping[str, torch.Tensor], layout) -> None:
    """Every tensor the format's layout (`WeightCodec.stored_tensors`) names: present, then its dtype and shape."""
    for expected in layout:
        name = f"{module}.{expected.key}"
        tensor = need_tensor(tensors, name)
        if expected.shapes is not None and expected.shape_first:
            check_shape(name, tensor, *expected.shapes)
        if expected.dtypes is not None:
            check_dtype(name, tensor, expected.what, *expected.dtypes)
        if expected.shapes is not None and not expected.shape_first:
            check_shape(name, tensor, *expected.shapes)
        if expected.ndim is not None and tensor.ndim != expected.ndim:
            raise KilnError(f"artifact tensor {clip(name)} has shape {_shape(tensor.shape)}; "
                            f"a linear weight is {expected.ndim}-D")


def dequantize_weight(module: str, entry: Mapping, tensors: Mapping[str, torch.Tensor],
                      shape: tuple[int, int] | None = None) -> torch.Tensor:
    """The fp32 [out, in] weight of `module` as stored in format `entry["format"]`.

    With `shape` (out_features, in_features), every stored tensor is checked against it first (the packed
    codes and block scales of the FP4 formats, an FP8 scale per tensor or per output channel), so a wrong
    artifact is a one-line KilnError naming the tensor, never a shape error in the middle of a forward.
    Whatever the shape, the dequantized weight must be finite."""
    fmt, stored, in_features = stored_weight(module, entry, tensors, shape)
    try:
        result = dequantize(fmt, stored, in_features)
    except (ValueError, TypeError) as exc:  # the kernels' own layout and value checks
        raise malformed(module, fmt, exc) from None
    check_finite(f"{module}.weight ({fmt}, dequantized)" if weight_format(fmt).dequantizes else f"{module}.weight",
                 result)
    return result


def stored_weight(module: str, entry: Mapping, tensors: Mapping[str, torch.Tensor],
                  shape: tuple[int, int] | None = None) -> tuple[str, dict[str, torch.Tensor], int | None]:
    """The tensors `module`'s weight is stored as, checked as `dequantize_weight` checks them (it dequantizes
    these): (format, {name: tensor} with the format's own keys, in_features for the FP4 formats else None)."""
    fmt = check_format(module, entry)
    codec = weight_format(fmt)
    w = need_tensor(tensors, f"{module}.weight")
    in_features = _in_features(module, entry, fmt, shape) if codec.blocked else None
    out, k = (None, in_features) if shape is None else shape
    _check_stored(module, tensors, codec.stored_tensors(out, k, tuple(w.shape)))
    return fmt, {k: need_tensor(tensors, f"{module}.{k}") for k in codec.tensor_names}, in_features


def malformed(module: str, fmt: str, exc: Exception) -> KilnError:
    """The one-line error for a weight whose stored tensors the format's own checks refuse."""
    detail = str(exc).strip().splitlines()
    return KilnError(f"artifact tensors of {clip(module)} ({fmt}) are malformed: "
                     f"{clip(detail[0] if detail else type(exc).__name__, 160)}")


def _input_scale(module: str, tensors: Mapping[str, torch.Tensor], required: bool) -> torch.Tensor | None:
    """A linear's per-tensor activation scale: one positive finite float."""
    name = f"{module}.input_scale"
    if not required and name not in tensors:
        return None
    scale = need_tensor(tensors, name)
    check_dtype(name, scale, "an activation scale")
    check_shape(name, scale, (), (1,))
    value = float(scale)
    if not (math.isfinite(value) and value > 0):
        raise KilnError(f"artifact tensor {clip(name)} must be a positive finite scale, got {value:g}")
    return scale


def input_scale_tensor(module: str, tensors: Mapping[str, torch.Tensor], activation: str) -> torch.Tensor | None:
    """A linear's calibrated activation scale as its activation format takes it: required for FP8 static,
    optional for NVFP4 (its global scale; None: computed from each activation)."""
    return _input_scale(module, tensors, required=activation == ActivationFormat.FP8_STATIC_PER_TENSOR)


def activation_quantizer(
    module: str, entry: Mapping, tensors: Mapping[str, torch.Tensor]
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The fake-quantizer applied to the linear's input (None for weight-only formats)."""
    act = entry.get("activation", "none")
    if act == ActivationFormat.NONE:
        return None
    if act == ActivationFormat.FP8_DYNAMIC_PER_TOKEN:
        return fp8.fp8_fake_quantize_per_token
    if act == ActivationFormat.FP8_STATIC_PER_TENSOR:
        scale = _input_scale(module, tensors, required=True).float()
        return lambda x: fp8.fp8_fake_quantize_per_tensor(x, scale)
    if act == ActivationFormat.NVFP4:
        global_scale = _input_scale(module, tensors, required=False)
        return lambda x: nvfp4_fake_quantize(x, global_scale)
    if act == ActivationFormat.MXFP4:
        return mxfp4_fake_quantize
    raise KilnError(f"{clip(module)}: unknown activation format {clip(repr(act), 40)}; "
                    f"known: {', '.join(ACTIVATION_FORMATS)}")


@dataclass(frozen=True)
class InputTransform:
    """A linear's input path: rotate by the artifact's block Hadamard (if any), then fake-quantize (if any)."""

    rotation_block: int  # 0: no rotation
    quantize: Callable[[torch.Tensor], torch.Tensor] | None

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        if not self.rotation_block:
            return x
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
    if not isinstance(rotation, Mapping) or rotation.get("kind") not in ROTATION_KINDS:
        raise KilnError(f"{module}: unknown input_rotation {rotation!r}; known kinds: {', '.join(ROTATION_KINDS)}")
    block_size = rotation.get("block_size")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1 or block_size & (block_size - 1):
        raise KilnError(f"{module}: input_rotation block_size must be a power of two, got {block_size!r}")
    return InputTransform(block_size, quantize)
