"""The KV-cache part of report.md, `optimize build` and `optimize inspect`: bytes per token and concurrency.

The figures come from `runtime.kv_budget.kv_budget` (the architecture + the manifest's "kv_cache"
table + weight bytes), so an artifact written before KV formats existed reads as BF16 throughout.
"""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from kiln.runtime.spec import spec_from_json


def artifact_kv_budget(artifact: Path, manifest: dict) -> dict:
    """The budget of an artifact from its manifest (architecture, KV table and stored weight bytes).
    `optimize inspect` reads the manifest's own "kv_budget" when present, so it never imports torch."""
    # lazy: kv_budget imports torch (runtime.kv_format), which `optimize inspect` otherwise never needs
    from kiln.runtime.kv_budget import kv_budget

    sizes = manifest["sizes"]
    return kv_budget(spec_from_json(manifest["architecture"]), manifest.get("kv_cache"), sizes["weight_bytes"],
                     sizes["source_weight_bytes"])


def _reserve(budget: dict) -> str:
    return f"{budget['activation_reserve_fraction']:.0%} of HBM"


def _layer_format(row: dict) -> str:
    details = [row["scaling"]] if row["scaling"] != "none" else []
    details += ["centered"] if row.get("centered") else []
    return row["format"] + (f" ({', '.join(details)})" if details else "")


def kv_markdown(budget: dict) -> list[str]:
    before, after = budget["source_kv_bytes_per_token"], budget["kv_bytes_per_token"]
    lines = [
        "## KV cache",
        "",
        ("Bytes per token as a deployment stores them: before = the source with a BF16 cache (2 bytes a value), "
         "after = this artifact's KV format (FP8: 1 byte a value; NVFP4: half a byte + one E4M3 scale per 16; "
         "per-token scales included). The CPU runtime holds BF16 layers as fp32."),
        "",
        "| layer | format | streams (heads x dim) | bytes/token before | bytes/token after |",
        "|---|---|---|---:|---:|",
    ]
    for layer, row in budget["layers"].items():
        streams = ", ".join(f"{name} {h}x{d}" for name, (h, d) in row["streams"].items())
        lines.append(f"| {layer} | {_layer_format(row)} | {streams} | {row['source_bytes_per_token']} | "
                     f"{row['bytes_per_token']} |")
    lines += [f"| total | | | {before} | {after} ({after / before:.3f}x) |", ""]
    types = budget.get("by_layer_type", {})
    if len(types) > 1 or any(t["window"] for t in types.values()):
        lines += [("By layer type: a sliding-window layer keeps its last `window` tokens, a full-attention layer "
                   "the whole context."), "", "| layer type | layers | bytes/token after | tokens kept |",
                  "|---|---:|---:|---|"]
        lines += [f"| {name} | {t['layers']} | {t['bytes_per_token']} | {t['window'] or 'context'} |"
                  for name, t in types.items()]
        lines.append("")
    lines += ["### Maximum concurrent sequences", "",
              (f"(HBM - weight bytes - activation reserve of {_reserve(budget)}) / KV bytes per sequence (each "
               "layer's bytes per token x the tokens it keeps: the context, or its sliding window); "
               f"weights: source {budget['source_weight_bytes']} B, artifact {budget['weight_bytes']} B."), "",
              "| device | context | KV bytes/sequence after | before | after |", "|---|---:|---:|---:|---:|"]
    for row in budget["max_concurrent_sequences"]:
        lines.append(f"| {row['device']} | {row['context']} | {row.get('sequence_bytes', '')} | {row['source']} | "
                     f"{row['artifact']} |")
    return lines


def kv_tables(budget: dict) -> list[Table]:
    layers = Table(title="KV cache bytes/token (before: BF16)")
    for col in ("layer", "format", "before", "after"):
        layers.add_column(col, justify="left" if col in ("layer", "format") else "right")
    for layer, row in budget["layers"].items():
        layers.add_row(layer, _layer_format(row), str(row["source_bytes_per_token"]), str(row["bytes_per_token"]))
    before, after = budget["source_kv_bytes_per_token"], budget["kv_bytes_per_token"]
    layers.add_row("total", "", str(before), f"{after} ({after / before:.3f}x)")
    concurrency = Table(title=f"max concurrent sequences\n(reserve: {_reserve(budget)})")
    for col in ("device", "context", "before", "after"):
        concurrency.add_column(col, justify="left" if col == "device" else "right")
    for row in budget["max_concurrent_sequences"]:
        concurrency.add_row(row["device"], str(row["context"]), str(row["source"]), str(row["artifact"]))
    return [layers, concurrency]
