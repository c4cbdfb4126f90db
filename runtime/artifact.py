"""The engine artifact contract: what `optimizer.lower` writes and the runtime reads.

An artifact is a directory:
    manifest.json       schema version, Kiln version, the architecture (runtime.spec.ModelSpec as JSON: what
                        the runtime builds, as the passes left it), source + its weight hashes, target,
                        recipe, every pass's config/result/gate/record, the per-module format table, sizes,
                        sha256 of every other file
    model.safetensors   packed weights and scales (ModelOpt unified tensor names)
    the source's Hugging Face config (provenance and export only: the runtime never reads it), tokenizer
    files, report.md
It is written into a temporary sibling directory and renamed into place, so it either exists whole or not
at all. Reading checks the schema version, the manifest's shape and every checksum before anything is used.

Artifacts may come from hostile hands, so reading is strict (every failure is a one-line KilnError of
bounded length):
  - the manifest must have the shape `validate_manifest` checks (a bool is not an integer here);
  - its "files" table (name -> sha256) names plain files inside the artifact: no '/', '\\', '..', NUL;
  - model.safetensors must be in that table, and every other entry of the directory too:
    the runtime reads only checksummed files (the tokenizer loader picks up whatever tokenizer files lie
    in the directory, so an unlisted file is refused rather than ignored);
  - no file inside the artifact may be a symlink (the artifact directory itself may be one);
  - the architecture must be well-typed and consistent, and agree with model.safetensors' header: every
    tensor the runtime reads present with the shape and dtype of its declared format (runtime.structure).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kiln.kernels.errors import KilnError, clip
from kiln.runtime.spec import spec_from_json

SCHEMA_VERSION = 2  # 2: the manifest carries the architecture; 1 (before it) is refused with "rebuild"
MANIFEST = "manifest.json"
WEIGHTS = "model.safetensors"
REQUIRED_FILES = (WEIGHTS,)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja")
"""Tokenizer files Kiln copies into an artifact (`optimizer.loader.TOKENIZER_FILES`)."""
MAX_JSON_BYTES = 64 * 2**20
"""Largest JSON file (manifest, config) read; a bigger one is refused before reading."""

_SHA256 = re.compile(r"[0-9a-f]{64}")


def _describe(value: object) -> str:
    """A JSON value, briefly: `true`, `"abc"`, `3`, `an array`, `an object`."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    try:
        return clip(json.dumps(value), 40)
    except (TypeError, ValueError):
        return clip(repr(value), 40)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def read_bounded(path: Path, max_bytes: int, what: str, too_big: str) -> bytes:
    """At most `max_bytes` of a file that hostile hands may have made huge: an unreadable file or a bigger one
    is a one-line KilnError ("cannot read {what}: ...", "{what} is larger than N bytes; {too_big}")."""
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as exc:
        raise KilnError(f"cannot read {what}: {clip(exc.strerror or exc, 60)}") from None
    if len(data) > max_bytes:
        raise KilnError(f"{what} is larger than {max_bytes} bytes; {too_big}")
    return data


def read_json(path: Path, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """A JSON file's content; a file that is unreadable, too big or not valid JSON is a one-line KilnError."""
    path = Path(path)
    data = read_bounded(path, max_bytes, clip(path), "refusing to read it as JSON")
    try:
        return json.loads(data.decode("utf-8"))
    except RecursionError:
        raise KilnError(f"{clip(path)} is not valid JSON: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, too many digits in an integer
        raise KilnError(f"{clip(path)} is not valid JSON: {clip(str(exc).splitlines()[0] if str(exc) else exc, 100)}") \
            from None


def read_manifest(path: Path | str, verify: bool = True) -> dict:
    """The artifact's manifest, after checking its schema version and shape and (by default) its files:
    the required ones are listed, nothing unlisted lies beside them, none is a symlink, every sha256 matches;
    and then its structure against model.safetensors' header (`runtime.structure.check_structure`)."""
    root = Path(path)
    if not root.is_dir():
        raise KilnError(f"artifact {clip(root)} does not exist or is not a directory")
    manifest_path = root / MANIFEST
    if manifest_path.is_symlink():
        raise KilnError(f"{clip(root)}: {MANIFEST} is a symlink; files inside an artifact must not be symlinks")
    if not manifest_path.is_file():
        raise KilnError(f"{clip(root)} is not a Kiln artifact: no {MANIFEST}")
    manifest = read_json(manifest_path)
    validate_manifest(manifest, root)
    if verify:
        verify_checksums(root, manifest)
        # the writer of an artifact writes its checksums too: its architecture must agree with its tensors
        from kiln.runtime.structure import (
            check_structure,  # lazy: it imports torch; reading a manifest does not
        )

        check_structure(artifact_file(root, manifest, WEIGHTS), manifest)
    return manifest


# --- manifest shape ---------------------------------------------------------------------------------------
_KINDS: dict[str, tuple[str, Any]] = {
    "object": ("an object", lambda v: isinstance(v, dict)),
    "array": ("an array", lambda v: isinstance(v, list)),
    "string": ("a string", lambda v: isinstance(v, str)),
    "integer": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "number": ("a number", lambda v: isinstance(v, int | float) and not isinstance(v, bool)),
    "count": ("a non-negative integer", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0),
    "positive": ("a positive integer", lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0),
    "object|null": ("an object or null", lambda v: v is None or isinstance(v, dict)),
}


class _Shape:
    """Checks one manifest's shape; every complaint names the key (a dotted path) and is one line."""

    def __init__(self, where: Path | str | None):
        self.where = f"{clip(where)}: " if where is not None else ""

    def fail(self, key: str, problem: str):
        raise KilnError(f"{self.where}malformed manifest: {clip(key, 80)} {problem}")

    def check(self, value: Any, key: str, kind: str) -> Any:
        what, ok = _KINDS[kind]
        if not ok(value):
            self.fail(key, f"must be {what}, got {_describe(value)}")
        return value

    def field(self, obj: dict, parent: str, name: str, kind: str, required: bool = True) -> Any:
        key = f"{parent}.{name}" if parent else name
        if name not in obj:
            if required:
                self.fail(key, f"is missing (it must be {_KINDS[kind][0]})")
            return None
        return self.check(obj[name], key, kind)

    def table(self, obj: dict, parent: str, name: str, required: bool = True) -> Iterable[tuple[str, dict]]:
        """Entries of an object of objects, `parent.name`: (key, entry) pairs, each entry checked to be an object."""
        key = f"{parent}.{name}" if parent else name
        table = self.field(obj, parent, name, "object", required)
        for k, entry in (table or {}).items():
            yield f"{key}[{json.dumps(k)}]", self.check(entry, f"{key}[{json.dumps(k)}]", "object")


def check_file_name(name: object, where: str = "") -> str:
    """A name from the manifest's file table: a plain file name inside the artifact, or a KilnError."""
    if (not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name or "\x00" in name
            or Path(name).is_absolute()):
        raise KilnError(f"{where}manifest file table names {_describe(name)}; file names must be plain names "
                        "inside the artifact (no '/', backslash, '..', NUL)")
    return name


def validate_manifest(manifest: Any, where: Path | str | None = None) -> dict:
    """Refuse a manifest whose shape the runtime and `optimize inspect` cannot read (one line naming the key).

    Required: schema_version (an integer, not a bool, equal to SCHEMA_VERSION), architecture (a ModelSpec),
    files {name: sha256},
    formats {module: {format, ...}}, target, source {model_type, ...}, recipe {name, passes}, passes [{name,
    decision, gate}], sizes {weight_bytes, source_weight_bytes}, tensors {name: {dtype, shape}}.
    Optional: kv_cache {layer: {format, ...}}, precision {pass, effective_bits, groups, ...}, kv_budget
    {kv_bytes_per_token, layers, max_concurrent_sequences, ...} (the parts `optimize inspect` prints).
    Imports nothing heavy (no torch): `optimize inspect` calls it."""
    s = _Shape(where)
    if not isinstance(manifest, dict):
        raise KilnError(f"{s.where}malformed manifest: it must be a JSON object, got {_describe(manifest)}")
    version = s.field(manifest, "", "schema_version", "integer")
    if version == 1:
        raise KilnError(f"{s.where}artifact schema version 1 (written before the manifest carried the "
                        "architecture); rebuild it from its checkpoint with this Kiln's `optimize build`")
    if version != SCHEMA_VERSION:
        raise KilnError(f"{s.where}artifact schema version {version}, this runtime reads version {SCHEMA_VERSION}")
    spec_from_json(s.field(manifest, "", "architecture", "object"))
    _check_files(s, manifest)
    _check_formats(s, manifest)
    s.field(manifest, "", "target", "string")
    source = s.field(manifest, "", "source", "object")
    s.field(source, "source", "model_type", "string")
    recipe = s.field(manifest, "", "recipe", "object")
    s.field(recipe, "recipe", "name", "string")
    s.field(recipe, "recipe", "passes", "array")
    _check_passes(s, manifest)
    sizes = s.field(manifest, "", "sizes", "object")
    s.field(sizes, "sizes", "weight_bytes", "count")
    s.field(sizes, "sizes", "source_weight_bytes", "positive")
    for key, info in s.table(manifest, "", "tensors"):
        s.field(info, key, "dtype", "string")
        for i, dim in enumerate(s.field(info, key, "shape", "array")):
            s.check(dim, f"{key}.shape[{i}]", "count")
    _check_kv_cache(s, manifest)
    precision = manifest.get("precision")
    if precision:  # `optimize inspect` prints its table when present
        _check_precision(s, precision)
    budget = manifest.get("kv_budget")
    if budget:  # `optimize inspect` prints it when present (and computes it from the architecture when not)
        _check_kv_budget(s, budget)
    return manifest


def _check_files(s: _Shape, manifest: dict) -> None:
    files = s.field(manifest, "", "files", "object")
    for name, digest in files.items():
        check_file_name(name, s.where)
        if not (isinstance(digest, str) and _SHA256.fullmatch(digest)):
            s.fail(f"files[{json.dumps(name)}]", f"must be a sha256 (64 lowercase hex digits), got {_describe(digest)}")


def _check_formats(s: _Shape, manifest: dict) -> None:
    for key, entry in s.table(manifest, "", "formats"):
        s.field(entry, key, "format", "string")
        for name in ("activation", "role", "method", "tied_to"):
            s.field(entry, key, name, "string", required=False)
        s.field(entry, key, "in_features", "positive", required=False)
        rotation = s.field(entry, key, "input_rotation", "object", required=False)
        if rotation is not None:
            s.field(rotation, f"{key}.input_rotation", "kind", "string")
            s.field(rotation, f"{key}.input_rotation", "block_size", "positive")


def _check_passes(s: _Shape, manifest: dict) -> None:
    for i, record in enumerate(s.field(manifest, "", "passes", "array")):
        key = f"passes[{i}]"
        s.check(record, key, "object")
        s.field(record, key, "name", "string")
        s.field(record, key, "decision", "string")
        gate = s.field(record, key, "gate", "object|null")
        if gate is not None:
            for name in ("perplexity", "baseline_perplexity", "recovery", "kl", "top1", "floor"):
                s.field(gate, f"{key}.gate", name, "number")
            s.field(gate, f"{key}.gate", "pass_recovery", "number", required=False)
            for j, metric in enumerate(s.field(gate, f"{key}.gate", "metrics", "array", required=False) or []):
                where = f"{key}.gate.metrics[{j}]"
                s.check(metric, where, "object")
                s.field(metric, where, "name", "string")
                for name in ("value", "floor"):
                    s.field(metric, where, name, "number")


def _check_kv_cache(s: _Shape, manifest: dict) -> None:
    for key, entry in s.table(manifest, "", "kv_cache", required=False):
        s.field(entry, key, "format", "string")
        s.field(entry, key, "scaling", "string", required=False)
        s.field(entry, key, "note", "string", required=False)
        for i, stream in enumerate(s.field(entry, key, "streams", "array", required=False) or []):
            s.check(stream, f"{key}.streams[{i}]", "string")
        for name in ("scale_tensors", "offset_tensors"):
            for stream, tensor in (s.field(entry, key, name, "object", required=False) or {}).items():
                s.check(tensor, f"{key}.{name}[{json.dumps(stream)}]", "string")


def _check_precision(s: _Shape, precision: Any) -> None:
    s.check(precision, "precision", "object")
    s.field(precision, "precision", "pass", "string")
    s.field(precision, "precision", "effective_bits", "number")
    s.field(precision, "precision", "weight_bytes", "count")
    s.field(precision, "precision", "weights", "count")
    for key, entry in s.table(precision, "precision", "groups"):
        s.field(entry, key, "option", "string")
        s.field(entry, key, "kl", "number")
        s.field(entry, key, "reason", "string")
    list(s.table(precision, "precision", "linears", required=False))


def _check_kv_budget(s: _Shape, budget: Any) -> None:
    s.check(budget, "kv_budget", "object")
    s.field(budget, "kv_budget", "kv_bytes_per_token", "count")
    s.field(budget, "kv_budget", "source_kv_bytes_per_token", "positive")
    s.field(budget, "kv_budget", "weight_bytes", "count")
    s.field(budget, "kv_budget", "source_weight_bytes", "count")
    s.field(budget, "kv_budget", "activation_reserve_fraction", "number")
    for key, row in s.table(budget, "kv_budget", "layers"):
        s.field(row, key, "format", "string")
        s.field(row, key, "scaling", "string")
        s.field(row, key, "source_bytes_per_token", "count")
        s.field(row, key, "bytes_per_token", "count")
        for name, dims in s.field(row, key, "streams", "object").items():
            stream = f"{key}.streams[{json.dumps(name)}]"
            if not (isinstance(dims, list) and len(dims) == 2):
                s.fail(stream, f"must be [heads, dim], got {_describe(dims)}")
            for i, dim in enumerate(dims):
                s.check(dim, f"{stream}[{i}]", "count")
    for i, row in enumerate(s.field(budget, "kv_budget", "max_concurrent_sequences", "array")):
        key = f"kv_budget.max_concurrent_sequences[{i}]"
        s.check(row, key, "object")
        s.field(row, key, "device", "string")
        for name in ("context", "source", "artifact"):
            s.field(row, key, name, "count")


# --- files ------------------------------------------------------------------------------------------------
def verify_checksums(root: Path, manifest: dict) -> None:
    """Every listed file is a regular file (not a symlink) whose sha256 matches; model.safetensors is listed;
    nothing in the directory besides manifest.json is unlisted."""
    root = Path(root)
    where = clip(root)
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise KilnError(f"{where}: manifest has no checksum table ('files')")
    for name in REQUIRED_FILES:
        if name not in files:
            raise KilnError(f"{where}: manifest has no checksum for {name}; the runtime reads only checksummed files")
    try:
        present = sorted(p.name for p in root.iterdir())
    except OSError as exc:
        raise KilnError(f"cannot list artifact {where}: {clip(exc.strerror or exc, 60)}") from None
    unlisted = [n for n in present if n != MANIFEST and n not in files]
    if unlisted:
        raise KilnError(f"{where}: {clip(repr(unlisted[0]), 60)} is in the artifact but not in its manifest's "
                        f"checksum table ({len(unlisted)} such entr{'y' if len(unlisted) == 1 else 'ies'}); "
                        "the runtime reads only checksummed files")
    for name, expected in sorted(files.items()):
        path = _listed_path(root, name, where)
        actual = sha256_file(path)
        if actual != expected:
            raise KilnError(f"{where}: checksum mismatch for {clip(name, 60)} "
                            f"(expected {expected[:12]}…, got {actual[:12]}…)")


def _listed_path(root: Path, name: str, where: str) -> Path:
    check_file_name(name, f"{where}: ")
    path = root / name
    if path.is_symlink():
        raise KilnError(f"{where}: {clip(name, 60)} is a symlink; files inside an artifact must not be symlinks")
    if not path.exists():
        raise KilnError(f"{where}: file {clip(name, 60)} listed in the manifest is missing")
    if not path.is_file():
        raise KilnError(f"{where}: {clip(name, 60)} listed in the manifest is not a regular file")
    return path


def artifact_file(root: Path | str, manifest: dict, name: str) -> Path:
    """The path of artifact file `name`, refused unless the manifest's checksum table lists it (and it is a
    plain name, present, a regular file, not a symlink). `manifest` must come from `read_manifest(root)`
    with verify=True, which checked every listed file's sha256."""
    root = Path(root)
    where = clip(root)
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or name not in files:
        raise KilnError(f"{where}: {clip(name, 60)} is not in the manifest's checksum table; "
                        "the runtime reads only checksummed files")
    return _listed_path(root, name, where)


def has_tokenizer(manifest: dict) -> bool:
    """Whether the artifact ships a tokenizer (tokenizer.json or tokenizer_config.json, checksummed)."""
    files = manifest.get("files") or {}
    return "tokenizer.json" in files or "tokenizer_config.json" in files
