"""How many sequences fit: KV bytes per token (per layer, before and after) and concurrency per device.

    max concurrent sequences = floor((HBM - weight bytes - activation reserve) / (KV bytes per token * context))

The activation reserve is ACTIVATION_RESERVE_FRACTION of HBM (10%: the headroom vLLM's default
gpu_memory_utilization=0.9 leaves for activations, CUDA graphs and the allocator). "Before" is the source
checkpoint served with a BF16 KV cache (2 bytes a value) and its weights as stored; "after" is the
artifact: its KV format table and its stored weight bytes. Everything here is computed from the config
and the format table alone, so configs built on the meta device (no weights) work too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kiln.kernels.targets import B200, H100, H200, Device
from kiln.runtime.kv_format import kv_bytes_per_token, resolve_kv_streams
from kiln.runtime.spec import ModelSpec

ACTIVATION_RESERVE_FRACTION = 0.10
CONTEXTS = (4096, 32768)
DEVICES: tuple[Device, ...] = (H100, H200, B200)


def activation_reserve_bytes(device: Device) -> int:
    return int(device.hbm_bytes * ACTIVATION_RESERVE_FRACTION)


def max_concurrent_sequences(device: Device, weight_bytes: int, kv_bytes_per_token: int, context: int) -> int:
    """Sequences of `context` tokens whose KV cache fits beside the weights and the activation reserve."""
    if kv_bytes_per_token <= 0 or context <= 0:
        raise ValueError(f"kv_bytes_per_token and context must be positive, got {kv_bytes_per_token}, {context}")
    free = device.hbm_bytes - weight_bytes - activation_reserve_bytes(device)
    return max(free, 0) // (kv_bytes_per_token * context)


def kv_budget(spec: ModelSpec, table: Mapping | None, weight_bytes: int, source_weight_bytes: int,
              devices: Sequence[Device] = DEVICES, contexts: Sequence[int] = CONTEXTS,
              source_spec: ModelSpec | None = None) -> dict:
    """The JSON the report and `optimize inspect` show: per-layer bytes, totals, and the concurrency table.
    `source_spec`: the source's structure where a pass rewrote it (MLA conversion); default `spec`."""
    before = kv_bytes_per_token(source_spec or spec, None)
    after = kv_bytes_per_token(spec, table)
    streams = resolve_kv_streams(spec, table)
    layers = {}
    for layer, layer_streams in zip(spec.layers, streams, strict=True):
        first = layer_streams[0]
        entry = (table or {}).get(str(layer.index), {})
        layers[str(layer.index)] = {
            "format": first.format, "scaling": first.scaling, "centered": bool(entry.get("offset_tensors")),
            "streams": {s.name: [s.heads, s.dim] for s in layer_streams},
            "source_bytes_per_token": before[layer.index], "bytes_per_token": after[layer.index],
        }
    total_before, total_after = sum(before.values()), sum(after.values())
    concurrency = []
    for device in devices:
        for context in contexts:
            concurrency.append({
                "device": device.name, "context": context,
                "source": max_concurrent_sequences(device, source_weight_bytes, total_before, context),
                "artifact": max_concurrent_sequences(device, weight_bytes, total_after, context),
            })
    return {
        "kv_bytes_per_token": total_after,
        "source_kv_bytes_per_token": total_before,
        "layers": layers,
        "weight_bytes": weight_bytes,
        "source_weight_bytes": source_weight_bytes,
        "activation_reserve_fraction": ACTIVATION_RESERVE_FRACTION,
        "max_concurrent_sequences": concurrency,
    }
