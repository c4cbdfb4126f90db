"""Pre-quantized Hugging Face checkpoints -> the float weights Kiln's IR holds.

A checkpoint whose config.json has a `quantization_config` (or that ships ModelOpt's hf_quant_config.json) is
either read with its true weights or refused with one line. Read:

    quant_method        what is stored per quantized linear                     decoded (fp32) as
    fp8                 weight float8_e4m3fn [N, K], weight_scale_inv           q * s[n // bm, k // bn]
                        [ceil(N/bm), ceil(K/bn)] for weight_block_size [bm, bn]  (partial edge blocks
                        (DeepSeek-V3, Qwen3-FP8), or one scalar when             included; kernels/fp8.py),
                        weight_block_size is null (per tensor)                   or q * s
    modelopt            ModelOpt's unified checkpoint (hf_quant_config.json):   export/modelopt.py's
                        FP8, FP8_PER_CHANNEL_PER_TOKEN, NVFP4, W4A16_NVFP4,      dequantize_modelopt_linear
                        MXFP4, MIXED_PRECISION of them
    compressed-tensors  llm-compressor's "compressed" layout: FP8 per tensor    export/compressed_tensors.py's
                        or channel (naive- / float-quantized), FP8 per block,   dequantize_linear; FP8 blocks
                        NVFP4 (nvfp4-pack-quantized), MXFP4                      as for fp8 (s multiplies)

Which linears are quantized is read from the tensors (a weight with its scales), checked against the config
(`modules_to_not_convert` / `ignored_layers`, `exclude_modules`, `quantized_layers`, `ignore` and `targets`).
Every quantized weight becomes a float32 `<module>.weight` of the linear's [out, in] shape, so the loader's
later checks (shape, finite values) and everything after it see an ordinary checkpoint; its scale tensors are
removed. Float32 rather than the bfloat16 such models declare: q * s is in general not a bfloat16 number, so
rounding it would make the graph (the gate's baseline) differ from the checkpoint's model by up to 2^-9
relative, and every other dequantizer in Kiln (runtime/weights.py, both export readers) yields float32, which
keeps round trips exact. The cost is host memory: 4 bytes a weight while building, against 2 for bfloat16.
Weights are decoded one linear at a time, each replacing (and freeing) its packed tensors, so memory peaks at the
dequantized model plus one linear, never the packed and the dequantized copy of every weight at once.

Activation and KV-cache scales (input_scale, activation_scale, input_global_scale, k_scale, v_scale) say how the
checkpoint quantized activations at inference, not what its weights are: they are dropped (counted in the
provenance and the log), and Kiln calibrates its own for whatever its recipe quantizes. Everything that would
change the model if ignored is refused: other quant_methods (gptq, awq, bitsandbytes, ...), integer or
asymmetric schemes, AWQ/SmoothQuant `pre_quant_scale`, compressed-tensors transforms (rotations) and sparsity,
an FP8 weight whose scale is missing, a scale whose weight is missing, shapes that do not fit, and a quantized
tensor no config entry explains. A checkpoint without a quantization_config that nevertheless stores weight
scales is refused too (its FP8 weights would otherwise be read without them). Which method the config names,
and its refusal before any tensor is read, is `optimizer.prequantized_config`.
"""

from __future__ import annotations

import fnmatch
import re
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch

from kiln.kernels import fp8
from kiln.kernels.errors import KilnError
from kiln.kernels.registry import weight_format
from kiln.optimizer.export.compressed_tensors import dequantize_linear, scheme_of
from kiln.optimizer.export.modelopt import MODELOPT_TENSORS, dequantize_modelopt_linear, modelopt_linear_algo
from kiln.optimizer.prequantized_config import (
    FP8_BLOCK_DEFAULT,
    ct_groups,
    ct_kind,
    refuse,
    resolve_quantization,
)

OUT_DTYPE = torch.float32
OUT_DTYPE_NAME = "F32"  # the safetensors header name of OUT_DTYPE, for the loader's header checks
FP8_SCALE_DTYPES = ("F32", "BF16", "F16", "F8_E8M0")
# activation / KV-cache quantization parameters: dropped (see the module docstring)
ACTIVATION_SCALES = (".input_scale", ".activation_scale", ".input_global_scale", ".input_zero_point", ".k_scale",
                     ".v_scale", ".q_scale", ".prob_scale")
# parts of a quantized weight: each must be consumed by a decoded linear, else the checkpoint is refused
WEIGHT_PARTS = (".weight_scale_inv", ".weight_scale", ".weight_scale_2", ".weight_packed", ".weight_global_scale",
                ".weight_zero_point", ".weight_g_idx", ".weight_shape", ".pre_quant_scale", ".qweight", ".qzeros",
                ".SCB")
_NARROW = ("F8_E4M3", "F8_E5M2", "U8", "I8")  # weight dtypes that are quantized codes, never plain weights here
_DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
                torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.uint8: "U8", torch.int8: "I8",
                torch.int16: "I16", torch.int32: "I32", torch.int64: "I64", torch.bool: "BOOL"}
if hasattr(torch, "float8_e8m0fnu"):
    _DTYPE_NAMES[torch.float8_e8m0fnu] = "F8_E8M0"


class _Info(NamedTuple):
    """A header entry for `dequantize_checkpoint` (the loader passes its own TensorInfo, same fields)."""

    file: Any
    dtype: str
    shape: tuple[int, ...]


# --- the plan: which linears, from which tensors, decoded how ----------------------------------------------------


@dataclass(frozen=True)
class QuantizedLinear:
    module: str
    scheme: str  # for messages and the provenance, e.g. "fp8 128x128 blocks", "modelopt NVFP4"
    tensors: tuple[str, ...]  # what it is decoded from (full names; the first is the stored weight)
    shape: tuple[int, int]  # the decoded [out, in]
    decode: Callable[[Mapping[str, torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class Plan:
    quant_method: str
    details: dict  # method-specific provenance (block size, quant_algo, format)
    linears: tuple[QuantizedLinear, ...]
    dropped: tuple[str, ...]  # activation / KV-cache scales

    def header(self, header: Mapping[str, Any]) -> dict[str, Any]:
        """The header as the dequantized checkpoint will look: each quantized linear a float32 `<module>.weight`
        of its [out, in] shape (in the stored weight's file), its scales and the dropped scales gone."""
        out = dict(header)
        for name in self.dropped:
            out.pop(name, None)
        for lin in self.linears:
            stored = out[lin.tensors[0]]
            for name in lin.tensors:
                out.pop(name, None)
            out[f"{lin.module}.weight"] = stored._replace(dtype=OUT_DTYPE_NAME, shape=lin.shape)
        return out

    @property
    def provenance(self) -> dict:
        return {"quant_method": self.quant_method, **self.details, "dequantized": len(self.linears),
                "dtype": str(OUT_DTYPE).removeprefix("torch."),
                "schemes": dict(sorted(Counter(lin.scheme for lin in self.linears).items())),
                "dropped_scales": len(self.dropped)}

    def summary(self) -> str:
        schemes = ", ".join(f"{n} {s}" for s, n in self.provenance["schemes"].items())
        dropped = (f"; dropped {len(self.dropped)} activation/KV-cache scale(s), which Kiln calibrates anew for what "
                   "its recipe quantizes" if self.dropped else "")
        return (f"pre-quantized checkpoint ({self.quant_method}): dequantizing {len(self.linears)} linear weight(s) "
                f"to float32 ({schemes}){dropped}")


def _shape(shape) -> str:
    return str(tuple(int(d) for d in shape))


def _fp8_decode(module: str, scale_name: str, block: list[int] | None, t: Mapping[str, torch.Tensor]) -> torch.Tensor:
    q, s = t[f"{module}.weight"], t[f"{module}.{scale_name}"]
    if block is not None:
        return fp8.fp8_block_dequantize(q, s, tuple(block))
    return fp8.fp8_dequantize(q, s.float().reshape(-1, 1) if s.numel() > 1 else s.float().reshape(()))


def _scale_ok(method: str, name: str, info: Any, weight_shape: tuple[int, ...], block: list[int] | None,
              per_channel: bool = False) -> None:
    """An FP8 scale's dtype and shape: per block grid, per channel [N, 1], or one value."""
    if info.dtype not in FP8_SCALE_DTYPES:
        raise refuse(method, f"{name} has dtype {info.dtype}; an FP8 weight scale must be one of "
                              f"{', '.join(FP8_SCALE_DTYPES)}")
    if block is not None:
        needs = [fp8.fp8_block_scale_shape(weight_shape, block)]
        how = f"a {weight_shape[0]}x{weight_shape[1]} weight in {block[0]}x{block[1]} blocks"
    elif per_channel:
        needs, how = [(weight_shape[0], 1)], "one scale per output channel"
    else:
        needs, how = [(), (1,)], "one scale per tensor"
    if tuple(info.shape) not in needs:
        raise refuse(method, f"{name} has shape {_shape(info.shape)}; {how} needs "
                              f"{' or '.join(_shape(n) for n in needs)}")


def _need(method: str, header: Mapping[str, Any], module: str, part: str, dtype: str | None = None) -> Any:
    name = f"{module}.{part}"
    info = header.get(name)
    if info is None:
        raise refuse(method, f"{module} is quantized but its {name} is missing")
    if dtype is not None and info.dtype != dtype:
        raise refuse(method, f"{name} has dtype {info.dtype}; this layout stores it as {dtype}")
    if part in ("weight", "weight_packed") and len(info.shape) != 2:
        raise refuse(method, f"{name} has shape {_shape(info.shape)}; a linear weight is 2-D")
    return info


def _not_converted(module: str, pattern: str) -> bool:
    """transformers' `should_convert_module` test for one modules_to_not_convert entry: the pattern matches the
    start of the name (as a regex) or ends it."""
    try:
        return re.match(pattern, module) is not None or module.endswith(pattern)
    except re.error:
        return module.startswith(pattern) or module.endswith(pattern)


def _plan_fp8(q: Mapping, header: Mapping[str, Any], shapes: Mapping[str, tuple[int, int]]) -> Plan:
    block = q.get("weight_block_size", FP8_BLOCK_DEFAULT)
    block = list(block) if block is not None else None
    skip = q.get("modules_to_not_convert") or q.get("ignored_layers") or []
    scheme = f"fp8 {block[0]}x{block[1]} blocks" if block else "fp8 per tensor"
    linears = []
    for key in sorted(k for k in header if k.endswith(".weight_scale_inv")):
        module = key.removesuffix(".weight_scale_inv")
        excluded = next((s for s in skip if _not_converted(module, s)), None)
        if excluded is not None:
            raise refuse("fp8", f"{key} is stored but quantization_config.modules_to_not_convert excludes "
                                 f"{module} ({excluded!r:.60})")
        w = _need("fp8", header, module, "weight", "F8_E4M3")
        _scale_ok("fp8", key, header[key], tuple(w.shape), block)
        linears.append(QuantizedLinear(module, scheme, (f"{module}.weight", key), tuple(w.shape),
                                       partial(_fp8_decode, module, "weight_scale_inv", block)))
    if not linears:
        raise refuse("fp8", "quantization_config says quant_method fp8 but no tensor has a weight_scale_inv "
                             "(the FP8 block scales DeepSeek-V3 and transformers store)")
    details = {"weight_block_size": block, "activation_scheme": q.get("activation_scheme", "dynamic")}
    return Plan("fp8", details, tuple(linears), ())


def _packed_k(method: str, module: str, info: Any, shapes: Mapping[str, tuple[int, int]], group: int,
              padded: bool) -> int:
    """K of a packed FP4 weight: the config's in_features (the packing must fit it), else twice the bytes."""
    stored_k = 2 * int(info.shape[1])
    if module not in shapes:
        return stored_k
    n, k = shapes[module]
    needs = (n, (-(-k // group) * group if padded else k) // 2)
    if tuple(info.shape) != needs:
        raise refuse(method, f"{module}'s packed FP4 weight has shape {_shape(info.shape)}; the config's "
                              f"{n}x{k} linear needs {_shape(needs)}")
    return k


def _modelopt_decode(module: str, algo: str, in_features: int, t: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return dequantize_modelopt_linear(module, algo, t, in_features)


def _plan_modelopt(q: Mapping, header: Mapping[str, Any], shapes: Mapping[str, tuple[int, int]]) -> Plan:
    algo = q.get("quant_algo")
    exclude = [p for p in q.get("exclude_modules") or [] if isinstance(p, str)]
    candidates = {k.removesuffix(".weight_scale") for k in header if k.endswith(".weight_scale")}
    if algo == "MIXED_PRECISION":
        candidates |= set(q.get("quantized_layers") or {})
    linears = []
    for module in sorted(candidates):
        a = modelopt_linear_algo(module, q, header)
        if a is None:
            raise refuse("modelopt", f"{module}.weight_scale is stored but the quantization config does not "
                                      f"quantize {module}")
        if algo != "MIXED_PRECISION":
            pattern = next((p for p in exclude if fnmatch.fnmatchcase(module, p)), None)
            if pattern is not None:
                raise refuse("modelopt", f"{module} stores quantized tensors but exclude_modules excludes it "
                                          f"({pattern!r:.60})")
        parts = MODELOPT_TENSORS[a]
        fp4 = a not in ("FP8", "FP8_PER_CHANNEL_PER_TOKEN")
        w = _need("modelopt", header, module, "weight", "U8" if fp4 else "F8_E4M3")
        for part in parts[1:]:
            _need("modelopt", header, module, part)
        if fp4:
            k = _packed_k("modelopt", module, w, shapes, 32 if a == "mxfp4" else 16, padded=True)
            shape = (int(w.shape[0]), k)
        else:
            shape = tuple(w.shape)
            scale = header[f"{module}.weight_scale"]
            per_channel = a == "FP8_PER_CHANNEL_PER_TOKEN"
            if not (per_channel and tuple(scale.shape) == (shape[0],)):  # ModelOpt writes per-channel scales [N]
                _scale_ok("modelopt", f"{module}.weight_scale", scale, shape, None, per_channel)
        linears.append(QuantizedLinear(module, f"modelopt {a}", tuple(f"{module}.{p}" for p in parts), shape,
                                       partial(_modelopt_decode, module, a, shape[1])))
    details = {"quant_algo": algo, "kv_cache_quant_algo": q.get("kv_cache_quant_algo"), "config": q.get("source")}
    return Plan("modelopt", details, tuple(linears), ())


def _ct_decode(module: str, group: Mapping, t: Mapping[str, torch.Tensor]) -> torch.Tensor:
    weights = group["weights"]
    if weights.get("strategy") == "block":
        return fp8.fp8_block_dequantize(t[f"{module}.weight"], t[f"{module}.weight_scale"],
                                        tuple(weights["block_structure"]))
    out = dequantize_linear(module, group, t)
    stored = t.get(f"{module}.weight_shape")  # compressed-tensors' packed formats may record [N, K]
    if stored is not None and [int(v) for v in stored.reshape(-1).tolist()] != list(out.shape):
        raise ValueError(f"its weight_shape {stored.tolist()} disagrees with the decoded {tuple(out.shape)}")
    return out


def _plan_ct(quant: Mapping, header: Mapping[str, Any], shapes: Mapping[str, tuple[int, int]]) -> Plan:
    method = "compressed-tensors"
    view = {**quant, "config_groups": ct_groups(quant)}
    candidates = {k.rsplit(".", 1)[0] for k in header if k.endswith((".weight_scale", ".weight_packed"))}
    linears = []
    for module in sorted(candidates):
        try:
            group = scheme_of(module, view)
        except KilnError as exc:
            raise refuse(method, str(exc)) from None
        if group is None:
            raise refuse(method, f"{module} stores quantized tensors but quantization_config.ignore lists it")
        kind = ct_kind(group)
        if kind is None:
            raise refuse(method, f"{module} stores quantized tensors but its config group quantizes no weights")
        if kind.startswith("fp8"):
            w = _need(method, header, module, "weight", "F8_E4M3")
            shape = tuple(w.shape)
            block = group["weights"]["block_structure"] if kind == "fp8-block" else None
            _scale_ok(method, f"{module}.weight_scale", _need(method, header, module, "weight_scale"), shape, block,
                      per_channel=kind == "fp8-channel")
            parts = ("weight", "weight_scale")
            scheme = f"compressed-tensors fp8 {block[0]}x{block[1]} blocks" if block else f"compressed-tensors {kind}"
        else:
            codec = weight_format(kind)  # the FP4 format's own scale block and global scale
            w = _need(method, header, module, "weight_packed", "U8")
            parts = ("weight_packed", "weight_scale", *(("weight_global_scale",) if codec.takes_global_scale else ()))
            for part in parts[1:]:
                _need(method, header, module, part)
            group_size = codec.grid_block_size(2 * int(w.shape[1]))
            shape = (int(w.shape[0]), _packed_k(method, module, w, shapes, group_size, False))
            scheme = f"compressed-tensors {kind}"
        if f"{module}.weight_shape" in header:
            parts = (*parts, "weight_shape")
        linears.append(QuantizedLinear(module, scheme, tuple(f"{module}.{p}" for p in parts), shape,
                                       partial(_ct_decode, module, group)))
    details = {"format": quant.get("format"), "kv_cache_scheme": quant.get("kv_cache_scheme")}
    return Plan(method, details, tuple(linears), ())


def _linear_shapes(expected: Mapping[str, Any] | None) -> dict[str, tuple[int, int]]:
    """module -> (out, in) of every 2-D `<module>.weight` the model expects (the loader's `_expected_tensors`)."""
    return {name.removesuffix(".weight"): tuple(e.shape) for name, e in (expected or {}).items()
            if name.endswith(".weight") and len(e.shape) == 2}


def _finish(method: str, plan: Plan, header: Mapping[str, Any]) -> Plan:
    """Drop the activation scales; refuse any quantized tensor the plan does not decode."""
    consumed = {name for lin in plan.linears for name in lin.tensors}
    quantized = {lin.module for lin in plan.linears}
    dropped = []
    for name, info in sorted(header.items()):
        if name in consumed:
            continue
        if name.endswith(".pre_quant_scale"):
            raise refuse(method, f"{name}: its input is smoothed (AWQ/SmoothQuant pre_quant_scale), which this "
                                  "reader does not fold into the weight")
        if name.endswith(ACTIVATION_SCALES):
            dropped.append(name)
        elif name.endswith(WEIGHT_PARTS):
            raise refuse(method, f"{name} is a quantization tensor that the quantization config does not explain "
                                  f"(no {method} scheme decodes {name.rsplit('.', 1)[0]} from it)")
        elif name.endswith(".weight") and info.dtype in _NARROW and name.removesuffix(".weight") not in quantized:
            scale = "weight_scale_inv" if method == "fp8" else "weight_scale"
            raise refuse(method, f"{name} is {info.dtype} but has no {scale} beside it: its scale is missing")
    if not plan.linears and not dropped:
        raise refuse(method, "the quantization config is present but no tensor is quantized")
    return Plan(plan.quant_method, plan.details, plan.linears, tuple(dropped))


def _refuse_stray(header: Mapping[str, Any]) -> None:
    """Without a quantization_config, weight scales mean a quantized checkpoint whose config lost its
    description: its FP8 weights would be read without their scales."""
    stray = sorted(k for k in header if k.endswith(WEIGHT_PARTS))
    if stray:
        raise KilnError(f"checkpoint tensor {stray[0]:.100} is a quantization scale or packed weight, but config.json "
                        "has no quantization_config (nor is there an hf_quant_config.json): its weights cannot be "
                        "read without knowing how they were quantized")


def _plan(root: Path | None, config: Mapping, header: Mapping[str, Any], expected: Mapping[str, Any] | None,
          hf_quant: Mapping | None = None) -> Plan | None:
    resolved = resolve_quantization(root, config, hf_quant)
    if resolved is None:
        _refuse_stray(header)
        return None
    method, q = resolved
    planner = {"fp8": _plan_fp8, "modelopt": _plan_modelopt, "compressed-tensors": _plan_ct}[method]
    return _finish(method, planner(q, header, _linear_shapes(expected)), header)


def plan(root: Path | None, config: dict, header: Mapping[str, Any], expected: Mapping[str, Any] | None = None,
         log: Callable[[str], None] = lambda message: None) -> tuple[dict, dict, Plan | None]:
    """For the loader, from the safetensors headers alone: (config without its quantization_config, the header as
    the dequantized checkpoint will look, the plan; None when the checkpoint is not quantized). `expected` maps
    tensor names to what the model expects (`.shape`), which gives packed FP4 weights their true in_features.
    Anything that cannot be read is a one-line KilnError here, before any tensor data is read."""
    p = _plan(root, config, header, expected)
    if p is None:
        return config, dict(header), None
    log(p.summary())
    return {k: v for k, v in config.items() if k != "quantization_config"}, p.header(header), p


def dequantize(p: Plan | None, tensors: dict[str, torch.Tensor],
               bad_values: Callable[[torch.Tensor], str | None]) -> dict[str, torch.Tensor]:
    """Replace, one linear at a time, each planned linear's stored tensors by its float32 `<module>.weight`, and
    drop the activation scales (in place; returns `tensors`). Every decoded weight is checked like a stored one,
    by the loader's `bad_values` (what is wrong with a tensor's values, or None)."""
    if p is None:
        return tensors

    for name in p.dropped:
        tensors.pop(name, None)
    for lin in p.linears:
        parts = {name: tensors.pop(name) for name in lin.tensors}
        try:
            weight = lin.decode(parts)
        except (ValueError, TypeError, KeyError, KilnError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise refuse(p.quant_method, f"{lin.module} ({lin.scheme}) does not decode: {first:.200}") from None
        del parts
        if tuple(weight.shape) != lin.shape:
            raise refuse(p.quant_method, f"{lin.module} decodes to shape {_shape(weight.shape)}, expected "
                                          f"{_shape(lin.shape)}")
        weight = weight.to(OUT_DTYPE).contiguous()
        problem = bad_values(weight)
        if problem:
            raise KilnError(f"tensor {lin.module}.weight, dequantized from {lin.scheme}, {problem}; refusing to "
                            "optimize a broken checkpoint")
        tensors[f"{lin.module}.weight"] = weight
    return tensors


def dequantize_checkpoint(config: Mapping, tensors: dict[str, torch.Tensor], *, hf_quant_config: Mapping | None = None,
                          linear_shapes: Mapping[str, tuple[int, int]] | None = None
                          ) -> tuple[dict, dict[str, torch.Tensor], dict]:
    """(config without quantization_config, `tensors` with every quantized linear weight replaced by its float32
    dequantized `<module>.weight` and its scale tensors removed, provenance) for an in-memory checkpoint.

    `hf_quant_config`: ModelOpt's hf_quant_config.json, when the checkpoint has one. `linear_shapes`: module ->
    (out, in), for packed FP4 weights whose K was padded (default: twice the packed bytes). The provenance is {}
    for an unquantized checkpoint. `tensors` is updated in place, one linear at a time."""
    header = {name: _Info(None, _DTYPE_NAMES.get(t.dtype, str(t.dtype)), tuple(t.shape)) for name, t in tensors.items()}
    shapes = {f"{m}.weight": _Info(None, "F32", tuple(s)) for m, s in (linear_shapes or {}).items()}
    p = _plan(None, config, header, shapes, hf_quant_config)
    if p is None:
        return dict(config), tensors, {}
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    finite = lambda t: None if bool(torch.isfinite(t).all()) else "contains NaN or Inf values"
    return config, dequantize(p, tensors, finite), p.provenance
