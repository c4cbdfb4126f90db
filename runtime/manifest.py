"""Manifest: a typed view of an artifact's manifest.json, written and read by this one piece of code.

    manifest = Manifest.from_json(read_manifest(artifact))   # or load_manifest(artifact)
    manifest.architecture                                    # the ModelSpec the runtime builds
    source_spec(manifest, manifest.architecture)             # the source's own ModelSpec, or None
    manifest.to_json()                                       # the JSON object manifest.json holds

A build fills the parts it knows in turn: what the source and the recipe were (`Source`, `recipe`, `passes`),
how the build ran (`BuildRecord`), and, when the artifact is written (`optimizer.lower.write_artifact`), the
artifact's own tables (`ArtifactTables`: schema version, architecture, formats, tensors, checksums). A manifest
written by hand or by a test holds only the first part; keys this view does not name are kept as they are
(`extra`), so `Manifest.from_json(m).to_json() == m`.

The source's spec (`source_architecture`, the ModelSpec of the checkpoint before any structural pass) is
recorded beside the artifact's, so no consumer re-reads config.json for the source's structure. Artifacts
written before it was recorded load with `source_spec` None: `source_spec(manifest, spec)` returns None for
them and the consumer falls back on what it did before.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.kernels.errors import KilnError
from kiln.runtime.artifact import read_manifest
from kiln.runtime.spec import ModelSpec, spec_from_json

SOURCE_ARCHITECTURE = "source_architecture"
"""The manifest key of the source's spec (ModelSpec JSON, as "architecture" is the artifact's)."""


def _present(items: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in items.items() if value is not None}


@dataclass(frozen=True)
class Source:
    """manifest["source"]: the checkpoint the artifact was built from (`config_sha256` absent in artifacts built
    before it was recorded; optimizer.measure.gate.check_baseline compares both hashes)."""

    model_type: str
    checkpoint: str | None = None
    weight_files: dict[str, str] | None = None
    config_sha256: str | None = None

    def to_json(self) -> dict:
        return _present({"checkpoint": self.checkpoint, "model_type": self.model_type,
                         "weight_files": None if self.weight_files is None else dict(self.weight_files),
                         "config_sha256": self.config_sha256})

    @classmethod
    def from_json(cls, data: dict) -> Source:
        return cls(model_type=data.get("model_type"), checkpoint=data.get("checkpoint"),
                   weight_files=data.get("weight_files"), config_sha256=data.get("config_sha256"))


@dataclass(frozen=True)
class BuildRecord:
    """How the build ran: its gate data (`evaluation`), calibration data, timings and memory (None in a
    reproducible build), CPU numerics, every pass's graph record, the precision plan (None: no precision pass)
    and the KV budget. Absent from manifests written by hand."""

    evaluation: dict | None
    calibration: dict | None
    build_seconds: float | None
    peak_rss_bytes: int | None
    reproducible: bool
    numerics: dict
    records: dict
    kv_budget: dict | None = None
    precision: dict | None = None

    KEYS = ("evaluation", "calibration", "build_seconds", "peak_rss_bytes", "reproducible", "numerics",
            "records", "kv_budget")

    def to_json(self) -> dict:
        data = {key: getattr(self, key) for key in self.KEYS if key != "kv_budget" or self.kv_budget is not None}
        return data | ({"precision": self.precision} if self.precision else {})

    @classmethod
    def from_json(cls, data: dict) -> BuildRecord | None:
        if not all(key in data for key in cls.KEYS if key != "kv_budget"):
            return None
        return cls(**{key: data.get(key) for key in cls.KEYS}, precision=data.get("precision") or None)


@dataclass(frozen=True)
class Sizes:
    """manifest["sizes"]: bytes of the stored tensors and of the source checkpoint's."""

    weight_bytes: int
    source_weight_bytes: int

    def to_json(self) -> dict:
        return {"weight_bytes": self.weight_bytes, "source_weight_bytes": self.source_weight_bytes}


@dataclass(frozen=True)
class ArtifactTables:
    """What the artifact writer adds: the schema and Kiln versions, the architecture the runtime builds, the
    tensors' stored formats, dtypes and shapes, and every file's sha256."""

    schema_version: int
    kiln_version: str
    architecture: ModelSpec
    tensors: dict[str, dict]
    files: dict[str, str]

    KEYS = ("schema_version", "kiln_version", "architecture", "tensors", "files")

    def to_json(self) -> dict:
        return {"schema_version": self.schema_version, "kiln_version": self.kiln_version,
                "architecture": self.architecture.to_json(), "tensors": self.tensors, "files": self.files}

    @classmethod
    def from_json(cls, data: dict) -> ArtifactTables | None:
        if not all(key in data for key in cls.KEYS):
            return None
        return cls(schema_version=data["schema_version"], kiln_version=data["kiln_version"],
                   architecture=spec_from_json(data["architecture"]), tensors=data["tensors"], files=data["files"])


@dataclass(frozen=True)
class Manifest:
    """An artifact's manifest (see the module docstring): `formats`, `kv_cache` and `sizes` come from lowering
    the graph (optimizer.lower.Lowered), `artifact` from writing it."""

    source: Source
    target: str
    recipe: dict
    passes: list[dict]
    build: BuildRecord | None = None
    source_spec: ModelSpec | None = None
    formats: dict[str, dict] | None = None
    kv_cache: dict[str, dict] | None = None
    sizes: Sizes | None = None
    artifact: ArtifactTables | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    KEYS = ("source", "target", "recipe", "passes", SOURCE_ARCHITECTURE, "formats", "kv_cache", "sizes")

    @property
    def architecture(self) -> ModelSpec | None:
        return None if self.artifact is None else self.artifact.architecture

    def replace(self, **changes) -> Manifest:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict:
        """The JSON object manifest.json holds (a key is absent where its part is None)."""
        source = self.source.to_json() if isinstance(self.source, Source) else self.source
        data = _present({"source": source, "target": self.target, "recipe": self.recipe,
                         "passes": self.passes})
        data |= self.build.to_json() if self.build is not None else {}
        data |= _present({SOURCE_ARCHITECTURE: None if self.source_spec is None else self.source_spec.to_json(),
                          "formats": self.formats, "kv_cache": self.kv_cache,
                          "sizes": None if self.sizes is None else self.sizes.to_json()})
        data |= self.artifact.to_json() if self.artifact is not None else {}
        return {**self.extra, **data}  # a named part wins over a stale key of the same name

    @classmethod
    def from_json(cls, data: dict) -> Manifest:
        """The typed view of a manifest's JSON (one `validate_manifest` accepts: runtime.artifact.read_manifest
        checks it first; a hand-made one lacking required keys gets None there, which validate_manifest refuses
        by name when it is written)."""
        build = BuildRecord.from_json(data)
        artifact = ArtifactTables.from_json(data)
        named = set(cls.KEYS) | (set(BuildRecord.KEYS) | {"precision"} if build else set()) \
            | (set(ArtifactTables.KEYS) if artifact else set())
        source, sizes, spec = data.get("source"), data.get("sizes"), data.get(SOURCE_ARCHITECTURE)
        return cls(
            source=Source.from_json(source) if isinstance(source, dict) else source, target=data.get("target"),
            recipe=data.get("recipe"), passes=data.get("passes"), build=build,
            source_spec=None if spec is None else spec_from_json(spec),
            formats=data.get("formats"), kv_cache=data.get("kv_cache"),
            sizes=None if sizes is None else Sizes(sizes.get("weight_bytes"), sizes.get("source_weight_bytes")),
            artifact=artifact, extra={k: v for k, v in data.items() if k not in named})


def load_manifest(path: Path | str, verify: bool = True) -> Manifest:
    """The artifact's manifest, typed, after runtime.artifact.read_manifest's checks (`verify`: checksums and
    structure too)."""
    return Manifest.from_json(read_manifest(path, verify=verify))


def source_spec(manifest: Manifest | dict, artifact_spec: ModelSpec) -> ModelSpec | None:
    """The source checkpoint's spec as the manifest records it: `artifact_spec` itself where the two are equal
    (no structural pass changed it), None for an artifact written before the source's spec was recorded (the
    caller falls back on what it knows otherwise)."""
    if isinstance(manifest, Manifest):
        recorded = manifest.source_spec
    else:
        data = manifest.get(SOURCE_ARCHITECTURE)
        recorded = None if data is None else spec_from_json(data)
    if recorded is None:
        return None
    return artifact_spec if recorded == artifact_spec else recorded


def known_source_spec(manifest: Manifest | dict, artifact_spec: ModelSpec, purpose: str) -> ModelSpec:
    """The source's spec, where it is known: recorded, or (in a manifest written before it was recorded) the
    artifact's own when no layer is MLA or the source is natively MLA (DeepSeek-V3). A layer a pass converted to
    MLA in such an older artifact is refused in one line: `purpose` says what needed the source."""
    recorded = source_spec(manifest, artifact_spec)
    if recorded is not None:
        return recorded
    model_type = (manifest.source.model_type if isinstance(manifest, Manifest)
                  else (manifest.get("source") or {}).get("model_type"))
    if model_type == "deepseek_v3" or all(layer.attention.kind != "mla" for layer in artifact_spec.layers):
        return artifact_spec
    raise KilnError(f"{purpose} needs the structure of the checkpoint this artifact was converted from, which its "
                    f"manifest predates (no {SOURCE_ARCHITECTURE}); rebuild the artifact with this Kiln")
