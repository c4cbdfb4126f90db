"""Where Kiln writes: checked before any work starts, filled in a temporary sibling, renamed into place.

One policy for every file and folder Kiln writes (build's and export's -o, report -o, gate --junit):

- checked before any work starts (check_output for a folder, check_output_file for a file), in one line;
- never an input, inside an input (a file written into an artifact breaks its checksums), or the current
  directory;
- written atomically: a folder is filled in a `.NAME.tmp-*` sibling and renamed into place, a file is written
  inside a `.NAME.tmp-*` sibling folder and renamed (os.replace), so a reader sees the old output or the whole
  new one;
- replaces only what Kiln itself wrote there. A folder is Kiln's when its own table says it holds nothing else:
  an artifact's manifest.json (Kiln's schema and version) lists its files, an export's `kiln_export.json` and a
  report's `kiln_report.json` list theirs (atomic_directory records them). A folder holding anything else, or a
  file Kiln did not write, is refused, even with --overwrite. An artifact or export needs --overwrite to be
  replaced; a report (report -o, gate --junit) is a view regenerated from its inputs and replaces Kiln's own
  earlier one without it.

A killed process (SIGKILL, a crash) leaves at most a `.NAME.tmp-*` (or, mid-replace, `.NAME.old-*`) sibling,
never anything at NAME that looks finished. Each carries OWNER_MARKER (pid, process start time, boot id); the
next write to NAME removes those whose process is gone (remove_stale_temporaries), and nothing else.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from kiln.kernels.errors import KilnError
from kiln.optimizer import __version__

EXPORT_MARKER = "kiln_export.json"
"""Written into every export so that a later --overwrite recognises the directory as Kiln's."""
REPORT_MARKER = "kiln_report.json"
"""Written into every `report -o` directory: what Kiln wrote there, so a later report may replace it."""
MARKERS = (EXPORT_MARKER, REPORT_MARKER)
OWNER_MARKER = ".kiln-tmp-owner.json"
"""Inside each temporary directory while it is filled: the writing process, so a later run can tell a stale
temporary (its process is gone) from one a running build is still filling."""


def _table_files(path: Path) -> set[str] | None:
    """The names Kiln's own table says it wrote into `path` (the table's file included); None when `path` holds no
    table Kiln wrote: no Kiln manifest (schema_version and kiln_version) and no export or report marker."""
    for marker in MARKERS:
        if (path / marker).is_file():
            try:
                record = json.loads((path / marker).read_text())
            except (OSError, ValueError):
                record = {}
            files = record.get("files") if isinstance(record, dict) else None
            if not isinstance(files, dict):
                # a marker from before the table (older Kiln): the marker alone made the folder Kiln's then
                return {marker, *_entries(path)}
            return {marker, *files}
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    if not (isinstance(manifest, dict) and "schema_version" in manifest and "kiln_version" in manifest):
        return None
    files = manifest.get("files")
    return {"manifest.json", *(files if isinstance(files, dict) else ())}


def _entries(path: Path) -> list[str]:
    """Every entry under `path`, relative (posix), folders included, so a user's subfolder counts."""
    return sorted(p.relative_to(path).as_posix() for p in path.rglob("*"))


def foreign_entries(path: Path) -> list[str] | None:
    """What in the directory `path` Kiln did not write: entries outside its own table. None when no Kiln table is
    there at all."""
    table = _table_files(path)
    if table is None:
        return None
    # a table's file in a subfolder (an export's sub/x.bin) makes that subfolder Kiln's too
    folders = {parent.as_posix() for name in table for parent in Path(name).parents if parent != Path(".")}
    return [name for name in _entries(path) if name not in table and name not in folders]


def is_kiln_output(path: Path) -> bool:
    """A directory Kiln wrote and nobody added to: an artifact, an export or a report holding only its table."""
    return foreign_entries(path) == []


def mark_export(directory: Path, artifact: Path | str, fmt: str) -> None:
    """Write the export marker: provenance for the reader, ownership for a later --overwrite (atomic_directory
    adds the table of files once the export is complete)."""
    record = {"kiln_version": __version__, "format": fmt, "artifact": str(artifact)}
    manifest = Path(artifact) / "manifest.json"
    if manifest.is_file():
        record["artifact_manifest_sha256"] = hashlib.sha256(manifest.read_bytes()).hexdigest()
    (directory / EXPORT_MARKER).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def _record_files(directory: Path) -> None:
    """Add to the directory's marker (export or report) the table of every file beside it, name -> bytes: what a
    later --overwrite may replace. An artifact's manifest carries its own table (with checksums)."""
    for marker in MARKERS:
        path = directory / marker
        if path.is_file():
            record = json.loads(path.read_text())
            record["files"] = {p.relative_to(directory).as_posix(): p.stat().st_size
                               for p in sorted(directory.rglob("*")) if p.is_file() and p != path}
            path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def _relation(output: Path, other: Path) -> str | None:
    if output == other:
        return "is"
    if other in output.parents:
        return "is inside"
    if output in other.parents:
        return "contains"
    return None


# --- stale temporaries of a killed process ---------------------------------------------------------------------
def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux /proc), which tells a reused pid from its owner."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _machine_id() -> str | None:
    try:
        return Path("/etc/machine-id").read_text().strip() or None
    except OSError:
        return None


def _pid_namespace() -> str | None:
    """The pid namespace this process sees pids in: a pid from another (a container on the same host) means
    nothing here."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _owner() -> dict:
    pid = os.getpid()
    return {"pid": pid, "start_time": _start_time(pid), "boot_id": _boot_id(), "host": socket.gethostname(),
            "machine_id": _machine_id(), "pid_ns": _pid_namespace()}


def write_owner_marker(directory: Path) -> None:
    (directory / OWNER_MARKER).write_text(json.dumps(_owner()) + "\n")


def _owner_is_gone(record: dict) -> bool:
    """Whether the process that wrote `record` is certainly gone. Unsure (another host, unreadable) is not gone."""
    pid = record.get("pid")
    if not isinstance(pid, int) or pid <= 0 or record.get("host") != socket.gethostname():
        return False
    same_machine = record.get("machine_id") is not None and record.get("machine_id") == _machine_id()
    if record.get("boot_id") and _boot_id() and record["boot_id"] != _boot_id():
        return same_machine  # this machine rebooted since: every process of that boot is gone
    if record.get("pid_ns") is None or record.get("pid_ns") != _pid_namespace():
        return False  # written from another pid namespace (a container sharing this folder): its pid is not ours
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # alive, another user's
    started = record.get("start_time")
    return started is not None and _start_time(pid) not in (None, started)  # the pid now names another process


def remove_temporary(path: Path) -> None:
    """Remove a temporary directory, its owner marker last: a kill part-way leaves a marked (so removable)
    remainder, never an unmarked one nothing would remove."""
    for entry in list(path.iterdir()) if path.is_dir() else ():
        if entry.name != OWNER_MARKER:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    entry.unlink()
    shutil.rmtree(path, ignore_errors=True)


def remove_stale_temporaries(output: Path) -> list[Path]:
    """Remove `.NAME.tmp-*` and `.NAME.old-*` beside `output` that carry Kiln's OWNER_MARKER and whose process is
    gone (a build killed with SIGKILL, a crash). A temporary without the marker, or one whose process is alive (a
    build still writing it) or unknown, is left alone. A process killed between the two renames of an
    --overwrite left the previous output only in `.NAME.old-*`: it is put back at `output` first. Returns what
    was removed."""
    output = Path(output)
    removed = []
    pattern = glob.escape(output.name)
    try:
        siblings = [*output.parent.glob(f".{pattern}.old-*"), *output.parent.glob(f".{pattern}.tmp-*")]
    except OSError:
        return removed
    for path in siblings:
        try:
            if path.is_symlink() or not path.is_dir():
                continue
            record = json.loads((path / OWNER_MARKER).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and _owner_is_gone(record):
            previous = path / output.name
            if path.name.startswith(f".{output.name}.old-") and previous.is_dir() and not os.path.lexists(output):
                try:
                    os.replace(previous, output)  # the output as it was before the killed --overwrite
                except OSError:
                    continue  # cannot put it back: keep it where it is
            remove_temporary(path)
            removed.append(path)
    return removed


# --- directories -----------------------------------------------------------------------------------------------
def _check_place(given: Path, out: Path, inputs: Iterable[Path | str | None], what: str = "output") -> None:
    """Not the current directory (nor above it), not an input, not inside one, not holding one."""
    cwd = Path.cwd().resolve()
    if _relation(out, cwd) in ("is", "contains"):
        raise KilnError(f"{what} {given} {_relation(out, cwd)} the current directory; name a new directory, e.g. "
                        "-o artifacts/NAME")
    for item in inputs:
        if item is None or not Path(item).expanduser().exists():
            continue
        source = Path(item).expanduser().resolve()
        relation = _relation(out, source)
        if relation:
            raise KilnError(f"{what} {given} {relation} the input {item}; write it somewhere else")


def _probe(given: Path, parent: Path, what: str = "output") -> None:
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".kiln-probe-", dir=parent))
    except OSError as exc:
        raise KilnError(f"cannot write {what} {given}: {exc.strerror or exc} in {parent}") from None


def check_output(output: Path | str, overwrite: bool, inputs: Iterable[Path | str | None] = ()) -> Path:
    """The resolved output directory, after refusing every output Kiln may not write (one-line KilnError).
    Removes the stale temporaries a killed earlier run left beside it (remove_stale_temporaries)."""
    given = Path(output).expanduser()
    out = given.resolve()
    _check_place(given, out, inputs)
    remove_stale_temporaries(out)
    if out.exists():
        if not out.is_dir():
            raise KilnError(f"output {given} exists and is a file, not a Kiln artifact; refusing to replace it")
        if any(out.iterdir()):
            foreign = foreign_entries(out)
            if foreign is None:
                raise KilnError(f"output {given} holds files Kiln did not write (no Kiln manifest or marker); "
                                "refusing to write there, even with --overwrite: name a new or empty directory")
            if foreign:
                raise KilnError(f"output {given} is Kiln's but also holds {len(foreign)} entr"
                                f"{'y' if len(foreign) == 1 else 'ies'} Kiln did not write ({foreign[0]}); refusing to "
                                "replace it, even with --overwrite: move them out first")
            if not overwrite:
                raise KilnError(f"output {given} already exists; pass --overwrite to replace it")
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise KilnError(f"cannot write output {given}: {parent} is a file, not a directory")
    _probe(given, parent)
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
    """Yield a directory to fill, inside a temporary sibling `.NAME.tmp-*` of `output`; on success rename it into
    place (replacing a Kiln output when `overwrite`), on any error or interrupt remove it. So a directory is
    either whole or absent. Beside the yielded directory, inside the temporary one, OWNER_MARKER names this
    process, so that a run after a SIGKILL can tell the temporary is stale; the yielded directory holds only what
    the caller writes. A marker (export, report) there gets the table of the files written beside it."""
    out = check_output(output, overwrite, inputs)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        write_owner_marker(tmp)
        payload = tmp / out.name
        payload.mkdir()
        yield payload
        _record_files(payload)
        follow_umask(payload)
        if out.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            write_owner_marker(trash)
            try:
                os.replace(out, trash / out.name)
            except OSError as exc:  # a mount point, a busy directory: the old output stays where it was
                remove_temporary(trash)
                raise KilnError(f"cannot replace output {output}: {exc.strerror or exc}; name a new directory, "
                                "or empty this one") from None
            try:
                os.replace(payload, out)
            except BaseException:
                os.replace(trash / out.name, out)  # put the old output back
                raise
            finally:
                remove_temporary(trash)
        else:
            os.replace(payload, out)
    finally:
        remove_temporary(tmp)  # on failure the half-written output, then the marker


# --- single files ----------------------------------------------------------------------------------------------
def check_output_file(output: Path | str, inputs: Iterable[Path | str | None] = (),
                      kiln_wrote: Callable[[Path], bool] = lambda path: False, what: str = "output") -> Path:
    """The output file's path, after refusing (one-line KilnError, before any work) a directory, a special file
    (/proc, a device, a FIFO), a symlink, an input or a file inside an input directory, a missing or unwritable
    parent directory, and an existing file that `kiln_wrote` does not recognise as Kiln's own earlier output."""
    given = Path(output).expanduser()
    out = given.parent.resolve() / given.name
    if given.is_symlink():
        raise KilnError(f"{what} {given} is a symbolic link; name a plain file")
    if out.is_dir():
        raise KilnError(f"{what} {given} is a directory; name a file")
    _check_place(given, out, inputs, what)
    if out.exists():
        if not stat.S_ISREG(out.stat().st_mode):
            raise KilnError(f"{what} {given} is not a regular file; name a plain file")
        if not kiln_wrote(out):
            raise KilnError(f"{what} {given} exists and Kiln did not write it; refusing to replace it")
    parent = out.parent
    if not parent.exists():
        raise KilnError(f"cannot write {what} {given}: directory {given.parent} does not exist")
    if not parent.is_dir():
        raise KilnError(f"cannot write {what} {given}: {given.parent} is not a directory")
    _probe(given, parent, what)
    if out.exists() and not os.access(out, os.W_OK):
        raise KilnError(f"cannot write {what} {given}: permission denied")
    return out


def atomic_file(output: Path | str, data: str | bytes, inputs: Iterable[Path | str | None] = (),
                kiln_wrote: Callable[[Path], bool] = lambda path: False, what: str = "output") -> Path:
    """Write `data` to `output` through a `.NAME.tmp-*` sibling folder (owner-marked, as a build's) and
    os.replace: a reader sees the old file or the new one, never half of it, and a process killed while
    writing leaves a temporary the next write removes (remove_stale_temporaries). Checked again
    (check_output_file), since time has passed since the first check."""
    out = check_output_file(output, inputs, kiln_wrote, what)
    remove_stale_temporaries(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        write_owner_marker(tmp)
        payload = tmp / out.name
        payload.write_bytes(data.encode() if isinstance(data, str) else data)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(payload, 0o666 & ~mask)  # what any other tool's output would get
        os.replace(payload, out)
    finally:
        remove_temporary(tmp)
    return out
