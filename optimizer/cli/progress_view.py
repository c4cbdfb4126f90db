"""How the CLI shows `kiln.calibration.progress`: rich bars on a terminal, a line per stage otherwise, and a
per-stage timing table at the end.

    with progress.reporting(reporter_for(console)):
        ...                                   # every stage opened below shows up
    console.print(timing_table())

On a terminal every open stage is a bar with its counts, elapsed time and ETA (blocks, paragraphs, tuning
steps, probes). When stderr is not a terminal (CI logs, pipes) each stage prints one line when it ends, with
its elapsed time (stages under QUIET_BELOW seconds stay quiet), and a stage still running prints its count every `HEARTBEAT` seconds so a log never goes
quiet for long.
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from kiln.calibration import progress
from kiln.calibration.progress import Reporter, Task

HEARTBEAT = 30.0
"""Seconds between the count lines of a running stage when stderr is not a terminal."""
QUIET_BELOW = 1.0
"""Stages quicker than this print no line of their own (the timing table still lists them): a refusal right
after loading stays the one line on stderr."""


def _label(task: Task) -> str:
    return "  " * task.depth + task.name


class BarReporter(Reporter):
    """One rich bar per open stage (stages without a total show elapsed time only)."""

    def __init__(self, console: Console):
        self.bars = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                             TextColumn("{task.fields[unit]}"), TimeElapsedColumn(), TextColumn("eta"),
                             TimeRemainingColumn(), console=console, transient=True)
        self.ids: dict[int, TaskID] = {}

    def begin(self, task: Task) -> None:
        if not self.ids:
            self.bars.start()
        self.ids[id(task)] = self.bars.add_task(_label(task), total=task.total, unit=task.unit)

    def update(self, task: Task) -> None:
        if id(task) in self.ids:
            self.bars.update(self.ids[id(task)], completed=task.done)

    def end(self, task: Task) -> None:
        bar = self.ids.pop(id(task), None)
        if bar is not None:
            self.bars.remove_task(bar)
        if not task.failed and task.seconds >= QUIET_BELOW:
            self.bars.console.print(f"[dim]{_label(task)}: {_count(task)}{task.seconds:.1f} s[/dim]")
        if not self.ids:
            self.bars.stop()


class LineReporter(Reporter):
    """A line per finished stage, and a count line every HEARTBEAT seconds for a running one."""

    def __init__(self, console: Console):
        self.console = console
        self.last: dict[int, float] = {}

    def begin(self, task: Task) -> None:
        self.last[id(task)] = time.perf_counter()

    def update(self, task: Task) -> None:
        now = time.perf_counter()
        if now - self.last.get(id(task), now) >= HEARTBEAT:
            self.last[id(task)] = now
            of = f"/{task.total}" if task.total else ""
            self.console.print(f"{_label(task)}: {task.done}{of} {task.unit} after {task.elapsed:.0f} s",
                               highlight=False)

    def end(self, task: Task) -> None:
        self.last.pop(id(task), None)
        if not task.failed and task.seconds >= QUIET_BELOW:
            self.console.print(f"{_label(task)}: {_count(task)}{task.seconds:.1f} s", highlight=False)


def _count(task: Task) -> str:
    if not task.done:
        return ""
    return f"{task.done}{f'/{task.total}' if task.total else ''} {task.unit} in ".replace("  ", " ")


def reporter_for(console: Console) -> Reporter:
    return BarReporter(console) if console.is_terminal else LineReporter(console)


def timing_table(title: str = "time per stage") -> Table | None:
    """The finished stages of the outermost two levels, with their counts and seconds (None if none ran)."""
    tasks = progress.timings(depth=None)
    tasks = [t for t in tasks if t.depth <= 1]
    if not tasks:
        return None
    table = Table(title=title, title_justify="left")
    table.add_column("stage")
    table.add_column("done", justify="right")
    table.add_column("seconds", justify="right")
    for t in sorted(tasks, key=lambda t: t.start):
        done = f"{t.done}{f'/{t.total}' if t.total else ''} {t.unit}".strip() if t.done else ""
        table.add_row(_label(t), done, f"{t.seconds:.1f}")
    return table
