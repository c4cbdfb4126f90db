"""Progress of long work, reported to whoever listens (the CLI draws rich bars; the Python API is silent).

    with progress.stage("calibrate", total=n_blocks, unit="blocks") as task:
        for block in blocks:
            ...
            task.advance()
    progress.timings()   -> [(stage, seconds, done, total, unit)] of every finished stage, in order

Work deep in the stack (a pass's block loop, the gate's scoring, tuning steps) opens a stage here, and the
front end installs a `Reporter` with `reporting(reporter)`; nothing is passed down the call chain. Stages
nest (a pass's calibration inside a build); the reporter is told the depth. With no reporter installed a
stage only keeps its timing. It imports nothing of Kiln's, and lives on the lowest floor that does long work
(calibration: GPTQ, tuning), below the passes and the optimizer that use it too.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class Task:
    name: str
    total: int | None
    unit: str
    depth: int
    start: float = field(default_factory=time.perf_counter)
    done: int = 0
    seconds: float | None = None  # set when the stage ends
    failed: bool = False  # it ended by an exception (an error's one line says what happened, not the stage)

    def advance(self, n: int = 1) -> None:
        self.done += n
        _reporter.update(self)

    @property
    def elapsed(self) -> float:
        return self.seconds if self.seconds is not None else time.perf_counter() - self.start


class Reporter:
    """What a front end implements; the default hears nothing."""

    def begin(self, task: Task) -> None:
        pass

    def update(self, task: Task) -> None:
        pass

    def end(self, task: Task) -> None:
        pass


_reporter: Reporter = Reporter()
_open: list[Task] = []
_finished: list[Task] = []


@contextlib.contextmanager
def stage(name: str, total: int | None = None, unit: str = "") -> Iterator[Task]:
    """A named step of the work; `total` (when known) lets the reporter show counts and an ETA."""
    task = Task(name, total, unit, depth=len(_open))
    _open.append(task)
    _reporter.begin(task)
    try:
        yield task
    except BaseException:
        task.failed = True
        raise
    finally:
        task.seconds = time.perf_counter() - task.start
        _open.remove(task)
        _finished.append(task)
        _reporter.end(task)


@contextlib.contextmanager
def reporting(reporter: Reporter) -> Iterator[Reporter]:
    """Send progress to `reporter` for the duration, and start a fresh timing record."""
    global _reporter
    previous, _reporter = _reporter, reporter
    _finished.clear()
    try:
        yield reporter
    finally:
        _reporter = previous


def timings(depth: int | None = 0) -> list[Task]:
    """The finished stages (of one nesting depth, None: all), in the order they finished."""
    return [t for t in _finished if depth is None or t.depth == depth]


def track(items, name: str, unit: str = ""):
    """Iterate `items` (a sized iterable) as one stage, advancing once per item."""
    items = list(items)
    with stage(name, total=len(items), unit=unit) as task:
        for item in items:
            yield item
            task.advance()
