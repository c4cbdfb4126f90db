"""The artifact's KV-cache format table: what each layer's cache stores, and how many bytes a token costs.

A layer caches "streams" per token: GQA/MHA layers K [Hkv, D] and V [Hkv, Dv]; MLA layers the compressed
latent [1, kv_lora_rank] and the roped key part [1, qk_rope_head_dim] (never per-head K/V).
Manifest "kv_cache" (layer index as a string -> entry; a layer that is absent is BF16):
    {"format": "bf16" | "fp8_e4m3" | "nvfp4",
     "scaling": "none" (bf16) | "per_tensor" | "per_head" | "dynamic" (fp8) | "e4m3_block16" (nvfp4),
     "streams": ["k", "v"] or ["latent", "k_rope"],
     "scale_tensors": {stream: tensor name in model.safetensors} (static fp8 scales, NVFP4 global scales),
     "offset_tensors": {stream: tensor name} (optional calibrated per-channel offsets, kernels/kv_codec.py),
     "note": why the pass chose this format (optional)}
Scale tensors: fp32, `model.layers.{i}.self_attn.k_scale` / `v_scale` (the names vLLM and ModelOpt use;
`latent_scale` / `k_rope_scale` for MLA); 0-dim per tensor, [Hkv] per head; x = float(q) * scale.
Offset tensors: fp32 [heads, dim], `...self_attn.k_offset` / `v_offset`; x = float(q) * scale + offset.

Byte accounting is the deployment's: BF16 = 2 bytes a value. The CPU runtime holds a BF16 layer's cache
in the model's compute dtype (fp32), so its arithmetic matches the uncached forward exactly; FP8 and NVFP4
layers are stored as real float8_e4m3fn / packed uint8 bytes there too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kiln.kernels.errors import KilnError
from kiln.kernels.formats import KvFormat
from kiln.kernels.kv_codec import KvCodec
from kiln.kernels.registry import KV_FORMATS, kv_format
from kiln.runtime.spec import ModelSpec

BF16 = {"format": KvFormat.BF16, "scaling": "none"}


@dataclass(frozen=True)
class KvStream:
    """One cached stream of one layer: its shape per token and its stored format."""

    name: str  # "k", "v", "latent", "k_rope"
    heads: int
    dim: int
    format: KvFormat = KvFormat.BF16
    scaling: str = "none"
    scale: torch.Tensor | None = None  # static fp8: 0-dim or [H, 1]; nvfp4: 0-dim global scale
    offset: torch.Tensor | None = None  # [H, D] subtracted before quantizing, added back on reading

    @property
    def codec(self) -> KvCodec:
        """Its format's object (kernels/kv_codec.py): byte counts, scales, storage."""
        return kv_format(self.format)

    def bytes_per_token(self) -> int:
        """Deployment bytes one token costs in this stream (per-token scales included; static scales are not)."""
        return self.codec.bytes_per_token(self.heads * self.dim, self.scaling)

    @property
    def static_scale(self) -> bool:
        """Whether it reads a calibrated scale tensor, which the manifest's entry must name."""
        return self.codec.static_scale(self.scaling)


def check_entry(layer: int, entry: Mapping, streams: tuple[tuple[str, int, int], ...]) -> None:
    """Refuse an entry the runtime cannot store (unknown names, NVFP4 on a dim that is not 16-aligned)."""
    fmt, scaling = entry.get("format"), entry.get("scaling", "none")
    if fmt not in KV_FORMATS:
        raise KilnError(f"kv_cache layer {layer}: unknown format {fmt!r}; known: {', '.join(KV_FORMATS)}")
    codec = KV_FORMATS[fmt]
    if scaling not in codec.scalings:
        raise KilnError(f"kv_cache layer {layer}: scaling {scaling!r} is not allowed for {fmt}; "
                        f"choose one of {', '.join(codec.scalings)}")
    names = [name for name, _, _ in streams]
    if "streams" in entry and list(entry["streams"]) != names:
        raise KilnError(f"kv_cache layer {layer}: streams {entry['streams']} do not match the model's {names}")
    bad = codec.unaligned_dims(streams)
    if bad:
        raise KilnError(f"kv_cache layer {layer}: {codec.label} needs dims that are multiples of "
                        f"{codec.dim_multiple}, got {', '.join(bad)}")


def _entry(table: Mapping | None, layer: int) -> Mapping:
    if not table:
        return BF16
    return table.get(str(layer), table.get(layer, BF16))


def check_table(spec: ModelSpec, table: Mapping | None) -> None:
    layers = {str(layer.index) for layer in spec.layers}
    unknown = sorted(str(k) for k in (table or {}) if str(k) not in layers)
    if unknown:
        raise KilnError(f"kv_cache names layers this model does not have: {', '.join(unknown[:5])}")


def resolve_kv_streams(spec: ModelSpec, table: Mapping | None,
                       tensors: Mapping[str, torch.Tensor] | None = None) -> list[tuple[KvStream, ...]]:
    """Per layer, its streams with formats and scales. Without tensors, scales are left out (byte counts)."""
    check_table(spec, table)
    out = []
    for layer in spec.layers:
        entry = _entry(table, layer.index)
        streams = layer.attention.kv_streams()
        check_entry(layer.index, entry, streams)
        fmt, scaling = entry["format"], entry.get("scaling", "none")
        codec = KV_FORMATS[fmt]
        needs_scale = codec.static_scale(scaling)
        resolved = []
        offsets = entry.get("offset_tensors") or {}
        if offsets and not codec.quantized:
            raise KilnError(f"kv_cache layer {layer.index}: a {codec.label} cache takes no offsets")
        unknown = sorted(set(offsets) - {name for name, _, _ in streams})
        if unknown:
            raise KilnError(f"kv_cache layer {layer.index}: offsets for unknown streams {unknown}")
        for name, heads, dim in streams:
            scale = offset = None
            if needs_scale and tensors is not None:
                scale = _scale_tensor(layer.index, entry, name, heads, scaling, tensors)
            if name in offsets and tensors is not None:
                offset = _offset_tensor(offsets[name], heads, dim, tensors)
            resolved.append(KvStream(name, heads, dim, fmt, scaling, scale, offset))
        out.append(tuple(resolved))
    return out


def _scale_tensor(layer: int, entry: Mapping, stream: str, heads: int, scaling: str,
                  tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    names = entry.get("scale_tensors") or {}
    if stream not in names:
        raise KilnError(f"kv_cache layer {layer}: {entry['format']} ({scaling}) needs a scale tensor for stream "
                        f"{stream!r}, and the entry names none")
    if names[stream] not in tensors:
        raise KilnError(f"artifact is missing KV scale tensor {names[stream]!r}")
    scale = tensors[names[stream]].float()
    shape = kv_format(entry["format"]).scale_shape(heads, scaling)
    expected = math.prod(shape)
    if scale.numel() != expected or not torch.isfinite(scale).all() or bool((scale <= 0).any()):
        raise KilnError(f"KV scale {names[stream]!r} must hold {expected} positive finite value(s), "
                        f"got shape {tuple(scale.shape)}")
    return scale.reshape(shape)


def _offset_tensor(name: str, heads: int, dim: int, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    if name not in tensors:
        raise KilnError(f"artifact is missing KV offset tensor {name!r}")
    offset = tensors[name].float()
    if tuple(offset.shape) != (heads, dim) or not torch.isfinite(offset).all():
        raise KilnError(f"KV offset {name!r} must be finite with shape {(heads, dim)}, got {tuple(offset.shape)}")
    return offset


def kv_bytes_per_token(spec: ModelSpec, table: Mapping | None = None) -> dict[int, int]:
    """Deployment KV bytes per token, per layer, for a format table (None: every layer BF16)."""
    return {layer.index: sum(s.bytes_per_token() for s in streams)
            for layer, streams in zip(spec.layers, resolve_kv_streams(spec, table), strict=True)}


def kv_sequence_bytes(per_layer: Mapping[int, int], windows: Mapping[int, int | None], context: int) -> int:
    """KV bytes one sequence of `context` tokens holds: each layer's bytes per token (`kv_bytes_per_token`)
    times the tokens it keeps, its sliding window (`windows`, None: full attention) or the whole context. This
    is what a serving engine that frees the blocks leaving a window holds (vLLM's, SGLang's)."""
    return sum(n * min(context, windows.get(i) or context) for i, n in per_layer.items())


def layer_windows(spec: ModelSpec) -> dict[int, int | None]:
    """Each layer's sliding window (None: full attention)."""
    return {layer.index: layer.attention.sliding_window for layer in spec.layers}
