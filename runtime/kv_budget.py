"""How many sequences fit: KV bytes per token (per layer, before and after) and concurrency per device.

    max concurrent sequences = floor((HBM - weight bytes - activation reserve) / KV bytes per sequence)
    KV bytes per sequence    = sum over layers of KV bytes per token x min(context, the layer's sliding window)

A sliding-window layer (Gemma 3: 5 of every 6) keeps only its window, as serving engines that free the blocks
leaving it do (vLLM, SGLang, and Kiln's own paged cache: runtime.paged_kv_cache releases them, up to a block of
rounding and the forward's width at its window's edge).

The activation reserve is ACTIVATION_RESERVE_FRACTION of HBM (10%: the headroom vLLM's default
gpu_memory_utilization=0.9 leaves for activations, CUDA graphs and the allocator). "Before" is the source
checkpoint served with a BF16 KV cache (2 bytes a value) and its weights as stored; "after" is the
artifact: its KV format table and its stored weight bytes. Everything here is computed from the config
and the format table alone, so configs built on the meta device (no weights) work too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kiln.kernels.targets import B200, H100, H200, Device
from kiln.runtime.kv_format import kv_bytes_per_token, kv_sequence_bytes, layer_windows, resolve_kv_streams
from kiln.runtime.spec import ModelSpec

ACTIVATION_RESERVE_FRACTION = 0.10
CONTEXTS = (4096, 32768)
DEVICES: tuple[Device, ...] = (H100, H200, B200)


def activation_reserve_bytes(device: Device) -> int:
    return int(device.hbm_bytes * ACTIVATION_RESERVE_FRACTION)


def max_concurrent_sequences(device: Device, weight_bytes: int, kv_bytes_per_token: int, context: int,
                             sequence_bytes: int | None = None) -> int:
    """Sequences of `context` tokens whose KV cache fits beside the weights and the activation reserve; each
    holds `sequence_bytes` (default: kv_bytes_per_token x context, every layer attending the whole context)."""
    if kv_bytes_per_token <= 0 or context <= 0:
        raise ValueError(f"kv_bytes_per_token and context must be positive, got {kv_bytes_per_token}, {context}")
    free = device.hbm_bytes - weight_bytes - activation_reserve_bytes(device)
    return max(free, 0) // (sequence_bytes if sequence_bytes is not None else kv_bytes_per_token * context)


def kv_budget(spec: ModelSpec, table: Mapping | None, weight_bytes: int, source_weight_bytes: int,
              devices: Sequence[Device] = DEVICES, contexts: Sequence[int] = CONTEXTS,
              source_spec: ModelSpec | None = None) -> dict:
    """The JSON the report and `optimize inspect` show: per-layer bytes, totals, and the concurrency table.
    `source_spec`: the source's structure where a pass rewrote it (MLA conversion); default `spec`."""
    before = kv_bytes_per_token(source_spec or spec, None)
    after = kv_bytes_per_token(spec, table)
    windows_before, windows = layer_windows(source_spec or spec), layer_windows(spec)
    streams = resolve_kv_streams(spec, table)
    layers = {}
    for layer, layer_streams in zip(spec.layers, streams, strict=True):
        first = layer_streams[0]
        entry = (table or {}).get(str(layer.index), {})
        layers[str(layer.index)] = {
            "format": first.format, "scaling": first.scaling, "centered": bool(entry.get("offset_tensors")),
            "streams": {s.name: [s.heads, s.dim] for s in layer_streams},
            "source_bytes_per_token": before[layer.index], "bytes_per_token": after[layer.index],
            "sliding_window": windows[layer.index],
        }
    total_before, total_after = sum(before.values()), sum(after.values())
    concurrency = []
    for device in devices:
        for context in contexts:
            concurrency.append({
                "device": device.name, "context": context,
                "source": max_concurrent_sequences(device, source_weight_bytes, total_before, context,
                                                   kv_sequence_bytes(before, windows_before, context)),
                "artifact": max_concurrent_sequences(device, weight_bytes, total_after, context,
                                                     kv_sequence_bytes(after, windows, context)),
                "source_sequence_bytes": kv_sequence_bytes(before, windows_before, context),
                "sequence_bytes": kv_sequence_bytes(after, windows, context),
            })
    return {
        "kv_bytes_per_token": total_after,
        "source_kv_bytes_per_token": total_before,
        "layers": layers,
        "weight_bytes": weight_bytes,
        "source_weight_bytes": source_weight_bytes,
        "activation_reserve_fraction": ACTIVATION_RESERVE_FRACTION,
        "max_concurrent_sequences": concurrency,
        "by_layer_type": by_layer_type(after, windows),
    }


def by_layer_type(per_layer: Mapping[int, int], windows: Mapping[int, int | None]) -> dict[str, dict]:
    """KV bytes per token summed by layer type: "full attention" and "sliding window W" (one per window size),
    each with its layer count and the tokens a layer of it keeps (None: the whole context)."""
    out: dict[str, dict] = {}
    for i, n in per_layer.items():
        w = windows.get(i)
        key = "full attention" if w is None else f"sliding window {w}"
        row = out.setdefault(key, {"layers": 0, "bytes_per_token": 0, "window": w})
        row["layers"] += 1
        row["bytes_per_token"] += n
    return out
