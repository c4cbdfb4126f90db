"""An OpenAI-compatible HTTP server over the continuous-batching scheduler (runtime.scheduler).

    optimize serve ARTIFACT --host 127.0.0.1 --port 8000 [--max-queue Q] [--max-num-seqs S]
        [--max-num-batched-tokens T] [--request-timeout SEC] [--no-prefix-caching]

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.completions.create(model="ARTIFACT-NAME", prompt="Once upon a time", max_tokens=32)

Endpoints: POST /v1/completions and /v1/chat/completions (streaming as server-sent events in OpenAI's chunk
format), GET /v1/models, GET /health (200 while serving, 503 while draining), GET /metrics (Prometheus text).

Threads. One engine thread owns the scheduler and is the only one that calls `step`: it steps while there is
work and otherwise sleeps on an Event that a new request sets. HTTP handlers run on the asyncio loop; they
queue requests with `add_request` and `abort` (both thread-safe) and receive each request's new text through
an asyncio.Queue, which the engine thread feeds with one `loop.call_soon_threadsafe` a step (not one a
request); a reader that fell behind takes what has piled up as one delta per choice. A step that raises fails
the requests it was running (500, or an error event on a stream), is logged in one line, and serving goes on.

Bounds. Memory is the wait queue (`max_queue`; a full queue answers 429 with Retry-After) plus the fixed KV
block pool; a request that could never fit the context or the pool is refused with 400 before it queues.
A request older than `request_timeout` is aborted (its blocks freed) and answered 504, or its stream ends
with an error event. A client that goes away aborts its requests: a stream when its response is cancelled, a
plain request through `is_disconnected`, polled while it waits.

Shutdown. SIGTERM or SIGINT starts draining: new requests get 503, requests in flight run to the end, then
the server closes its socket and returns (the process exits 0). A second signal stops at once.

Prompts are tokenized as `Engine.generate` does (`tokenizer(text)["input_ids"]`), so a temperature-0
completion is `Engine.generate`'s text for the same prompt and max_tokens. Chat messages go through the
tokenizer's chat template (`apply_chat_template(add_generation_prompt=True)`); a tokenizer without one gets
FALLBACK_CHAT_FORMAT: each message as "{role}: {content}" on its own line, then "assistant:", tokenized as a
plain prompt (BOS included), and the server log says so once (the first such request).

Sampling: temperature (default 1.0, as OpenAI's), top_p, seed (choice j of a prompt samples with seed + j),
stop (a string or a list), n, max_tokens (completions: default 16; chat: default the rest of the context),
and two extensions: `ignore_eos` (vLLM's) and `repetition_penalty` (default: the artifact's). Options the
runtime cannot honour (logprobs, echo, best_of above n, suffix, tools, logit_bias, presence/frequency
penalties) are refused with 400, never silently dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import signal
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr
from starlette.exceptions import HTTPException

from kiln.kernels.errors import KilnError
from kiln.runtime.speculative import check_draft_tokens, check_tree_width

FALLBACK_CHAT_FORMAT = "{role}: {content}\n"  # per message; the prompt then ends with "assistant:"
RETRY_AFTER_SECONDS = 1
DISCONNECT_POLL_SECONDS = 0.25  # how often a waiting non-streaming request checks for its client
MAX_STOP_STRINGS = 16


@dataclass(frozen=True)
class ServerConfig:
    """How `serve` runs. Every field is validated here, with the bad value named."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (the startup line names it)
    max_queue: int = 256  # requests waiting for a sequence slot; one more is answered 429
    max_num_seqs: int = 32  # requests decoding together
    max_num_batched_tokens: int = 512  # tokens one step runs (prompt chunks + decoding rows)
    request_timeout: float | None = None  # seconds from arrival; None: no limit
    prefix_caching: bool = True
    served_model_name: str | None = None  # None: the artifact directory's name
    num_blocks: int | None = None  # KV blocks in the pool; None: the engine's default pool size
    compile_decode: bool = False  # Engine.compile_decode before serving (minutes of compiling at startup)
    device: str = "cpu"  # "cuda": packed weights, bf16 activations, KV pool and sampling on the GPU
    # service-level objectives: /metrics then counts the finished requests that met each (kiln_slo_*)
    ttft_slo: float | None = None  # seconds from arrival to the first token
    tpot_slo: float | None = None  # seconds per output token after the first
    # speculative decoding: None, or the drafter ("head": the artifact's draft head or MTP layer; "prompt-lookup";
    # "auto": the head when there is one), proposing up to draft_tokens a step (a tree of tree_width per depth
    # for greedy requests; None: the width the artifact was gated with)
    speculative: str | None = None
    draft_tokens: int = 4
    tree_width: int | None = None

    def __post_init__(self):
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise KilnError(f"--port must be in [0, 65535], got {self.port!r}")
        for name in ("max_queue", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise KilnError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        if self.request_timeout is not None and not 0 < self.request_timeout < float("inf"):
            raise KilnError(f"--request-timeout must be a positive number of seconds, got {self.request_timeout!r}")
        for name in ("ttft_slo", "tpot_slo"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                      or not 0 < value < float("inf")):
                raise KilnError(f"--{name.replace('_', '-')} must be a positive number of seconds, got {value!r}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise KilnError(f"num_blocks must be >= 1, got {self.num_blocks!r}")
        if self.speculative not in (None, "auto", "head", "prompt-lookup"):
            raise KilnError(f"--speculative must be auto, head or prompt-lookup, got {self.speculative!r}")
        check_draft_tokens(self.draft_tokens)
        if self.tree_width is not None:
            check_tree_width(self.tree_width)


# --- errors in OpenAI's shape --------------------------------------------------------------------------------
class ApiError(Exception):
    """An HTTP error answered as OpenAI does: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param)


# --- what the engine thread hands to a request's queue ---------------------------------------------------------
@dataclass(frozen=True)
class Delta:
    """One step's result for one choice: its new text, and at the end why it finished and its token counts."""

    text: str
    finished: bool = False
    finish_reason: str | None = None  # the scheduler's: "length", "eos", "stop" or "abort"
    completion_tokens: int = 0
    error: str | None = None  # the step failed: the request is gone


OPENAI_FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


def kv_pool_line(cache) -> str:
    """The KV pool in a few words: blocks and bytes, and its groups where sliding-window layers keep only their
    window (a block id is then one group's share of the storage)."""
    line = f"{cache.num_blocks} KV blocks of {cache.block_size} tokens, {cache.nbytes / 2**20:.0f} MiB"
    if cache.windowed:
        windows = sorted({g.window for g in cache.groups if g.window is not None})
        line += (f" in {len(cache.groups)} groups of {len(cache.groups[0].layers)} layers (windows "
                 f"{', '.join(map(str, windows))} keep only theirs)")
    return line


class ServerMetrics:
    """Prometheus series in a registry of this server's own (two servers in a process never share one).

    With SLOs (`ttft_slo`, `tpot_slo` seconds) it also counts finished requests against them, what a Prometheus
    SLO rule divides: kiln_slo_requests_total (finished with a first token), kiln_slo_ttft_met_total,
    kiln_slo_tpot_met_total (a one-token request meets TPOT) and kiln_slo_met_total (both): attainment =
    met / requests, goodput = rate(kiln_slo_met_total)."""

    def __init__(self, ttft_slo: float | None = None, tpot_slo: float | None = None):
        r = self.registry = CollectorRegistry()
        self.ttft_slo, self.tpot_slo = ttft_slo, tpot_slo
        self.slo = None
        if ttft_slo is not None or tpot_slo is not None:
            self.slo = {name: Counter(f"kiln_slo_{name}", help_text, registry=r) for name, help_text in (
                ("requests", "Finished requests held to the SLOs (those with a first token)"),
                ("ttft_met", f"Of those, first token within {ttft_slo} s" if ttft_slo else "TTFT SLO unset: all"),
                ("tpot_met", f"Of those, time per output token within {tpot_slo} s" if tpot_slo
                 else "TPOT SLO unset: all"),
                ("met", "Of those, within both SLOs (goodput)"))}
        latency = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
        self.ttft = Histogram("kiln_time_to_first_token_seconds", "Arrival to first token", buckets=latency,
                              registry=r)
        self.tpot = Histogram("kiln_time_per_output_token_seconds", "Mean seconds per output token after the first",
                              buckets=latency[:-3], registry=r)
        self.e2e = Histogram("kiln_e2e_request_latency_seconds", "Arrival to the last token", buckets=latency,
                             registry=r)
        self.waiting = Gauge("kiln_num_requests_waiting", "Requests in the wait queue", registry=r)
        self.running = Gauge("kiln_num_requests_running", "Requests in the running batch", registry=r)
        self.kv_usage = Gauge("kiln_kv_cache_usage_ratio", "KV blocks held by sequences / blocks in the pool",
                              registry=r)
        self.prefix_hit_rate = Gauge("kiln_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / "
                                     "prompt tokens looked up", registry=r)
        self.success = Counter("kiln_request_success", "Requests finished, by finish reason", ["finish_reason"],
                               registry=r)
        self.rejected = Counter("kiln_requests_rejected", "Requests answered 429 (wait queue full)", registry=r)
        self.aborted = Counter("kiln_requests_aborted", "Requests aborted, by cause", ["cause"], registry=r)
        self.prompt_tokens = Counter("kiln_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("kiln_generation_tokens", "Tokens generated", registry=r)
        self.preemptions = Counter("kiln_preemptions", "Requests preempted (blocks given back, recomputed later)",
                                   registry=r)
        self._preemptions_seen = 0
        # speculative decoding (vLLM's spec_decode counters): acceptance = accepted / draft tokens, tokens per
        # verification = emitted / verifications
        self.spec = {name: Counter(f"kiln_spec_decode_{name}", help_text, registry=r) for name, help_text in (
            ("num_verifications", "Verification forwards, per request row"),
            ("num_draft_tokens", "Draft tokens verified"),
            ("num_accepted_tokens", "Draft tokens accepted"),
            ("num_emitted_tokens", "Tokens emitted by verifications (accepted drafts and the target's own)"))}
        self._spec_seen = dict.fromkeys(self.spec, 0)

    def observe_state(self, scheduler) -> None:
        stats = scheduler.stats()
        self.waiting.set(stats["waiting"])
        self.running.set(stats["running"])
        self.kv_usage.set(stats["kv_utilization"])
        self.prefix_hit_rate.set(stats["prefix_hit_rate"])
        if stats["preemptions"] > self._preemptions_seen:
            self.preemptions.inc(stats["preemptions"] - self._preemptions_seen)
            self._preemptions_seen = stats["preemptions"]
        for name, key in (("num_verifications", "spec_verifications"), ("num_draft_tokens", "spec_draft_tokens"),
                          ("num_accepted_tokens", "spec_accepted_tokens"), ("num_emitted_tokens", "spec_emitted_tokens")):
            if stats.get(key, 0) > self._spec_seen[name]:
                self.spec[name].inc(stats[key] - self._spec_seen[name])
                self._spec_seen[name] = stats[key]

    def observe_finished(self, request) -> None:
        self.prompt_tokens.inc(len(request.prompt_ids))
        if request.finish_reason not in OPENAI_FINISH:
            return
        self.success.labels(OPENAI_FINISH[request.finish_reason]).inc()
        if request.ttft is not None:
            self.ttft.observe(request.ttft)
        if request.tpot is not None:
            self.tpot.observe(request.tpot)
        if request.finished_at is not None:
            self.e2e.observe(request.finished_at - request.arrival)
        if self.slo is not None and request.ttft is not None:
            ttft_ok = self.ttft_slo is None or request.ttft <= self.ttft_slo
            tpot_ok = self.tpot_slo is None or request.tpot is None or request.tpot <= self.tpot_slo
            self.slo["requests"].inc()
            self.slo["ttft_met"].inc(ttft_ok)
            self.slo["tpot_met"].inc(tpot_ok)
            self.slo["met"].inc(ttft_ok and tpot_ok)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


# --- the engine thread -----------------------------------------------------------------------------------------
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


class _Choices:
    """One HTTP request's scheduler requests (one per choice) and the asyncio queue their deltas arrive on."""

    def __init__(self, state: ServingState, deadline: float | None):
        self.state = state
        self.deadline = deadline
        self.queue: asyncio.Queue[tuple[int, Delta]] = asyncio.Queue()
        self.request_ids: dict[int, int] = {}  # choice index -> scheduler request id
        self.pending: set[int] = set()

    def add(self, index: int, prompt_ids: Sequence[int], params) -> None:
        request = self.state.engine_loop.submit(prompt_ids, params, self.queue, index)
        self.request_ids[index] = request.id
        self.pending.add(index)

    def abort(self, cause: str) -> None:
        """Abort every choice not finished yet (its blocks are freed at the next step)."""
        for index in list(self.pending):
            self.state.engine_loop.abort(self.request_ids[index])
            self.state.metrics.aborted.labels(cause).inc()
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
                                        f"{self.state.config.request_timeout:g} s and was aborted", "timeout_error",
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


class ClientGone(Exception):
    """The client of a non-streaming request disconnected."""


# --- request parsing -------------------------------------------------------------------------------------------
Number = StrictFloat | StrictInt


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool = False


class SamplingFields(BaseModel):
    """The sampling options both endpoints take. Unknown fields (user, metadata, ...) are accepted and ignored as
    OpenAI's server ignores them; the options that would change the output and that Kiln cannot honour are
    refused by _refuse_unsupported."""

    model_config = ConfigDict(extra="allow")
    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    n: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False  # vLLM's extension: run to max_tokens through EOS
    repetition_penalty: Number | None = None  # extension; None: the artifact's default


class CompletionRequest(SamplingFields):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: StrictStr
    content: StrictStr | list[dict[str, Any]] | None = None


class ChatRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None


def _refuse_unsupported(body, chat: bool) -> None:
    extra = body.model_extra or {}
    n = body.n or 1

    def given(name: str) -> Any:
        return extra.get(name)

    if given("logprobs") not in (None, False) or given("top_logprobs") not in (None, 0):
        raise _bad("logprobs are not supported by this server", "logprobs")
    if given("echo"):
        raise _bad("echo is not supported by this server", "echo")
    if given("best_of") is not None and given("best_of") != n:
        raise _bad(f"best_of (here {given('best_of')!r}) other than n is not supported", "best_of")
    if given("suffix"):
        raise _bad("suffix is not supported by this server", "suffix")
    for name in ("tools", "functions", "logit_bias"):
        if given(name):
            raise _bad(f"{name} is not supported by this server", name)
    if given("tool_choice") not in (None, "none"):
        raise _bad("tool_choice is not supported by this server", "tool_choice")
    for name in ("presence_penalty", "frequency_penalty"):
        if given(name) not in (None, 0, 0.0):
            raise _bad(f"{name} is not supported by this server (use repetition_penalty)", name)
    response_format = given("response_format")
    if response_format not in (None, {"type": "text"}):
        raise _bad("response_format other than text is not supported", "response_format")


@dataclass(frozen=True)
class _Parsed:
    prompts: list[list[int]]
    n: int
    params: list[Any]  # SamplingParams per choice, prompt-major: index = prompt * n + j
    stream: bool
    include_usage: bool


class ServingState:
    """What the app's handlers share: the engine, its scheduler thread, metrics, and the draining flag."""

    def __init__(self, engine, config: ServerConfig, model_id: str, log: Callable[[str], None]):
        from kiln.runtime.scheduler import Scheduler, draft_pool_blocks

        self.engine = engine
        self.config = config
        self.model_id = model_id
        self.log = log
        self.tokenizer = engine.tokenizer
        self.warned_no_chat_template = False
        pool = draft_pool_blocks(config.num_blocks or engine.kv_cache_blocks, config.max_num_seqs,
                                 config.draft_tokens, engine.kv_block_size)
        drafter = (engine.drafter(config.speculative, tree_width=config.tree_width, num_blocks=pool)
                   if config.speculative is not None else None)
        self.scheduler = Scheduler(engine, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens, max_queue=config.max_queue,
                                   prefix_caching=config.prefix_caching, num_blocks=config.num_blocks,
                                   tokenizer=engine.tokenizer, drafter=drafter, draft_tokens=config.draft_tokens)
        self.metrics = ServerMetrics(config.ttft_slo, config.tpot_slo)
        self.engine_loop = EngineLoop(self.scheduler, self.metrics, log)
        self.context = engine.spec.max_position_embeddings
        cache = self.scheduler.cache
        # the most tokens (prompt + output) one request may hold: the context, and what the pool holds of one
        # sequence, its sliding-window layers keeping only their windows (the last token is sampled, never written)
        step = 1 + self.scheduler._width_of(self.scheduler.draft_tokens)
        self.max_request_tokens = min(self.context, cache.max_sequence_tokens(step) + 1)
        self.draining = False
        self.in_flight = 0
        self.created = int(time.time())

    # -- parsing --
    def _tokenize(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise _bad("this artifact has no tokenizer: send prompts as token ids", "prompt")
        return list(self.tokenizer(text)["input_ids"])

    def completion_prompts(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
            prompt = [prompt]
        if not prompt:
            raise _bad("prompt must not be empty", "prompt")
        out = []
        for p in prompt:
            if isinstance(p, str):
                if not p:
                    raise _bad("prompt must not be empty", "prompt")
                out.append(self._tokenize(p))
            else:
                if not p:
                    raise _bad("a token-id prompt must not be empty", "prompt")
                vocab = self.engine.spec.vocab_size
                if min(p) < 0 or max(p) >= vocab:
                    raise _bad(f"prompt token ids must be in [0, {vocab})", "prompt")
                out.append(list(p))
        return out

    def chat_prompt(self, messages) -> list[int]:
        if not messages:
            raise _bad("messages must not be empty", "messages")
        plain = []
        for i, message in enumerate(messages):
            content = message.content
            if isinstance(content, list):  # content parts: text only
                texts = []
                for part in content:
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise _bad(f"messages[{i}]: only text content parts are supported", "messages")
                    texts.append(part["text"])
                content = "".join(texts)
            plain.append({"role": message.role, "content": content or ""})
        tok = self.tokenizer
        if tok is None:
            raise _bad("this artifact has no tokenizer: chat completions need one", "messages")
        if getattr(tok, "chat_template", None):
            try:
                text = tok.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
            except Exception as exc:  # noqa: BLE001 -- a template refusing the messages (roles, order) is theirs
                raise _bad(f"the chat template refused the messages: {' '.join(str(exc).split())[:200]}",
                           "messages") from None
            return list(tok(text, add_special_tokens=False)["input_ids"])
        if not self.warned_no_chat_template:  # once, in the server log, as vLLM warns of its fallback
            self.warned_no_chat_template = True
            self.log(f"kiln serve: warning: {self.model_id} has no chat template (no chat_template.jinja, none in "
                     "tokenizer_config.json); chat messages are sent as 'role: content' lines followed by "
                     "'assistant:', which the model was not trained on")
        text = "".join(FALLBACK_CHAT_FORMAT.format(**m) for m in plain) + "assistant:"
        return self._tokenize(text)

    def parse(self, body, prompts: list[list[int]], chat: bool) -> _Parsed:
        from kiln.runtime.scheduler import SamplingParams

        _refuse_unsupported(body, chat)
        if body.model is not None and body.model != self.model_id:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server has {self.model_id!r}",
                           "invalid_request_error", "model", "model_not_found")
        n = 1 if body.n is None else body.n
        if n < 1:
            raise _bad(f"n must be >= 1, got {n}", "n")
        if body.seed is not None and not -(2**63) <= body.seed <= 2**63 - n:  # choice j seeds a generator with seed + j
            raise _bad(f"seed must be a 64-bit integer, got {body.seed}", "seed")
        if len(prompts) * n > self.config.max_queue:
            raise _bad(f"{len(prompts)} prompt(s) x n={n} choices exceed the server's queue of "
                       f"{self.config.max_queue} requests", "n")
        temperature = 1.0 if body.temperature is None else float(body.temperature)
        if not 0 <= temperature <= 2:
            raise _bad(f"temperature must be in [0, 2], got {temperature}", "temperature")
        top_p = 1.0 if body.top_p is None else float(body.top_p)
        if not 0 < top_p <= 1:
            raise _bad(f"top_p must be in (0, 1], got {top_p}", "top_p")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        stop = [s for s in stop if s]
        if len(stop) > MAX_STOP_STRINGS:
            raise _bad(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", "stop")
        penalty = body.repetition_penalty
        if penalty is not None and not 0 < penalty < float("inf"):
            raise _bad(f"repetition_penalty must be > 0 (1 = off), got {penalty}", "repetition_penalty")
        max_tokens = body.max_tokens
        if chat and body.max_completion_tokens is not None:
            max_tokens = body.max_completion_tokens
        longest = max(len(p) for p in prompts)
        if longest >= self.max_request_tokens:
            raise _bad(f"the prompt has {longest} tokens; this server takes at most {self.max_request_tokens - 1} "
                       f"(the model's context is {self.context})", "prompt" if not chat else "messages")
        if max_tokens is None:
            max_tokens = 16 if not chat else self.max_request_tokens - longest
        if max_tokens < 1:
            raise _bad(f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
        if longest + max_tokens > self.max_request_tokens:
            raise _bad(f"this model's maximum context length is {self.max_request_tokens} tokens; the request asks "
                       f"for {longest + max_tokens} ({longest} in the prompt, {max_tokens} for the completion)",
                       "max_tokens")
        params = []
        for _ in prompts:
            for j in range(n):
                params.append(SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                             seed=None if body.seed is None else body.seed + j, stop=tuple(stop),
                                             stop_ids=() if body.ignore_eos else None,
                                             repetition_penalty=None if penalty is None else float(penalty)))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return _Parsed(prompts, n, params, bool(body.stream), include_usage)

    # -- submission --
    def submit(self, parsed: _Parsed, arrival: float) -> _Choices:
        from kiln.runtime.scheduler import QueueFull

        deadline = None if self.config.request_timeout is None else arrival + self.config.request_timeout
        choices = _Choices(self, deadline)
        try:
            for index, params in enumerate(parsed.params):
                choices.add(index, parsed.prompts[index // parsed.n], params)
        except QueueFull:
            choices.abort("rejected")
            self.metrics.rejected.inc()
            raise ApiError(429, f"the server is at capacity ({self.config.max_queue} requests waiting); retry "
                                f"after {RETRY_AFTER_SECONDS} s", "rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        except KilnError as exc:
            choices.abort("rejected")
            raise _bad(str(exc)) from None
        return choices


# --- the app ---------------------------------------------------------------------------------------------------
def scrape(exposition: str) -> dict[str, float]:
    """/metrics text as {sample name with its labels: value} (prometheus_client's parser), as a client reads it."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sample.labels.items())
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


def create_app(engine, config: ServerConfig, model_id: str, log: Callable[[str], None] | None = None):
    """The FastAPI app serving `engine`; its engine thread starts and stops with the app's lifespan.
    `app.state.kiln` is the ServingState."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    state = ServingState(engine, config, model_id, log)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.engine_loop.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            state.engine_loop.stop()

    app = FastAPI(title="Kiln", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.kiln = state

    def error_response(error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(ApiError)
    async def api_error(request, exc: ApiError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        where = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            where, message = [], "the request body is not valid JSON"
        return error_response(_bad(f"{'.'.join(where) + ': ' if where else ''}{message}",
                                   where[0] if where else None))

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(ApiError(exc.status_code, str(exc.detail), kind))

    @app.exception_handler(Exception)
    async def internal_error(request, exc: Exception):  # a bug: Starlette re-raises it, uvicorn logs its traceback
        return error_response(ApiError(500, f"internal error ({type(exc).__name__})", "server_error"))

    def admit() -> None:
        if state.draining:
            raise ApiError(503, "the server is shutting down", "service_unavailable", code="draining",
                           headers={"Connection": "close"})
        if not state.engine_loop.alive:
            raise ApiError(503, "the engine is not running", "service_unavailable", code="engine_down")

    class EventStream(StreamingResponse):
        """SSE whose end, however it comes (finished, client gone, cancelled), aborts what is left and lets
        draining know."""

        def __init__(self, body: AsyncIterator[str], choices: _Choices):
            super().__init__(body, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            self.choices = choices

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:  # the bookkeeping first: the await below may be cancelled
                self.choices.abort("disconnect")
                state.in_flight -= 1
                await self.body_iterator.aclose()

    async def run(body, chat: bool, http_request: Request):
        arrival = time.monotonic()
        admit()
        prompts = [state.chat_prompt(body.messages)] if chat else state.completion_prompts(body.prompt)
        parsed = state.parse(body, prompts, chat)
        state.in_flight += 1
        handed_to_stream = False
        try:
            choices = state.submit(parsed, arrival)
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            created = int(time.time())
            if parsed.stream:
                stream = _stream_chat(choices, parsed, rid, created) if chat else \
                    _stream_completion(choices, parsed, rid, created)
                handed_to_stream = True
                return EventStream(stream, choices)
            texts = {i: [] for i in range(len(parsed.params))}
            ends: dict[int, Delta] = {}
            try:
                async for index, delta in choices.deltas(http_request):
                    texts[index].append(delta.text)
                    if delta.finished:
                        ends[index] = delta
            except ClientGone:
                return Response(status_code=499)  # nobody reads it
            finally:
                choices.abort("disconnect")
            out = []
            for index in range(len(parsed.params)):
                text, reason = "".join(texts[index]), OPENAI_FINISH.get(ends[index].finish_reason, "stop")
                if chat:
                    out.append({"index": index, "message": {"role": "assistant", "content": text},
                                "logprobs": None, "finish_reason": reason})
                else:
                    out.append({"index": index, "text": text, "logprobs": None, "finish_reason": reason})
            prompt_tokens = sum(len(p) for p in parsed.prompts)
            usage = _usage(prompt_tokens, sum(d.completion_tokens for d in ends.values()))
            return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                                 "created": created, "model": state.model_id, "choices": out, "usage": usage})
        finally:
            if not handed_to_stream:
                state.in_flight -= 1

    def chunk(rid, created, chat: bool, choices: list, usage=None, include_usage: bool = False) -> str:
        obj = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
               "model": state.model_id, "choices": choices}
        if include_usage:
            obj["usage"] = usage
        return _sse(obj)

    def stream_error(exc: ApiError) -> str:
        return _sse(exc.body()) + "data: [DONE]\n\n"

    async def _stream_completion(choices: _Choices, parsed: _Parsed, rid, created) -> AsyncIterator[str]:
        completion = 0
        try:
            async for index, delta in choices.deltas():
                completion += delta.completion_tokens if delta.finished else 0
                if not delta.text and not delta.finished:
                    continue
                reason = OPENAI_FINISH.get(delta.finish_reason, "stop") if delta.finished else None
                yield chunk(rid, created, False, [{"index": index, "text": delta.text, "logprobs": None,
                                                   "finish_reason": reason}], None, parsed.include_usage)
        except ApiError as exc:
            yield stream_error(exc)
            return
        if parsed.include_usage:
            yield chunk(rid, created, False, [], _usage(sum(len(p) for p in parsed.prompts), completion), True)
        yield "data: [DONE]\n\n"

    async def _stream_chat(choices: _Choices, parsed: _Parsed, rid, created) -> AsyncIterator[str]:
        completion = 0
        for index in range(len(parsed.params)):
            yield chunk(rid, created, True, [{"index": index, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None}], None, parsed.include_usage)
        try:
            async for index, delta in choices.deltas():
                completion += delta.completion_tokens if delta.finished else 0
                if delta.text:
                    yield chunk(rid, created, True, [{"index": index, "delta": {"content": delta.text},
                                                      "logprobs": None, "finish_reason": None}], None,
                                parsed.include_usage)
                if delta.finished:
                    yield chunk(rid, created, True, [{"index": index, "delta": {}, "logprobs": None,
                                                      "finish_reason": OPENAI_FINISH.get(delta.finish_reason,
                                                                                         "stop")}],
                                None, parsed.include_usage)
        except ApiError as exc:
            yield stream_error(exc)
            return
        if parsed.include_usage:
            yield chunk(rid, created, True, [], _usage(sum(len(p) for p in parsed.prompts), completion), True)
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await run(body, False, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        return await run(body, True, request)

    def model_card() -> dict:
        return {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "kiln",
                "max_model_len": state.context}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        if model != state.model_id:
            raise ApiError(404, f"the model {model!r} does not exist", "invalid_request_error", "model",
                           "model_not_found")
        return model_card()

    @app.get("/health")
    async def health():
        if state.draining or not state.engine_loop.alive:
            return JSONResponse({"status": "draining" if state.draining else "engine down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app


# --- running it ------------------------------------------------------------------------------------------------
def _graceful_server_class():
    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn's server with Kiln's signal handling: the first SIGTERM/SIGINT drains (503 to new requests,
        in-flight ones finish), then the socket closes; a second one exits at once. Uvicorn's own handlers
        would close the socket at the first signal and re-raise it afterwards (exit 143)."""

        def __init__(self, config, state: ServingState, announce: Callable[[str], None]):
            super().__init__(config)
            self.kiln = state
            self.announce = announce

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            originals = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in originals.items():
                    signal.signal(sig, handler)

        def _on_signal(self, signum, frame):
            if self.kiln.draining:
                self.should_exit = self.force_exit = True
                return
            self.kiln.draining = True
            self.kiln.log(f"kiln serve: {signal.Signals(signum).name}: draining {self.kiln.in_flight} request(s) "
                          "in flight; new requests get 503")

        async def on_tick(self, counter: int) -> bool:
            if self.kiln.draining and self.kiln.in_flight == 0:
                return True
            return await super().on_tick(counter)

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started and getattr(self, "servers", None):
                port = self.servers[0].sockets[0].getsockname()[1]
                self.announce(f"kiln serve: {self.kiln.model_id} at http://{self.config.host}:{port}/v1 "
                              f"(max-num-seqs {self.kiln.config.max_num_seqs}, max-queue {self.kiln.config.max_queue}, "
                              f"{kv_pool_line(self.kiln.scheduler.cache)}, prefix caching "
                              f"{'on' if self.kiln.config.prefix_caching else 'off'})")

    return GracefulServer


def serve(artifact: Path | str, config: ServerConfig, announce: Callable[[str], None] | None = None) -> None:
    """Load `artifact` and serve it until SIGTERM/SIGINT has drained the requests in flight."""
    import uvicorn

    from kiln.runtime.engine import load

    artifact = Path(artifact)
    engine = load(artifact, device=config.device)
    say = announce or (lambda line: print(line, flush=True))
    if config.compile_decode:
        say("compiling the decode step (torch.compile; /health answers once it is done) ...")
        engine.compile_decode(mode="reduce-overhead" if engine.device.type == "cuda" else None)
    model_id = config.served_model_name or artifact.resolve().name
    app = create_app(engine, config, model_id)
    drafter = app.state.kiln.scheduler.drafter
    if drafter is not None:
        say(f"speculative decoding: {type(drafter).__name__}, up to {config.draft_tokens} drafts a step"
            + (f", a tree of {drafter.tree_width} per depth for greedy requests"
               if getattr(drafter, "tree_width", 1) > 1 else "")
            + ("; prefix caching off (the head reads every prompt position's features)"
               if drafter.needs_features and config.prefix_caching else ""))
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level="warning", access_log=False,
                               lifespan="on", timeout_graceful_shutdown=30)
    server = _graceful_server_class()(uv_config, app.state.kiln, say)
    try:
        server.run()
    except SystemExit as exc:  # uvicorn exits 1 when it cannot bind
        if exc.code not in (0, None):
            raise KilnError(f"cannot serve on {config.host}:{config.port} (see the line above)") from None
        raise
