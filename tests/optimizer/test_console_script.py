"""The installed `optimize` console script, run as a user runs it: exit codes CI can trust.

0 pass, 1 below a floor, 2 usage or input error (one line, no traceback), 130 interrupted (SIGINT) with
nothing written and no temporary directory left behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kiln.optimizer.defaults import SAMPLE_TEXT
from tests.conftest import EVAL_TEXT, ROOT, STORIES, needs_stories

OPTIMIZE = shutil.which("optimize") or str(Path(sys.executable).parent / "optimize")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def run(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([OPTIMIZE, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=ENV,
                          cwd=ROOT, check=False)


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


@pytest.mark.parametrize("args, message", [
    (("build", "--no-such-flag"), "No such option: --no-such-flag"),
    (("eval",), "Missing argument"),
    (("eval", "art", "--data", "x", "--paragraphs", "abc"), "Invalid value for '--paragraphs'"),
    (("frobnicate",), "No such command 'frobnicate'"),
    ((), "no command given"),
    (("gate", "art", "--baseline", "b", "--data", "d", "--min-recovery", "-1"), "--min-recovery must be in"),
])
def test_usage_errors_are_one_line_and_exit_2(args, message):
    proc = run(*args)
    assert proc.returncode == 2
    line = one_line(proc.stderr)
    assert line.startswith("error: ") and message in line


def test_help_is_fast_and_exits_0():
    start = time.perf_counter()
    proc = run("--help")
    assert proc.returncode == 0 and "build" in proc.stdout
    assert time.perf_counter() - start < 10  # generous for a busy CI machine; ~0.4 s when idle


def _interrupt(proc: subprocess.Popen, ready, deadline: float = 120) -> tuple[int, str]:
    start = time.monotonic()
    while not ready():
        if proc.poll() is not None or time.monotonic() - start > deadline:
            proc.kill()
            pytest.fail(f"never reached the interruption point: {proc.communicate()[1]}")
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    return proc.returncode, stderr


def test_sigint_during_build_exits_130_and_leaves_nothing(generated_checkpoint, tmp_path):
    marker = tmp_path / "stalled"
    recipe = tmp_path / "stall.yaml"
    recipe.write_text(f"passes:\n  - pass: tests.passes.destructive:Stall\n    marker: {marker}\n")
    outdir = tmp_path / "outs"
    outdir.mkdir()
    proc = subprocess.Popen([OPTIMIZE, "build", str(generated_checkpoint), "--recipe", str(recipe),
                             "--allow-custom-passes", "-o", str(outdir / "art"), "--eval-data", str(SAMPLE_TEXT),
                             "--force"],  # a model of random weights reads no text
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    code, stderr = _interrupt(proc, marker.exists)
    assert code == 130
    assert stderr.strip().splitlines()[-1].startswith("interrupted") and "Traceback" not in stderr
    assert list(outdir.iterdir()) == []  # no artifact, no .art.tmp-* directory


@needs_stories
def test_sigint_during_gate_exits_130(tmp_path):
    art = tmp_path / "art"
    assert run("build", STORIES, "--recipe", "none", "-o", art, "--no-gate").returncode == 0
    proc = subprocess.Popen([OPTIMIZE, "gate", str(art), "--baseline", str(STORIES), "--data", str(EVAL_TEXT),
                             "--min-recovery", "0.9"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ENV, cwd=ROOT)
    seen = []

    def scoring() -> bool:  # the gate logs "scoring N paragraphs" just before the long part
        line = proc.stderr.readline()
        seen.append(line)
        return "scoring" in line or line == ""

    code, stderr = _interrupt(proc, scoring)
    assert code == 130, "".join(seen) + stderr
    assert stderr.strip().splitlines()[-1].startswith("interrupted") and "Traceback" not in stderr
