"""Kiln overwrites only what Kiln wrote, refuses outputs that overlap its inputs, and checks that it can write
before any work starts."""

from __future__ import annotations

import json
import os
import stat

import pytest

from kiln.kernels.errors import KilnError
from kiln.optimizer.output_dir import EXPORT_MARKER, atomic_directory, check_output


def kiln_artifact(path):
    path.mkdir(parents=True)
    (path / "manifest.json").write_text(json.dumps({"schema_version": 1, "kiln_version": "0.1.0"}))
    (path / "model.safetensors").write_bytes(b"old")
    return path


@pytest.mark.parametrize("make, overwrite, message", [
    (lambda p: (p.mkdir(), (p / "notes.txt").write_text("mine")), True, "holds files Kiln did not write"),
    (lambda p: p.write_text("mine"), True, "is a file, not a Kiln artifact"),
    (kiln_artifact, False, "already exists; pass --overwrite"),
    # a manifest Kiln did not write (no kiln_version) is not Kiln's to replace
    (lambda p: (p.mkdir(), (p / "manifest.json").write_text("{}")), True, "holds files Kiln did not write"),
])
def test_refuses_to_replace_what_kiln_did_not_write(tmp_path, make, overwrite, message):
    out = tmp_path / "out"
    make(out)
    before = sorted(p.name for p in out.iterdir()) if out.is_dir() else out.read_text()
    with pytest.raises(KilnError, match=message), atomic_directory(out, overwrite) as tmp:
        (tmp / "x").write_text("new")
    assert (sorted(p.name for p in out.iterdir()) if out.is_dir() else out.read_text()) == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary directory left


@pytest.mark.parametrize("marker", ["manifest.json", EXPORT_MARKER])
def test_overwrite_replaces_a_kiln_output_whole(tmp_path, marker):
    out = kiln_artifact(tmp_path / "out") if marker == "manifest.json" else tmp_path / "out"
    if marker == EXPORT_MARKER:
        out.mkdir()
        (out / EXPORT_MARKER).write_text("{}")
    with atomic_directory(out, overwrite=True) as tmp:
        (tmp / "new.bin").write_text("new")
    assert [p.name for p in out.iterdir()] == ["new.bin"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_an_empty_directory_is_used_without_overwrite(tmp_path):
    (tmp_path / "out").mkdir()
    with atomic_directory(tmp_path / "out") as tmp:
        (tmp / "a").write_text("a")
    assert (tmp_path / "out" / "a").read_text() == "a"


def test_an_interrupted_write_leaves_the_old_output_and_no_temporary(tmp_path):
    out = kiln_artifact(tmp_path / "out")
    with pytest.raises(KeyboardInterrupt), atomic_directory(out, overwrite=True) as tmp:
        (tmp / "half").write_text("half")
        raise KeyboardInterrupt
    assert (out / "model.safetensors").read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_outputs_overlapping_an_input_or_the_cwd_are_refused(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    for out, relation in ((ckpt, "is the input"), (ckpt / "art", "is inside the input"),
                          (tmp_path, "contains the input")):
        with pytest.raises(KilnError, match=relation):
            check_output(out, True, [ckpt])
    monkeypatch.chdir(ckpt)
    for out in (".", "..", str(ckpt)):
        with pytest.raises(KilnError, match="the current directory"):
            check_output(out, True)


def test_unwritable_outputs_are_refused_before_any_work(tmp_path):
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(KilnError, match="is a file, not a directory"):
        check_output(tmp_path / "a_file" / "out", False)
    with pytest.raises(KilnError, match="cannot write output /proc/x"):
        check_output("/proc/x", False)
    check_output(tmp_path / "new" / "deeper" / "out", False)  # creatable: fine, and nothing created yet
    assert not (tmp_path / "new").exists()


def test_outputs_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        with atomic_directory(tmp_path / "out") as tmp:
            (tmp / "w").write_bytes(b"w")
            os.chmod(tmp / "w", 0o600)  # as some writers (mkstemp) leave their files
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o755
    assert stat.S_IMODE((tmp_path / "out" / "w").stat().st_mode) == 0o644
