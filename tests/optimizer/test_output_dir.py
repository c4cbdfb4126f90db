"""Kiln overwrites only what Kiln wrote, refuses outputs that overlap its inputs, checks that it can write before
any work starts, writes files and folders atomically, and cleans up after a build killed with SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap

import pytest

from kiln.kernels.errors import KilnError
from kiln.optimizer.output_dir import (
    EXPORT_MARKER,
    OWNER_MARKER,
    atomic_directory,
    atomic_file,
    check_output,
    check_output_file,
    mark_export,
    remove_stale_temporaries,
)


def kiln_artifact(path):
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"old")
    (path / "manifest.json").write_text(json.dumps({"schema_version": 1, "kiln_version": "0.1.0",
                                                    "files": {"model.safetensors": "0" * 64}}))
    return path


@pytest.mark.parametrize("make, overwrite, message", [
    (lambda p: (p.mkdir(), (p / "notes.txt").write_text("mine")), True, "holds files Kiln did not write"),
    (lambda p: p.write_text("mine"), True, "is a file, not a Kiln artifact"),
    (kiln_artifact, False, "already exists; pass --overwrite"),
    # a manifest Kiln did not write (no kiln_version) is not Kiln's to replace
    (lambda p: (p.mkdir(), (p / "manifest.json").write_text("{}")), True, "holds files Kiln did not write"),
    # a Kiln artifact the user added a file or a folder to: Kiln's table does not list them
    (lambda p: (kiln_artifact(p), (p / "notes.txt").write_text("mine")), True, r"also holds 1 entry .*\(notes.txt\)"),
    (lambda p: (kiln_artifact(p), (p / "mine").mkdir(), (p / "mine" / "a").write_text("a")), True,
     r"also holds 2 entries .*\(mine\)"),
])
def test_refuses_to_replace_what_kiln_did_not_write(tmp_path, make, overwrite, message):
    out = tmp_path / "out"
    make(out)
    before = sorted(p.name for p in out.rglob("*")) if out.is_dir() else out.read_text()
    with pytest.raises(KilnError, match=message), atomic_directory(out, overwrite) as tmp:
        (tmp / "x").write_text("new")
    assert (sorted(p.name for p in out.rglob("*")) if out.is_dir() else out.read_text()) == before
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


def test_an_export_records_its_files_and_refuses_what_the_user_added(tmp_path):
    artifact = kiln_artifact(tmp_path / "art")
    out = tmp_path / "export"
    with atomic_directory(out) as tmp:
        mark_export(tmp, artifact, "compressed-tensors")
        (tmp / "model.safetensors").write_bytes(b"12345")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "part.bin").write_bytes(b"1")
    record = json.loads((out / EXPORT_MARKER).read_text())
    assert record["files"] == {"model.safetensors": 5, "sub/part.bin": 1}
    check_output(out, True)  # only what Kiln wrote: replaceable
    (out / "README.md").write_text("my notes on this export")
    with pytest.raises(KilnError, match=r"also holds 1 entry Kiln did not write \(README.md\)"):
        check_output(out, True)
    assert (out / "README.md").read_text() == "my notes on this export"


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
        atomic_file(tmp_path / "f.xml", "x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o755
    assert stat.S_IMODE((tmp_path / "out" / "w").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "f.xml").stat().st_mode) == 0o644


# --- single files: gate --junit and the like --------------------------------------------------------------
def kiln_wrote(path):
    return path.read_text().startswith("KILN")


@pytest.mark.parametrize("where, message", [
    (lambda t: t / "missing" / "gate.xml", "directory .*missing does not exist"),
    (lambda t: t, "is a directory"),
    (lambda t: t / "data.txt", "is the input"),
    (lambda t: t / "ckpt" / "gate.xml", "is inside the input"),
    (lambda t: t / "mine.xml", "exists and Kiln did not write it"),
    (lambda t: "/proc/x", "cannot write --junit /proc/x"),
    (lambda t: "/proc/self/status", "Kiln did not write it|not a regular file"),
    (lambda t: "/dev/null", "not a regular file"),
])
def test_a_file_output_is_refused_in_one_line(tmp_path, where, message):
    (tmp_path / "data.txt").write_text("the evaluation text")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "mine.xml").write_text("my own xml")
    before = sorted((p.name, p.read_bytes() if p.is_file() else b"") for p in tmp_path.rglob("*"))
    with pytest.raises(KilnError, match=message) as error:
        atomic_file(where(tmp_path), "KILN new", [tmp_path / "data.txt", tmp_path / "ckpt"], kiln_wrote, "--junit")
    assert "\n" not in str(error.value)
    assert sorted((p.name, p.read_bytes() if p.is_file() else b"") for p in tmp_path.rglob("*")) == before


def test_a_file_output_replaces_only_kilns_own_file_atomically(tmp_path):
    out = tmp_path / "gate.xml"
    atomic_file(out, "KILN one", kiln_wrote=kiln_wrote)
    atomic_file(out, "KILN two", kiln_wrote=kiln_wrote)  # Kiln's own earlier file: replaced
    assert out.read_text() == "KILN two"
    assert [p.name for p in tmp_path.iterdir()] == ["gate.xml"]  # no temporary left
    (tmp_path / "link.xml").symlink_to(out)
    with pytest.raises(KilnError, match="symbolic link"):
        check_output_file(tmp_path / "link.xml", kiln_wrote=kiln_wrote)


def test_the_junit_check_recognises_only_kilns_report(tmp_path):
    from kiln.optimizer.measure.gate import Check
    from kiln.optimizer.report.gate_report import is_kiln_junit, junit_xml

    ours, theirs = tmp_path / "ours.xml", tmp_path / "theirs.xml"
    ours.write_text(junit_xml([Check("recovery", 0.99, 0.9)], "gate art", 1.0))
    theirs.write_text('<?xml version="1.0"?>\n<testsuites name="pytest"></testsuites>\n')
    assert is_kiln_junit(ours) and not is_kiln_junit(theirs)


# --- the CLI: refused before any work, in one line, nothing of the user's lost ------------------------------
def test_gate_junit_is_checked_before_the_gate_runs(cli, tmp_path):
    data = tmp_path / "eval.txt"
    data.write_text("Once upon a time.\n")
    missing_artifact = tmp_path / "no-artifact"  # the gate would fail on it: the --junit check comes first
    common = ("gate", missing_artifact, "--baseline", tmp_path / "no-ckpt", "--data", data, "--min-recovery", "0.9")
    for junit, message in ((tmp_path / "nodir" / "g.xml", "does not exist"), (tmp_path, "is a directory"),
                           (data, "is the input"), ("/proc/x", "cannot write --junit /proc/x")):
        code, _, stderr = cli(*common, "--junit", junit)
        assert code == 2 and "--junit" in stderr and message in stderr, stderr
        assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr
    assert data.read_text() == "Once upon a time.\n"


LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
                "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "vocab_size": 1000, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def test_report_output_follows_the_policy(cli, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    args = ("report", tmp_path, "--gpu", "h100", "--weights", "fp8", "-o")
    user = tmp_path / "mine"
    user.mkdir()
    (user / "report.md").write_text("my own report")
    for out, message in ((user, "holds files Kiln did not write"), ("/proc/x", "cannot write output /proc/x"),
                         (tmp_path / "config.json", "is not a directory")):
        code, _, stderr = cli(*args, out)
        assert code == 2 and message in stderr, stderr
        assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr
    assert (user / "report.md").read_text() == "my own report"
    out = tmp_path / "econ"
    for _ in range(2):  # Kiln's own earlier report is replaced
        code, _, stderr = cli(*args, out)
        assert code == 0, stderr
    assert sorted(p.name for p in out.iterdir()) == ["economics_waterfall.png", "kiln_report.json", "report.md"]
    (out / "notes.txt").write_text("mine")
    code, _, stderr = cli(*args, out)
    assert code == 2 and "also holds 1 entry" in stderr and (out / "notes.txt").read_text() == "mine"


def test_build_overwrite_keeps_a_file_the_user_added(cli, plain_artifact, generated_checkpoint, tmp_path):
    import shutil

    out = tmp_path / "art"
    shutil.copytree(plain_artifact, out)
    (out / "notes.md").write_text("my notes")
    code, _, stderr = cli("build", generated_checkpoint, "--recipe", "none", "--no-gate", "-o", out, "--overwrite")
    assert code == 2 and "notes.md" in stderr and "even with --overwrite" in stderr, stderr
    assert (out / "notes.md").read_text() == "my notes"
    (out / "notes.md").unlink()
    code, _, stderr = cli("build", generated_checkpoint, "--recipe", "none", "--no-gate", "-o", out, "--overwrite")
    assert code == 0, stderr


# --- a build killed with SIGKILL ----------------------------------------------------------------------------
def dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def stale(tmp_path, name, pid, marker=True):
    path = tmp_path / name
    (path / "out").mkdir(parents=True)
    (path / "out" / "model.safetensors").write_bytes(b"half")
    if marker:
        from kiln.optimizer.output_dir import _owner

        (path / OWNER_MARKER).write_text(json.dumps({**_owner(), "pid": pid, "start_time": None}))
    return path


def test_a_killed_write_leaves_nothing_at_the_output_and_the_rerun_cleans_up(tmp_path):
    out = tmp_path / "out"
    script = textwrap.dedent(f"""
        import sys, time
        from kiln.optimizer.output_dir import atomic_directory
        with atomic_directory({str(out)!r}) as d:
            (d / "model.safetensors").write_bytes(b"half")
            print("ready", flush=True)
            time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    left = list(tmp_path.glob(".out.tmp-*"))
    assert not out.exists() and len(left) == 1 and (left[0] / OWNER_MARKER).is_file()
    with atomic_directory(out) as d:  # the rerun needs no --overwrite
        (d / "model.safetensors").write_bytes(b"whole")
    assert (out / "model.safetensors").read_bytes() == b"whole"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_only_kilns_stale_temporaries_are_removed(tmp_path):
    dead = stale(tmp_path, ".out.tmp-dead", dead_pid())
    trash = stale(tmp_path, ".out.old-dead", dead_pid())  # killed mid-replace: the old output, moved aside
    alive = stale(tmp_path, ".out.tmp-alive", os.getpid())  # a build still writing
    unmarked = stale(tmp_path, ".out.tmp-user", dead_pid(), marker=False)  # not Kiln's (no marker)
    other = stale(tmp_path, ".other.tmp-dead", dead_pid())  # another output's
    assert sorted(remove_stale_temporaries(tmp_path / "out")) == sorted([dead, trash])
    assert alive.is_dir() and unmarked.is_dir() and other.is_dir() and not dead.exists() and not trash.exists()


def test_a_kill_between_the_renames_of_an_overwrite_puts_the_previous_output_back(tmp_path):
    """Killed after the old output moved aside and before the new one moved in: the old one is restored."""
    trash = stale(tmp_path, ".out.old-dead", dead_pid())
    (trash / "out" / "model.safetensors").write_bytes(b"the user's previous artifact")
    unfinished = stale(tmp_path, ".out.tmp-dead", dead_pid())
    remove_stale_temporaries(tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == b"the user's previous artifact"
    assert not trash.exists() and not unfinished.exists()


def test_a_temporary_from_another_pid_namespace_is_kept(tmp_path):
    """A build in a container sharing this folder: its pid names nothing here, so it may be alive."""
    other = stale(tmp_path, ".out.tmp-container", dead_pid())
    record = json.loads((other / OWNER_MARKER).read_text())
    (other / OWNER_MARKER).write_text(json.dumps({**record, "pid_ns": "pid:[1]"}))
    old_style = stale(tmp_path, ".out.tmp-oldstyle", dead_pid())  # a marker that names no namespace
    (old_style / OWNER_MARKER).write_text(json.dumps({"pid": dead_pid(), "host": record["host"]}))
    assert remove_stale_temporaries(tmp_path / "out") == []
    assert other.is_dir() and old_style.is_dir()


def test_glob_characters_in_the_output_name_match_only_its_own_temporaries(tmp_path):
    own = stale(tmp_path, ".m[1].tmp-dead", dead_pid())
    other = stale(tmp_path, ".m1.tmp-dead", dead_pid())
    assert remove_stale_temporaries(tmp_path / "m[1]") == [own]
    assert other.is_dir()


def test_an_export_marker_without_a_file_table_still_owns_its_folder(tmp_path):
    """An export from before the table: --overwrite replaces it, as it did then."""
    old = tmp_path / "old-export"
    old.mkdir()
    (old / EXPORT_MARKER).write_text(json.dumps({"kiln_version": "0.1.0", "format": "compressed-tensors"}))
    (old / "model.safetensors").write_bytes(b"x")
    (old / "config.json").write_text("{}")
    assert check_output(old, True) == old.resolve()


def test_check_output_cleans_stale_temporaries_before_the_build(tmp_path):
    dead = stale(tmp_path, ".out.tmp-dead", dead_pid())
    check_output(tmp_path / "out", False)
    assert not dead.exists()


def test_an_output_that_cannot_be_moved_aside_is_one_line_and_stays(tmp_path, monkeypatch):
    """--overwrite onto a mount point (rename fails with EBUSY): a KilnError, the old output untouched, no
    temporaries left."""
    import errno

    from kiln.optimizer import output_dir

    out = tmp_path / "mounted"
    out.mkdir()
    real_replace = os.replace

    def busy(src, dst):
        if os.fspath(src) == os.fspath(out.resolve()):
            raise OSError(errno.EBUSY, "Device or resource busy")
        return real_replace(src, dst)

    monkeypatch.setattr(output_dir.os, "replace", busy)
    with (pytest.raises(KilnError, match="cannot replace output .*Device or resource busy"),
          atomic_directory(out, overwrite=True) as payload):
        (payload / "report.md").write_text("new")
    assert out.is_dir() and not any(out.iterdir())
    assert [p.name for p in tmp_path.iterdir()] == ["mounted"]


def test_a_killed_file_write_is_cleaned_by_the_next_write(tmp_path):
    """A single file (gate --junit, report -o) is written in an owner-marked temporary folder too: a process
    killed mid-write leaves one the next write removes; a live writer's is left alone."""
    dead = stale(tmp_path, ".gate.xml.tmp-dead", dead_pid())
    (dead / "gate.xml").write_text("KILN half")
    alive = stale(tmp_path, ".gate.xml.tmp-alive", os.getpid())
    atomic_file(tmp_path / "gate.xml", "KILN whole", kiln_wrote=kiln_wrote)
    assert (tmp_path / "gate.xml").read_text() == "KILN whole"
    assert not dead.exists() and alive.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".gate.xml.tmp-alive", "gate.xml"]
