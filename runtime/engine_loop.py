"""The engine thread that drives the scheduler for the server, and each HTTP request's view of its choices.

    engine_loop = EngineLoop(scheduler, ServerMetrics(), log)
    engine_loop.start(asyncio.get_running_loop())
    choices = Choices(engine_loop, metrics, deadline=None, request_timeout=None)
    choices.add(0, prompt_ids, SamplingParams(max_tokens=16))
    async for index, delta in choices.deltas():   # Delta: new text; at the end why it finished
        ...

One engine thread owns the scheduler and is the only one that calls `step`: it steps while there is work and
otherwise sleeps on an Event that a new request sets. Handlers on the asyncio loop queue requests with
`add_request` and `abort` (both thread-safe) and receive each request's new text through an asyncio.Queue,
which the engine thread feeds with one `loop.call_soon_threadsafe` a step (not one a request). A step that
raises fails the requests it was running, is logged in one line, and the loop goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kiln.runtime.openai_api import ApiError
from kiln.runtime.server_metrics import ServerMetrics

DISCONNECT_POLL_SECONDS = 0.25  # how often a waiting non-streaming request checks for its client


@dataclass(frozen=True)
class Delta:
    """One step's result for one choice: its new text, and at the end why it finished and its token counts."""

    text: str
    finished: bool = False
    finish_reason: str | None = None  # the scheduler's: "length", "eos", "stop" or "abort"
    completion_tokens: int = 0
    error: str | None = None  # the step failed: the request is gone


class EngineLoop:
    """The thread that owns the scheduler: it alone calls `step`, and it hands each step's events on."""

    def __init__(self, scheduler, metrics: ServerMetrics, log: Callable[[str], None]):
        self.scheduler = scheduler
        self.metrics = metrics
        self.log = log
        self._loop: asyncio.AbstractEventLoop | None = None
        # request id -> (Request, the asyncio queue its deltas go to, its choice index there)
        self._live: dict[int, tuple[Any, asyncio.Queue, int]] = {}
        self._ids = itertools.count()
        self._wake = threading.Event()
        self._stop = False
        self._failures = 0  # steps failed in a row
        self._thread = threading.Thread(target=self._run, name="kiln-engine", daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    def submit(self, prompt_ids: Sequence[int], params, queue: asyncio.Queue, index: int):
        """Queue a request whose deltas go to `queue` as (index, Delta). Raises QueueFull or KilnError as
        `Scheduler.add_request` does."""
        request_id = next(self._ids)
        # registered before it is queued: a step running now on the engine thread may already emit its first token
        self._live[request_id] = (None, queue, index)
        try:
            request = self.scheduler.add_request(prompt_ids, params, request_id=request_id)
        except BaseException:
            self._live.pop(request_id, None)
            raise
        self._live[request_id] = (request, queue, index)
        self._wake.set()
        return request

    def abort(self, request_id: int) -> None:
        self.scheduler.abort(request_id)
        self._wake.set()

    def _run(self) -> None:
        scheduler = self.scheduler
        while not self._stop:
            self._wake.clear()  # cleared before looking: a request added after this sets it again
            if not scheduler.has_work():
                self._wake.wait()
                continue
            try:
                events = scheduler.step()
            except Exception as exc:  # noqa: BLE001 -- one bad step must not take the server down
                self._fail_step(exc)
                continue
            self._failures = 0
            outbox = []
            for event in events:
                request = event.request
                entry = self._live.pop(request.id, None) if event.finished else self._live.get(request.id)
                if entry is not None:
                    outbox.append((entry[1], (entry[2], Delta(event.text, event.finished, request.finish_reason,
                                                              len(request.output_ids)))))
                if event.finished:
                    self.metrics.observe_finished(request)
                self.metrics.generation_tokens.inc(len(event.token_ids))
            self._post(outbox)
            self.metrics.observe_state(scheduler)
        self._post([(queue, (index, Delta("", True, "abort", error="the server is shutting down")))
                    for _, queue, index in self._live.values()])  # stopping: nobody will step again
        self._live.clear()

    def _post(self, outbox: list) -> None:
        """Hand a step's deltas to the event loop: one wake-up a step, not one a request."""
        if outbox:
            with contextlib.suppress(RuntimeError):  # the loop has closed (shutdown): nobody is listening
                self._loop.call_soon_threadsafe(_put_all, outbox)

    def _fail_step(self, exc: Exception) -> None:
        """The requests the step was running (the scheduler has given their blocks back, or is told to) get an
        error; the waiting ones stay queued. A second failure in a row fails every request."""
        self._failures += 1
        everything = self._failures > 1
        running = {r.id for r in self.scheduler.running}
        failed = [rid for rid, (r, _, _) in list(self._live.items())  # (r None: being added on the loop thread)
                  if r is not None and (everything or r.finished or rid in running)]
        detail = " ".join(str(exc).split())[:200]
        self.log(f"kiln serve: a step failed ({type(exc).__name__}: {detail}); failing {len(failed)} request(s)")
        outbox = []
        for request_id in failed:
            request, queue, index = self._live.pop(request_id)
            if not request.finished:
                self.scheduler.abort(request_id)
            self.metrics.aborted.labels("error").inc()
            outbox.append((queue, (index, Delta("", True, "abort", error="the engine failed while running this "
                                                                          f"request ({type(exc).__name__})"))))
        self._post(outbox)
        self.metrics.observe_state(self.scheduler)


def _put_all(outbox: list) -> None:
    for queue, item in outbox:
        queue.put_nowait(item)


class ClientGone(Exception):
    """The client of a non-streaming request disconnected."""


class Choices:
    """One HTTP request's scheduler requests (one per choice) and the asyncio queue their deltas arrive on.
    Past `deadline` (time.monotonic) they are aborted; `request_timeout` is what the 504's message names."""

    def __init__(self, engine_loop: EngineLoop, metrics: ServerMetrics, deadline: float | None,
                 request_timeout: float | None):
        self.engine_loop = engine_loop
        self.metrics = metrics
        self.deadline = deadline
        self.request_timeout = request_timeout
        self.queue: asyncio.Queue[tuple[int, Delta]] = asyncio.Queue()
        self.request_ids: dict[int, int] = {}  # choice index -> scheduler request id
        self.pending: set[int] = set()

    def add(self, index: int, prompt_ids: Sequence[int], params) -> None:
        request = self.engine_loop.submit(prompt_ids, params, self.queue, index)
        self.request_ids[index] = request.id
        self.pending.add(index)

    def abort(self, cause: str) -> None:
        """Abort every choice not finished yet (its blocks are freed at the next step)."""
        for index in list(self.pending):
            self.engine_loop.abort(self.request_ids[index])
            self.metrics.aborted.labels(cause).inc()
        self.pending.clear()

    async def deltas(self, http_request=None) -> AsyncIterator[tuple[int, Delta]]:
        """(choice index, delta) until every choice has finished. With `http_request` (a non-streaming
        request), a client that went away raises ClientGone. Past the deadline: ApiError 504."""
        # the client is checked every DISCONNECT_POLL_SECONDS whether or not deltas keep coming: choices that
        # stream tokens without pause must not outlive a client that went away
        next_check = time.monotonic() + DISCONNECT_POLL_SECONDS
        while self.pending:
            wait = DISCONNECT_POLL_SECONDS if http_request is not None else None
            if self.deadline is not None:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    self.abort("timeout")
                    raise ApiError(504, f"the request ran longer than --request-timeout "
                                        f"{self.request_timeout:g} s and was aborted", "timeout_error",
                                   code="request_timeout")
                wait = left if wait is None else min(wait, left)
            items = []
            try:
                async with asyncio.timeout(wait):
                    items = [await self.queue.get()]
            except TimeoutError:
                pass
            if http_request is not None and time.monotonic() >= next_check:
                next_check = time.monotonic() + DISCONNECT_POLL_SECONDS
                if await http_request.is_disconnected():
                    self.abort("disconnect")
                    raise ClientGone() from None
            if not items:
                continue
            while not self.queue.empty():  # a reader that fell behind gets one delta a choice, not one a step
                items.append(self.queue.get_nowait())
            merged: dict[int, Delta] = {}
            for index, delta in items:
                before = merged.get(index)
                merged[index] = delta if before is None else dataclasses.replace(delta, text=before.text + delta.text)
            for index, delta in merged.items():
                if delta.error is not None:
                    self.pending.discard(index)
                    self.abort("error")
                    raise ApiError(500, delta.error, "server_error", code="engine_error")
                if delta.finished:
                    self.pending.discard(index)
                yield index, delta

