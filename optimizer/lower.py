"""ModelGraph -> engine artifact (the contract in `runtime.artifact`, its manifest typed in `runtime.manifest`).

    lowered = lower(graph)                     # tensors, format table, KV-cache table, weight bytes
    write_artifact(graph, out, manifest, report, lowered=lowered)

`lower` lowers the graph once for everything a build needs after its passes (the manifest's preview, the
report, the files). `lower_tensors` produces exactly the tensors and format table the artifact stores; the
gate builds its engine from the same pair (after a safetensors round trip), so the gate measures what ships. The tensors are a
`LoweredTensors` mapping: each is read on access from where the graph keeps it (the checkpoint, the spill
file, memory), as the graph stood when it was lowered, so lowering costs no memory and building one block of
the runtime's model reads only that block's tensors.
`write_artifact` writes into a temporary sibling directory and renames it into place (optimizer.output_dir);
`write_safetensors` writes model.safetensors one tensor at a time, byte for byte what safetensors' own
`save_file` writes for the same tensors.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load, save

from kiln.kernels.errors import KilnError
from kiln.optimizer import __version__
from kiln.optimizer.output_dir import atomic_directory
from kiln.passes.graph import ModelGraph
from kiln.passes.tensor_store import (
    SAFETENSORS_DTYPES,
    IndexedTensors,
    TensorInfo,
    releasing,
    tensor_bytes_view,
    tensor_info,
)
from kiln.runtime.artifact import MANIFEST, SCHEMA_VERSION, WEIGHTS, sha256_file, validate_manifest
from kiln.runtime.manifest import ArtifactTables, Manifest, Sizes

SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


class LoweredTensors(IndexedTensors, MutableMapping[str, torch.Tensor]):
    """The artifact's tensors by name, each taken (contiguous) from the mapping that holds it when asked.
    Entries set on it directly are kept as given (tests and tools rewrite a lowered model this way)."""

    def __init__(self):
        self._where: dict[str, tuple[Mapping[str, torch.Tensor] | None, str | torch.Tensor]] = {}

    def add(self, name: str, source: Mapping[str, torch.Tensor], key: str) -> None:
        self._where[name] = (source, key)

    def __getitem__(self, name: str) -> torch.Tensor:
        source, key = self._where[name]
        return key if source is None else source[key].contiguous()

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        self._where[name] = (None, value)

    def __delitem__(self, name: str) -> None:
        del self._where[name]

    def info(self, name: str) -> TensorInfo:
        source, key = self._where[name]
        return TensorInfo.of(key) if source is None else tensor_info(source, key)


def lower_tensors(graph: ModelGraph) -> tuple[LoweredTensors, dict[str, dict]]:
    """(tensors to store, per-module format table). Quantized linears replace their source weight.

    The tensors are those of the graph as it stands now, read on access (the graph's tensor store is copied,
    which copies references only; quantized weights are immutable)."""
    tensors = LoweredTensors()
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
        if q.part_scales:  # a fused FP8 linear (passes/fuse.py): its parts' own scale granularity
            entry["part_scales"] = list(q.part_scales)
        formats[lin.name] = entry
        for key in q.tensors:
            tensors.add(f"{lin.name}.{key}", q.tensors, key)
        if lin.tied_to is None:
            replaced.add(lin.weight_name)
    q = graph.embedding_quant
    if q is not None:  # stored under the embedding's own name (a tied lm_head's entry keeps pointing at it)
        module = graph.embedding.removesuffix(".weight")
        formats[module] = {"format": q.format, "activation": "none", "role": "embedding", "method": q.method}
        if q.in_features is not None:
            formats[module]["in_features"] = int(q.in_features)
        for key in q.tensors:
            tensors.add(f"{module}.{key}", q.tensors, key)
        replaced.add(graph.embedding)
    stored = graph.tensors.copy()
    for name in stored:
        if name not in replaced:
            tensors.add(name, stored, name)
    kv_scales = kv_scale_tensors(graph)
    for name in kv_scales:
        tensors.add(name, kv_scales, name)
    return tensors, formats


@dataclass(frozen=True)
class Lowered:
    """The graph lowered once, as it stood then: the tensors the artifact stores (read on access), the
    manifest's "formats" and "kv_cache" tables and the stored tensors' bytes."""

    tensors: LoweredTensors
    formats: dict[str, dict]
    kv_cache: dict[str, dict]
    weight_bytes: int

    def sizes(self, graph: ModelGraph) -> Sizes:
        return Sizes(self.weight_bytes, graph.source.weight_bytes)

    def into(self, manifest: Manifest, graph: ModelGraph) -> Manifest:
        """`manifest` with this lowering's tables and sizes."""
        return manifest.replace(formats=self.formats, kv_cache=self.kv_cache, sizes=self.sizes(graph))


def lower(graph: ModelGraph) -> Lowered:
    """Lower the graph as it stands now (`lower_tensors`, `kv_cache_table`, `tensor_bytes`)."""
    tensors, formats = lower_tensors(graph)
    return Lowered(tensors, formats, kv_cache_table(graph), tensor_bytes(tensors))


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


def roundtrip(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors as the runtime will read them back from model.safetensors. safetensors stores a contiguous
    CPU tensor's bytes as they are, so such a tensor is its own read-back and is shared, not copied (a build
    holds no second copy of a model for its gate); any other goes through safetensors, one tensor at a time."""
    out = {}
    for name in tensors:
        t = tensors[name]
        if t.device.type == "cpu" and t.is_contiguous() and t.dtype in SAFETENSORS_NAMES:
            out[name] = t.detach()
        else:
            out[name] = load(save({name: t}))[name]
    return out



def tensor_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    return sum(tensor_info(tensors, name).nbytes for name in tensors)


def _safetensors_order(infos: Mapping[str, TensorInfo], metadata: Mapping[str, str] | None) -> list[str]:
    """The order in which safetensors lays tensors out (today: by dtype, widest first, then by name), taken
    from safetensors itself on one-element stand-ins, so that a change in its rule cannot go unnoticed."""
    standins = {name: torch.zeros(1, dtype=info.dtype) for name, info in infos.items()}
    data = save(standins, metadata=None if metadata is None else dict(metadata))
    (length,) = struct.unpack("<Q", data[:8])
    return [name for name in json.loads(data[8: 8 + length]) if name != "__metadata__"]


def write_safetensors(path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
                      ) -> None:
    """Write `tensors` as a safetensors file, reading and writing one tensor at a time: the header (an 8-byte
    little-endian length, then JSON: "__metadata__" first, then every tensor's dtype, shape and data offsets,
    padded with spaces to a multiple of 8 bytes) from dtypes and shapes alone, then each tensor's bytes.
    The bytes equal safetensors' `save_file` of the same tensors and metadata (tests/test_streaming.py)."""
    infos = {name: tensor_info(tensors, name) for name in tensors}
    unknown = sorted({str(i.dtype) for i in infos.values() if i.dtype not in SAFETENSORS_NAMES})
    if unknown:
        raise KilnError(f"cannot store dtype(s) {', '.join(unknown)} in safetensors")
    order = _safetensors_order(infos, metadata)
    header: dict[str, object] = {} if metadata is None else {"__metadata__": dict(metadata)}
    offset = 0
    for name in order:
        info = infos[name]
        header[name] = {"dtype": SAFETENSORS_NAMES[info.dtype], "shape": list(info.shape),
                        "data_offsets": [offset, offset + info.nbytes]}
        offset += info.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name in releasing(order, lambda n: infos[n].nbytes):
            t = tensors[name]
            if TensorInfo.of(t) != infos[name]:
                raise KilnError(f"tensor {name} changed while it was written: {TensorInfo.of(t)} != {infos[name]}")
            f.write(tensor_bytes_view(t))
            del t


def _manifest_entry(info: TensorInfo) -> dict:
    return {"dtype": str(info.dtype).removeprefix("torch."), "shape": list(info.shape)}


def _json(obj) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def write_artifact(graph: ModelGraph, out: Path, manifest: Manifest | dict, report: str, overwrite: bool = False,
                   extra_files: dict[str, bytes] | None = None, inputs: Iterable[Path | str | None] = (),
                   lowered: Lowered | None = None) -> Path:
    """Write the artifact atomically: everything into `.<name>.tmp-*` beside `out`, then rename.

    `manifest` is the build's part (a dict is read as `Manifest.from_json`); the lowering's tables and the
    artifact's (`ArtifactTables`) are added here. `lowered`: the graph's lowering as it stands now (None: lower
    it here). `extra_files` (file name -> bytes, e.g. sensitivity.json and its heatmap) are written beside the
    weights and checksummed in the manifest like every other file."""
    out = Path(out)
    for name in extra_files or {}:
        if Path(name).name != name or name in (WEIGHTS, MANIFEST, "config.json", "report.md"):
            raise KilnError(f"artifact extra file name {name!r} must be a plain file name not used by Kiln")
    lowered = lower(graph) if lowered is None else lowered
    manifest = manifest if isinstance(manifest, Manifest) else Manifest.from_json(manifest)
    if manifest.source_spec is None and graph.source.spec is not None:  # the source's spec, as loaded
        manifest = dataclasses.replace(manifest, source_spec=graph.source.spec)
    manifest = lowered.into(manifest, graph)
    with atomic_directory(out, overwrite, inputs) as tmp:
        # one metadata key only: safetensors writes metadata in a nondeterministic order
        write_safetensors(tmp / WEIGHTS, lowered.tensors, {"format": "pt"})
        # the source's config, for provenance and export; the runtime builds from "architecture" instead
        (tmp / "config.json").write_text(_json(graph.hf_config))
        for f in graph.source.tokenizer_files:
            shutil.copyfile(f, tmp / f.name)
        (tmp / "report.md").write_text(report)
        for name, data in (extra_files or {}).items():
            (tmp / name).write_bytes(data)
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        tensors = {name: _manifest_entry(lowered.tensors.info(name)) for name in sorted(lowered.tensors)}
        data = manifest.replace(artifact=ArtifactTables(SCHEMA_VERSION, __version__, graph.spec, tensors,
                                                        files)).to_json()
        validate_manifest(data, out)  # never write what the runtime would refuse to read
        (tmp / MANIFEST).write_text(_json(data))
    return out
