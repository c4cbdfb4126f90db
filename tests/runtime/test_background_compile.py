"""`optimize serve` compiles its decode step in the background by default on the CPU
(runtime.background_compile): the compile pauses while the scheduler has work, a failed compile leaves the
server eager, and a server that compiled answers greedy requests with the tokens it gave eagerly."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from kiln.kernels.errors import KilnError
from kiln.runtime.background_compile import BackgroundCompile
from kiln.runtime.serving_state import ServerConfig


def _python_work(progress: list[int], units: int) -> None:
    """A stand-in for tracing: many Python calls, each unit of them counted."""
    def unit() -> int:
        return sum(_leaf(j) for j in range(60))

    for i in range(units):
        unit()
        progress.append(i)


def _leaf(j: int) -> int:
    return j


def test_the_compile_pauses_while_the_scheduler_has_work_and_finishes_when_it_has_none():
    busy, progress, lines = threading.Event(), [], []
    busy.set()
    job = BackgroundCompile(lambda: _python_work(progress, 200), busy.is_set, lines.append)
    job.start()
    time.sleep(0.3)
    assert len(progress) <= 1 and not job.done.is_set()  # paused at its first look at the scheduler
    busy.clear()
    assert job.done.wait(10)
    assert len(progress) == 200 and job.failed is None and job.seconds is not None
    assert lines[0].startswith("kiln serve: compiling the decode step in the background")
    assert lines[-1].startswith("kiln serve: decode step compiled in")


def test_a_failed_compile_says_so_in_one_line_and_leaves_decoding_eager():
    lines = []

    def fails():
        raise RuntimeError("backend compiler failed\nwith a long story")

    job = BackgroundCompile(fails, lambda: False, lines.append)
    job.start()
    job._thread.join(10)
    assert not job.done.is_set() and job.failed == "RuntimeError: backend compiler failed with a long story"
    assert lines[-1] == ("kiln serve: compiling the decode step failed (RuntimeError: backend compiler failed "
                         "with a long story); decoding stays eager")


def test_a_stopped_compile_parks_and_never_swaps_in():
    progress = []
    job = BackgroundCompile(lambda: _python_work(progress, 10_000), lambda: False, lambda line: None)
    job.stop()
    job.start()
    time.sleep(0.3)
    assert len(progress) <= 1 and not job.done.is_set() and job._thread.is_alive()  # a daemon: gone at exit


def test_the_profile_hook_is_the_compile_threads_alone():
    seen = []
    job = BackgroundCompile(lambda: seen.append(threading.current_thread().name), lambda: False, lambda line: None)
    job.start()
    assert job.done.wait(10)
    assert seen == ["kiln-compile"] and sys.getprofile() is None


@pytest.mark.parametrize(("config", "mode"), [
    ({}, "background"), ({"device": "cuda"}, "off"), ({"compile_decode": "before"}, "before"),
    ({"compile_decode": "off"}, "off"), ({"compile_decode": "before", "device": "cuda"}, "before")])
def test_auto_compiles_in_the_background_on_the_cpu_only(config, mode):
    assert ServerConfig(**config).compile_mode == mode


def test_bad_compile_modes_are_refused_in_one_line():
    with pytest.raises(KilnError, match="--compile must be one of auto, background, before, off, got 'yes'"):
        ServerConfig(compile_decode="yes")
    with pytest.raises(KilnError, match="--compile background runs on the CPU only"):
        ServerConfig(compile_decode="background", device="cuda")
