"""The engine artifact contract: what `optimizer.lower` writes and the runtime reads.

An artifact is a directory:
    manifest.json       schema version, Kiln version, source + its weight hashes, target, recipe, every pass's
                        config/result/gate, the per-module format table, sizes, sha256 of every other file
    model.safetensors   packed weights and scales (ModelOpt unified tensor names)
    config.json, tokenizer files, report.md
It is written into a temporary sibling directory and renamed into place, so it either exists whole or not
at all. Reading checks the schema version and every checksum before anything is used.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from kernels.errors import KilnError

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
WEIGHTS = "model.safetensors"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def read_json(path: Path) -> Any:
    """A JSON file's content; a file that is not valid JSON is a one-line KilnError."""
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise KilnError(f"{path} is not valid JSON: {exc}") from None


def read_manifest(path: Path | str, verify: bool = True) -> dict:
    """The artifact's manifest, after checking the schema version and (by default) every file's sha256."""
    root = Path(path)
    if not root.is_dir():
        raise KilnError(f"artifact {root} does not exist or is not a directory")
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        raise KilnError(f"{root} is not a Kiln artifact: no {MANIFEST}")
    manifest = read_json(manifest_path)
    version = manifest.get("schema_version")
    if version != SCHEMA_VERSION:
        raise KilnError(f"{root}: artifact schema version {version!r}, this runtime reads version {SCHEMA_VERSION}")
    if verify:
        verify_checksums(root, manifest)
    return manifest


def verify_checksums(root: Path, manifest: dict) -> None:
    files = manifest.get("files")
    if not isinstance(files, dict) or WEIGHTS not in files:
        raise KilnError(f"{root}: manifest has no checksum table for {WEIGHTS}")
    for name, expected in sorted(files.items()):
        path = root / name
        if not path.is_file():
            raise KilnError(f"{root}: file {name} listed in the manifest is missing")
        actual = sha256_file(path)
        if actual != expected:
            raise KilnError(f"{root}: checksum mismatch for {name} (expected {expected[:12]}…, got {actual[:12]}…)")
