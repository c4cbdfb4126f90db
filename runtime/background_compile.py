"""Compiling the decode step on a second thread while the server answers eagerly (`optimize serve`'s default on
the CPU).

    job = BackgroundCompile(engine.compile_decode, busy=scheduler.has_work, log=print)
    job.start()          # returns at once; job.done is set when the compiled step is in use
    job.stop()           # shutting down: the compile thread parks at its next Python call

`Engine.compile_decode` swaps the compiled step in only once its warm-up has compiled it, so the scheduler's
steps run eager until then and compiled after, with nothing else to coordinate. What needs care is the GIL:
torch's tracing is pure Python, and an eager decode step releases and retakes the GIL at every operation, so a
compile running flat out makes each eager step wait on it thousands of times (SmolLM2-135M, one thread: 16
tokens took 10 s instead of 0.97 s). So the compile thread pauses: a profile function in that thread alone
looks at `busy()` every CHECK_EVERY_CALLS Python calls and sleeps while it is true. The compile advances
only while the server is idle, and requests are decoded at eager speed meanwhile. A server that is never
idle stays eager, as it would be without it. Figures: benchmarks/results/decode.md.

While a compile is paused in the middle of tracing, `torch.compiler.is_compiling()` (a process-wide flag) is
true on the engine thread too. The one branch on it in the CPU path (runtime/linear.py) picks between two calls
of the same oneDNN product, so eager steps compute what they would otherwise; a branch added there must keep
that true.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

CHECK_EVERY_CALLS = 50  # the compile thread's Python calls between two looks at the scheduler
PAUSE_SECONDS = 0.005  # how often a paused compile looks again
PARK_SECONDS = 0.1


class BackgroundCompile:
    """Runs `compile` (a callable that swaps a compiled decode step in when it returns) on a daemon thread
    that pauses whenever `busy()` is true. `log` gets one line when it starts, ends or fails."""

    def __init__(self, compile: Callable[[], None], busy: Callable[[], bool], log: Callable[[str], None]):
        self._compile = compile
        self._busy = busy
        self._log = log
        self._stop = threading.Event()
        self.done = threading.Event()
        self.failed: str | None = None
        self.seconds: float | None = None
        self._thread = threading.Thread(target=self._run, name="kiln-compile", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def running(self) -> bool:
        """Started and neither compiled nor failed."""
        return self._thread.is_alive() and not self.done.is_set()

    def stop(self) -> None:
        """Park the compile (the process is going away): its thread sleeps at its next Python call."""
        self._stop.set()

    def _run(self) -> None:
        calls = 0
        busy, stop = self._busy, self._stop

        def pause_while_busy(frame, event, arg):
            nonlocal calls
            if event != "call":
                return
            calls += 1
            if calls % CHECK_EVERY_CALLS:
                return
            while stop.is_set():  # a daemon thread: parked here, it ends with the process
                time.sleep(PARK_SECONDS)
            while busy():
                time.sleep(PAUSE_SECONDS)

        self._log("kiln serve: compiling the decode step in the background (torch.compile); requests are "
                  "answered eagerly until it is done")
        started = time.perf_counter()
        sys.setprofile(pause_while_busy)  # this thread only
        try:
            self._compile()
        except Exception as exc:  # noqa: BLE001 -- a failed compile leaves the server eager, not down
            detail = " ".join(str(exc).split())[:200]
            self.failed = f"{type(exc).__name__}: {detail}"
            self._log(f"kiln serve: compiling the decode step failed ({self.failed}); decoding stays eager")
            return
        finally:
            sys.setprofile(None)
        self.seconds = time.perf_counter() - started
        self.done.set()
        self._log(f"kiln serve: decode step compiled in {self.seconds:.0f} s; decoding through it from now on")
