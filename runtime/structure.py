"""An artifact's architecture checked against its tensors, from the safetensors header alone.

The writer of an artifact also writes its checksums, so a checksum says nothing about whether the manifest
tells the truth about the artifact's own structure. `read_manifest` (and so `runtime.load`, `optimize inspect`
and the exports) calls `check_structure` after the checksums, the way `optimizer.loader` checks a checkpoint's
config against its weights before reading any data:

  - the architecture's fields were type- and range-checked, and its sizes against each other, when
    `validate_manifest` built the spec (`runtime.spec.check_fields`, `check_spec`);
  - the manifest's "tensors" table and "sizes.weight_bytes" must be what model.safetensors' header holds;
  - every tensor the runtime reads must be there with the shape and dtype its declared format stores: the
    embedding (dense, or quantized under its own format entry, role "embedding", weight-only), every norm,
    every linear of the decoder stack, lm_head and the extra modules (its weight and scales as
    `runtime.weights.stored_weight` checks them, its bias, its activation scale), the MoE router biases, the KV
    cache's scales and offsets;
  - "formats" has an entry for every linear decoding runs and none for a module the architecture lacks; an
    entry's activation is one the runtime knows, and it stores no scale its format does not use (a dense entry
    over FP8 bytes and their scale is refused: it would run as garbage).

Only the header is read (shapes and dtypes, as tensors on the meta device): no tensor data, so it is cheap and
`runtime.load` still reads the weights once. Tensor values (finite, positive scales) are checked when the
runtime reads them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kiln.kernels.errors import KilnError, clip
from kiln.kernels.formats import ActivationFormat, WeightFormat
from kiln.kernels.registry import weight_format
from kiln.kernels.rotation import ROTATION_KINDS
from kiln.runtime.kv_format import resolve_kv_streams
from kiln.runtime.spec import LayerSpec, LinearSpec, ModelSpec, norm_size, spec_from_json
from kiln.runtime.weights import (
    ACTIVATION_FORMATS,
    check_dtype,
    check_format,
    check_shape,
    need_tensor,
    stored_weight,
)

WEIGHTS = "model.safetensors"  # runtime.artifact.WEIGHTS, which imports this module

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
                      "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}
"""Header dtype names -> torch dtypes (what safetensors stores; anything else is refused by name)."""
DENSE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
"""A dense weight's dtypes: 1-byte floats are quantized codes, which need their format's scales."""
SCALE_SUFFIXES = ("weight_scale", "weight_scale_2", "input_scale")
"""Tensors beside a linear's weight that belong to a quantized format."""


def read_header(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file as an empty tensor of its dtype and shape on the meta device, from
    the header alone (safetensors checks the header's offsets against the file when it opens it)."""
    header = {}
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                s = f.get_slice(name)
                dtype = SAFETENSORS_DTYPES.get(s.get_dtype())
                if dtype is None:
                    raise KilnError(f"artifact tensor {clip(name)} has dtype {clip(s.get_dtype(), 20)}, which the "
                                    f"runtime does not read (known: {', '.join(SAFETENSORS_DTYPES)})")
                header[name] = torch.empty(tuple(s.get_shape()), dtype=dtype, device="meta")
    except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
        raise KilnError(f"{clip(path)}: cannot read weights: {clip(str(exc).strip(), 120)}") from None
    return header


def check_structure(weights: Path, manifest: dict) -> None:
    """Check the manifest's structure against the header of its model.safetensors, `weights` (see the module
    docstring). `manifest` comes from `read_manifest`, which checked its shape and checksums."""
    header = read_header(weights)
    spec = spec_from_json(manifest["architecture"])
    check_tensors(spec, manifest["formats"], manifest.get("kv_cache") or {}, header)
    check_tensor_table(manifest, header)  # last: a tensor the architecture disagrees with is the thing to name


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def check_tensor_table(manifest: dict, header: Mapping[str, torch.Tensor]) -> None:
    """The manifest's "tensors" table (what `optimize inspect` sizes modules from) and its weight bytes must be
    model.safetensors' header, tensor for tensor."""
    table = manifest["tensors"]
    for name in sorted(set(table) | set(header)):
        if name not in header:
            raise KilnError(f"manifest tensors[{clip(json.dumps(name), 80)}] is not in {WEIGHTS}")
        if name not in table:
            raise KilnError(f"{WEIGHTS} holds {clip(name)}, which the manifest's tensors table does not list")
        t, info = header[name], table[name]
        if info["dtype"] != _dtype(t) or tuple(info["shape"]) != tuple(t.shape):
            raise KilnError(f"manifest tensors[{clip(json.dumps(name), 80)}] says {clip(info['dtype'], 20)} "
                            f"{clip(tuple(info['shape']), 40)}, {WEIGHTS} holds {_dtype(t)} {tuple(t.shape)}")
    stored = sum(math.prod(t.shape) * t.dtype.itemsize for t in header.values())
    if manifest["sizes"]["weight_bytes"] != stored:
        raise KilnError(f"manifest sizes.weight_bytes is {manifest['sizes']['weight_bytes']}, {WEIGHTS} holds "
                        f"{stored} bytes of tensors")


def check_tensors(spec: ModelSpec, formats: Mapping[str, Mapping], kv_table: Mapping,
                  tensors: Mapping[str, torch.Tensor]) -> None:
    """Every tensor the runtime reads for `spec` is in `tensors` with the shape and dtype its format stores
    (`tensors` may be meta tensors: only shapes and dtypes are looked at)."""

    def plain(name: str, shape: tuple[int, ...], what: str, required: bool = True) -> None:
        if not required and name not in tensors:
            return
        t = need_tensor(tensors, name)
        check_dtype(name, t, what, *DENSE_DTYPES)
        check_shape(name, t, shape)

    C, V = spec.hidden_size, spec.vocab_size
    table = spec.embedding.removesuffix(".weight")  # its format entry's name, when it is stored quantized
    if table in formats:
        _check_embedding(table, formats[table], tensors, (V, C))
    else:
        plain(spec.embedding, (V, C), "the embedding")
    plain(spec.final_norm, (C,), "a norm weight")
    decoding = spec.linears()
    extra = spec.extra_linears()
    known = {lin.name for lin in (*decoding, *extra)} | {table}
    unknown = sorted(name for name in formats if name not in known)
    if unknown:
        raise KilnError(f"manifest formats[{clip(json.dumps(unknown[0]), 80)}] names a module the architecture "
                        f"does not have ({len(unknown)} such entr{'y' if len(unknown) == 1 else 'ies'})")
    for lin in decoding:
        if lin.name not in formats:
            raise KilnError(f"manifest formats has no entry for {clip(lin.name)}, a linear of the architecture")
    tied = spec.lm_head_tied(tensors)
    for lin in (*decoding, *extra):
        if lin is spec.lm_head and tied:
            if table not in formats:
                plain(spec.embedding, (lin.out_features, lin.in_features), "the embedding")  # what it multiplies by
            fmt = check_format(lin.name, formats[lin.name])
            if weight_format(fmt).dequantizes:
                raise KilnError(f"manifest formats[lm_head] says {fmt}, but lm_head is tied to the embedding "
                                f"{clip(spec.embedding)}, whose own entry says how it is stored")
            continue
        _check_linear(lin, formats.get(lin.name, {"format": WeightFormat.DENSE, "activation": "none"}), tensors)
    layers = [(layer, None) for layer in spec.layers]
    layers += [(module.layer, module) for module in spec.extra_modules if module.layer is not None]
    for layer, module in layers:
        for name, shape in _layer_norms(layer, C).items():
            plain(name, shape, "a norm weight")
        if layer.mlp.score_correction_bias:  # the runtime routes without it when absent
            plain(layer.mlp.score_correction_bias, (layer.mlp.num_experts,), "a router bias", required=False)
    for module in spec.extra_modules:
        for name in module.norms:
            plain(name, (C,), "a norm weight")
        for name in module.tensors:
            plain(name, (V, C), f"a tensor of extra module {clip(module.name, 40)}")
        if module.draft_vocab:
            d2t = need_tensor(tensors, module.draft_vocab)
            check_dtype(module.draft_vocab, d2t, "a draft vocabulary's d2t offsets", torch.int64)
            check_shape(module.draft_vocab, d2t, (module.linears["lm_head"].out_features,))
    _check_kv_tensors(spec, kv_table, tensors)


def _layer_norms(layer: LayerSpec, hidden: int) -> dict[str, tuple[int]]:
    """The norm weights the runtime reads for `layer` -> their shapes: the two the layer lists first, its other
    listed ones, and the attention norms the runtime names by the layer's prefix (Qwen3's q/k norms, MLA's)."""
    a = layer.attention
    names = [*layer.norms, *layer.output_norms]
    p = f"{layer.prefix}.self_attn"
    if a.kind == "mla":
        names.append(f"{p}.kv_a_layernorm.weight")
        if a.q_lora_rank is not None:
            names.append(f"{p}.q_a_layernorm.weight")
    elif a.qk_norm:
        names += [f"{p}.q_norm.weight", f"{p}.k_norm.weight"]
    return {name: (norm_size(name, a, hidden),) for name in names}


def _check_embedding(module: str, entry: Mapping, tensors: Mapping[str, torch.Tensor], shape: tuple[int, int]) -> None:
    """A quantized embedding table (passes/embedding_quant.py): an entry with role "embedding", weight-only and
    stored as it is looked up (no input rotation, no fused parts), whose tensors `_check_linear` checks as those of
    a [vocab, hidden] linear's."""
    where = f"manifest formats[{clip(json.dumps(module), 80)}]"
    if not isinstance(entry, Mapping) or entry.get("role") != "embedding":
        raise KilnError(f"{where} names the embedding table, so its role must be \"embedding\"")
    if entry.get("activation", ActivationFormat.NONE) != ActivationFormat.NONE:
        raise KilnError(f"{where}: an embedding table is looked up, not multiplied: activation must be none, got "
                        f"{clip(repr(entry.get('activation')), 40)}")
    for key in ("input_rotation", "part_scales"):
        if key in entry:
            raise KilnError(f"{where}.{key}: an embedding table is stored as it is looked up, with no {key}")
    _check_linear(LinearSpec(module, "embedding", shape[1], shape[0]), entry, tensors)


def _check_linear(lin: LinearSpec, entry: Mapping, tensors: Mapping[str, torch.Tensor]) -> None:
    """`lin`'s stored tensors against its format entry: the weight and scales as `stored_weight` checks them
    at load (a dense weight in a wide float), the bias, the activation format and its scale, the rotation."""

    name, shape = lin.name, (lin.out_features, lin.in_features)
    where = f"manifest formats[{clip(json.dumps(name), 80)}]"
    fmt, stored, _ = stored_weight(name, entry, tensors, shape)
    if not weight_format(fmt).dequantizes:  # a weight stored as its values
        check_dtype(f"{name}.weight", stored["weight"], "a dense weight", *DENSE_DTYPES)
    activation = entry.get("activation", ActivationFormat.NONE)
    if activation not in ACTIVATION_FORMATS:
        raise KilnError(f"{where}.activation is {clip(repr(activation), 40)}; known: {', '.join(ACTIVATION_FORMATS)}")
    # the scales this format and activation read; any other is a sign the entry lies about what is stored
    used = {f"{name}.{key}" for key in stored if key != "weight"}
    if activation in (ActivationFormat.FP8_STATIC_PER_TENSOR, ActivationFormat.NVFP4):
        scale = f"{name}.input_scale"
        if activation == ActivationFormat.FP8_STATIC_PER_TENSOR or scale in tensors:
            t = need_tensor(tensors, scale)
            check_dtype(scale, t, "an activation scale", *DENSE_DTYPES)
            check_shape(scale, t, (), (1,))
            used.add(scale)
    stray = [f"{name}.{key}" for key in SCALE_SUFFIXES if f"{name}.{key}" in tensors and f"{name}.{key}" not in used]
    if stray:
        raise KilnError(f"{where} says {fmt} with activation {activation}, which reads no {clip(stray[0])}; "
                        "the entry does not describe what is stored")
    if lin.bias:
        t = need_tensor(tensors, f"{name}.bias")
        check_dtype(f"{name}.bias", t, "a bias", *DENSE_DTYPES)
        check_shape(f"{name}.bias", t, (lin.out_features,))
    rotation = entry.get("input_rotation")
    if rotation is not None:
        block = rotation.get("block_size")
        if rotation.get("kind") not in ROTATION_KINDS:
            raise KilnError(f"{where}.input_rotation.kind is {clip(repr(rotation.get('kind')), 40)}; known: "
                            f"{', '.join(ROTATION_KINDS)}")
        if isinstance(block, bool) or not isinstance(block, int) or block < 1 or block & (block - 1):
            raise KilnError(f"{where}.input_rotation.block_size must be a power of two, got {clip(repr(block), 20)}")
    part_scales = entry.get("part_scales")  # a fused FP8 linear: each part's scale granularity (unfuse reads it)
    if part_scales is not None and (not isinstance(part_scales, list) or len(part_scales) != len(lin.parts)
                                    or any(p not in ("per_tensor", "per_channel") for p in part_scales)):
        raise KilnError(f"{where}.part_scales must list per_tensor or per_channel for each of its "
                            f"{len(lin.parts)} parts, got {clip(repr(part_scales), 60)}")


def _check_kv_tensors(spec: ModelSpec, table: Mapping, tensors: Mapping[str, torch.Tensor]) -> None:
    """The KV cache table's formats and streams (`resolve_kv_streams` without tensors), and the scale and
    offset tensors it names: present, floating point, one value (per tensor) or one per head, [heads, dim]."""
    for layer, streams in zip(spec.layers, resolve_kv_streams(spec, table), strict=True):
        entry = table.get(str(layer.index))
        if entry is None:
            continue
        for stream in streams:
            scale = (entry.get("scale_tensors") or {}).get(stream.name)
            if stream.static_scale and scale is None:
                raise KilnError(f"kv_cache layer {layer.index}: {stream.format} ({stream.scaling}) needs a scale "
                                f"tensor for stream {stream.name!r}, and the entry names none")
            offset = (entry.get("offset_tensors") or {}).get(stream.name)
            for name, kind in ((scale, "scale"), (offset, "offset")):
                if name is None:
                    continue
                if name not in tensors:
                    raise KilnError(f"artifact is missing KV {kind} tensor {clip(name)!r} (kv_cache layer "
                                    f"{layer.index}, stream {stream.name})")
                t = tensors[name]
                check_dtype(name, t, f"a KV {kind}", *DENSE_DTYPES)
                if kind == "offset":
                    check_shape(name, t, (stream.heads, stream.dim))
                elif stream.scaling == "per_head":
                    check_shape(name, t, (stream.heads,), (stream.heads, 1))
                else:
                    check_shape(name, t, (), (1,))
