"""Where Kiln writes: checked before any work starts, filled in a temporary sibling, renamed into place.

Kiln replaces only what Kiln wrote. `--overwrite` replaces an existing directory only when it is a Kiln
artifact (a manifest.json with Kiln's schema and version) or a Kiln export (its `kiln_export.json`), or
when it is empty. It never replaces a file, the current directory, or a directory holding, inside or equal
to one of the command's inputs. The output's parent must be writable, which is probed before the build
rather than discovered after it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from kiln.kernels.errors import KilnError

EXPORT_MARKER = "kiln_export.json"
"""Written into every export so that a later --overwrite recognises the directory as Kiln's."""


def is_kiln_output(path: Path) -> bool:
    """A directory Kiln wrote: an artifact (manifest.json with schema_version and kiln_version) or an export."""
    if (path / EXPORT_MARKER).is_file():
        return True
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and "schema_version" in manifest and "kiln_version" in manifest


def mark_export(directory: Path, artifact: Path | str, fmt: str) -> None:
    """Write the export marker: provenance for the reader, ownership for a later --overwrite."""
    from kiln.optimizer import __version__

    record = {"kiln_version": __version__, "format": fmt, "artifact": str(artifact)}
    manifest = Path(artifact) / "manifest.json"
    if manifest.is_file():
        import hashlib

        record["artifact_manifest_sha256"] = hashlib.sha256(manifest.read_bytes()).hexdigest()
    (directory / EXPORT_MARKER).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def _relation(output: Path, other: Path) -> str | None:
    if output == other:
        return "is"
    if other in output.parents:
        return "is inside"
    if output in other.parents:
        return "contains"
    return None


def check_output(output: Path | str, overwrite: bool, inputs: Iterable[Path | str | None] = ()) -> Path:
    """The resolved output path, after refusing every output Kiln may not write (one-line KilnError)."""
    given = Path(output).expanduser()
    out = given.resolve()
    cwd = Path.cwd().resolve()
    if _relation(out, cwd) in ("is", "contains"):
        raise KilnError(f"output {given} {_relation(out, cwd)} the current directory; name a new directory, "
                        "e.g. -o artifacts/NAME")
    for item in inputs:
        if item is None or not Path(item).expanduser().exists():
            continue
        source = Path(item).expanduser().resolve()
        relation = _relation(out, source)
        if relation:
            raise KilnError(f"output {given} {relation} the input {item}; write the output somewhere else")
    if out.exists():
        if not out.is_dir():
            raise KilnError(f"output {given} exists and is a file, not a Kiln artifact; refusing to replace it")
        if any(out.iterdir()):
            if not is_kiln_output(out):
                raise KilnError(f"output {given} holds files Kiln did not write (no Kiln manifest); refusing to "
                                "replace it, even with --overwrite")
            if not overwrite:
                raise KilnError(f"output {given} already exists; pass --overwrite to replace it")
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise KilnError(f"cannot write output {given}: {parent} is a file, not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".kiln-probe-", dir=parent))
    except OSError as exc:
        raise KilnError(f"cannot write output {given}: {exc.strerror or exc} in {parent}") from None
    return out


def follow_umask(root: Path) -> None:
    # mkdtemp creates 0700: give the result the permissions any other tool's output would have
    mask = os.umask(0)
    os.umask(mask)
    for path in (root, *root.rglob("*")):
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)


@contextlib.contextmanager
def atomic_directory(output: Path | str, overwrite: bool = False,
                     inputs: Iterable[Path | str | None] = ()) -> Iterator[Path]:
    """Yield a temporary sibling of `output` to fill; on success rename it into place (replacing a Kiln
    output when `overwrite`), on any error or interrupt remove it. So a directory is either whole or absent."""
    out = check_output(output, overwrite, inputs)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        follow_umask(tmp)
        if out.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, trash / out.name)
            try:
                os.replace(tmp, out)
            except BaseException:
                os.replace(trash / out.name, out)  # put the old output back
                raise
            finally:
                shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
