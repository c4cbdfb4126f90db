"""ModelGraph -> engine artifact (the contract in `runtime.artifact`).

`lower_tensors` produces exactly the tensors and format table the artifact stores; the gate builds its
engine from the same pair (after a safetensors round trip), so the gate measures what ships.
`write_artifact` writes into a temporary sibling directory and renames it into place (optimizer.output_dir).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save, save_file

from kiln.kernels.errors import KilnError
from kiln.optimizer import __version__
from kiln.optimizer.output_dir import atomic_directory
from kiln.passes.graph import ModelGraph
from kiln.runtime.artifact import MANIFEST, SCHEMA_VERSION, WEIGHTS, sha256_file, validate_manifest


def lower_tensors(graph: ModelGraph) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """(tensors to store, per-module format table). Quantized linears replace their source weight."""
    tensors: dict[str, torch.Tensor] = {}
    formats: dict[str, dict] = {}
    replaced = set()
    for lin in graph.linears.values():
        if lin.quant is None:
            formats[lin.name] = {"format": "dense", "activation": "none", "role": lin.role}
            if lin.tied_to:
                formats[lin.name]["tied_to"] = lin.tied_to  # stored once, as the embedding
            continue
        q = lin.quant
        entry = {"format": q.format, "activation": q.activation, "role": lin.role, "method": q.method}
        if q.in_features is not None:
            entry["in_features"] = int(q.in_features)
        if q.rotation_block:
            entry["input_rotation"] = {"kind": "block_hadamard", "block_size": int(q.rotation_block)}
        formats[lin.name] = entry
        for key, value in q.tensors.items():
            tensors[f"{lin.name}.{key}"] = value.contiguous()
        if lin.tied_to is None:
            replaced.add(lin.weight_name)
    for name, value in graph.tensors.items():
        if name not in replaced:
            tensors[name] = value.contiguous()
    tensors.update(kv_scale_tensors(graph))
    return tensors, formats


def _kv_tensor_name(layer: int, stream: str, kind: str) -> str:
    # k_scale / v_scale: the names vLLM and ModelOpt give FP8 KV scales; MLA: latent_scale / k_rope_scale
    return f"model.layers.{layer}.self_attn.{stream}_{kind}"


def kv_scale_tensors(graph: ModelGraph) -> dict[str, torch.Tensor]:
    """The KV-cache scales and offsets the kv-cache pass calibrated, under their artifact names (fp32)."""
    return {_kv_tensor_name(layer, stream, kind): value.float().contiguous()
            for layer, entry in sorted(graph.kv_cache.items())
            for kind, key in (("scale", "scales"), ("offset", "offsets"))
            for stream, value in sorted(entry.get(key, {}).items())}


def kv_cache_table(graph: ModelGraph) -> dict[str, dict]:
    """The manifest "kv_cache" table (runtime.kv_format): layers absent from it keep a BF16 cache."""
    table = {}
    for layer, entry in sorted(graph.kv_cache.items()):
        row = {"format": entry["format"], "scaling": entry["scaling"], "streams": list(entry["streams"]),
               "scale_tensors": {s: _kv_tensor_name(layer, s, "scale") for s in sorted(entry.get("scales", {}))}}
        if entry.get("offsets"):
            row["offset_tensors"] = {s: _kv_tensor_name(layer, s, "offset") for s in sorted(entry["offsets"])}
        if entry.get("note"):
            row["note"] = entry["note"]
        table[str(layer)] = row
    return table


def roundtrip(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors as the runtime will read them back from model.safetensors."""
    from safetensors.torch import load

    return load(save(tensors))


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _json(obj) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def write_artifact(graph: ModelGraph, out: Path, manifest: dict, report: str, overwrite: bool = False,
                   extra_files: dict[str, bytes] | None = None, inputs: Iterable[Path | str | None] = ()) -> Path:
    """Write the artifact atomically: everything into `.<name>.tmp-*` beside `out`, then rename.

    `extra_files` (file name -> bytes, e.g. sensitivity.json and its heatmap) are written beside the weights
    and checksummed in the manifest like every other file."""
    out = Path(out)
    for name in extra_files or {}:
        if Path(name).name != name or name in (WEIGHTS, MANIFEST, "config.json", "report.md"):
            raise KilnError(f"artifact extra file name {name!r} must be a plain file name not used by Kiln")
    tensors, formats = lower_tensors(graph)
    with atomic_directory(out, overwrite, inputs) as tmp:
        # one metadata key only: safetensors writes metadata in a nondeterministic order
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        # the source's config, for provenance and export; the runtime builds from "architecture" instead
        (tmp / "config.json").write_text(_json(graph.hf_config))
        for f in graph.source.tokenizer_files:
            shutil.copyfile(f, tmp / f.name)
        (tmp / "report.md").write_text(report)
        for name, data in (extra_files or {}).items():
            (tmp / name).write_bytes(data)
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        manifest = {
            **manifest,
            "schema_version": SCHEMA_VERSION,
            "kiln_version": __version__,
            "architecture": graph.spec.to_json(),
            "formats": formats,
            "kv_cache": kv_cache_table(graph),
            "sizes": {"weight_bytes": tensor_bytes(tensors), "source_weight_bytes": graph.source.weight_bytes},
            "tensors": {name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                        for name, t in sorted(tensors.items())},
            "files": files,
        }
        validate_manifest(manifest, out)  # never write what the runtime would refuse to read
        (tmp / MANIFEST).write_text(_json(manifest))
    return out
