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

This module assembles the app (routes, error handlers, streaming) and runs it; the pieces are
runtime.openai_api (request and response bodies, errors), runtime.request_validation (a body -> token ids and
SamplingParams, or a 400), runtime.serving_state (ServerConfig; what the handlers share), runtime.engine_loop
(the engine thread) and runtime.server_metrics (/metrics).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from kiln.kernels.errors import KilnError
from kiln.runtime.background_compile import BackgroundCompile
from kiln.runtime.engine import load
from kiln.runtime.engine_loop import Choices, ClientGone, Delta
from kiln.runtime.openai_api import (
    DONE,
    OPENAI_FINISH,
    ApiError,
    ChatRequest,
    CompletionRequest,
    bad_request,
    chunk,
    completion_body,
    stream_error,
    usage,
)
from kiln.runtime.request_validation import ParsedRequest
from kiln.runtime.server_metrics import kv_pool_line
from kiln.runtime.serving_state import ServerConfig, ServingState


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
    _add_error_handlers(app)
    _add_routes(app, state)
    return app


# --- errors ----------------------------------------------------------------------------------------------------
def _error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _add_error_handlers(app: FastAPI) -> None:
    """Every error, FastAPI's and Starlette's included, is answered in OpenAI's shape."""

    @app.exception_handler(ApiError)
    async def api_error(request, exc: ApiError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        where = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            where, message = [], "the request body is not valid JSON"
        return _error_response(bad_request(f"{'.'.join(where) + ': ' if where else ''}{message}",
                                           where[0] if where else None))

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(ApiError(exc.status_code, str(exc.detail), kind))

    @app.exception_handler(Exception)
    async def internal_error(request, exc: Exception):  # a bug: Starlette re-raises it, uvicorn logs its traceback
        return _error_response(ApiError(500, f"internal error ({type(exc).__name__})", "server_error"))


# --- routes ----------------------------------------------------------------------------------------------------
def _add_routes(app: FastAPI, state: ServingState) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _answer(state, body, False, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        return await _answer(state, body, True, request)

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
        return {"status": "ok", "decode": "compiled" if state.engine.compiled else "eager"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


# --- completions -----------------------------------------------------------------------------------------------
def _admit(state: ServingState) -> None:
    if state.draining:
        raise ApiError(503, "the server is shutting down", "service_unavailable", code="draining",
                       headers={"Connection": "close"})
    if not state.engine_loop.alive:
        raise ApiError(503, "the engine is not running", "service_unavailable", code="engine_down")


class _EventStream(StreamingResponse):
    """SSE whose end, however it comes (finished, client gone, cancelled), aborts what is left and lets draining
    know."""

    def __init__(self, body: AsyncIterator[str], choices: Choices, state: ServingState):
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.choices = choices
        self.state = state

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:  # the bookkeeping first: the await below may be cancelled
            self.choices.abort("disconnect")
            self.state.in_flight -= 1
            await self.body_iterator.aclose()


async def _answer(state: ServingState, body, chat: bool, http_request: Request):
    """A completion or chat completion request: validated, queued, then answered whole or as a stream."""
    arrival = time.monotonic()
    _admit(state)
    prompts = [state.chat_prompt(body.messages)] if chat else state.completion_prompts(body.prompt)
    parsed = state.parse(body, prompts, chat)
    state.in_flight += 1
    handed_to_stream = False
    try:
        choices = state.submit(parsed, arrival)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        if parsed.stream:
            stream = _stream_chat(state, choices, parsed, rid, created) if chat else \
                _stream_completion(state, choices, parsed, rid, created)
            handed_to_stream = True
            return _EventStream(stream, choices, state)
        return await _answer_whole(state, choices, parsed, rid, created, chat, http_request)
    finally:
        if not handed_to_stream:
            state.in_flight -= 1


async def _answer_whole(state: ServingState, choices: Choices, parsed: ParsedRequest, rid: str, created: int,
                        chat: bool, http_request: Request):
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
    indices = range(len(parsed.params))
    return JSONResponse(completion_body(
        state.model_id, rid, created, chat, ["".join(texts[i]) for i in indices],
        [ends[i].finish_reason for i in indices], sum(len(p) for p in parsed.prompts),
        sum(d.completion_tokens for d in ends.values())))


async def _stream_completion(state: ServingState, choices: Choices, parsed: ParsedRequest, rid: str,
                             created: int) -> AsyncIterator[str]:
    completion = 0
    try:
        async for index, delta in choices.deltas():
            completion += delta.completion_tokens if delta.finished else 0
            if not delta.text and not delta.finished:
                continue
            reason = OPENAI_FINISH.get(delta.finish_reason, "stop") if delta.finished else None
            choice = {"index": index, "text": delta.text, "logprobs": None, "finish_reason": reason}
            yield chunk(state.model_id, rid, created, False, [choice], None, parsed.include_usage)
    except ApiError as exc:
        yield stream_error(exc)
        return
    if parsed.include_usage:
        yield chunk(state.model_id, rid, created, False, [], usage(sum(len(p) for p in parsed.prompts), completion),
                    True)
    yield DONE


async def _stream_chat(state: ServingState, choices: Choices, parsed: ParsedRequest, rid: str,
                       created: int) -> AsyncIterator[str]:
    def event(index: int, delta: dict, finish_reason: str | None) -> str:
        return chunk(state.model_id, rid, created, True, [{"index": index, "delta": delta, "logprobs": None,
                                                           "finish_reason": finish_reason}], None,
                     parsed.include_usage)

    completion = 0
    for index in range(len(parsed.params)):
        yield event(index, {"role": "assistant", "content": ""}, None)
    try:
        async for index, delta in choices.deltas():
            completion += delta.completion_tokens if delta.finished else 0
            if delta.text:
                yield event(index, {"content": delta.text}, None)
            if delta.finished:
                yield event(index, {}, OPENAI_FINISH.get(delta.finish_reason, "stop"))
    except ApiError as exc:
        yield stream_error(exc)
        return
    if parsed.include_usage:
        yield chunk(state.model_id, rid, created, True, [], usage(sum(len(p) for p in parsed.prompts), completion),
                    True)
    yield DONE


# --- running it ------------------------------------------------------------------------------------------------
class GracefulServer(uvicorn.Server):
    """uvicorn's server with Kiln's signal handling: the first SIGTERM/SIGINT drains (503 to new requests,
    in-flight ones finish), then the socket closes; a second one exits at once. Uvicorn's own handlers
    would close the socket at the first signal and re-raise it afterwards (exit 143)."""

    def __init__(self, config, state: ServingState, announce: Callable[[str], None],
                 background: BackgroundCompile | None = None):
        super().__init__(config)
        self.kiln = state
        self.announce = announce
        self.background = background  # started once the server listens, parked when it shuts down

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
            if self.background is not None:
                self.background.start()

    async def shutdown(self, sockets=None):
        if self.background is not None:
            self.background.stop()
        await super().shutdown(sockets)


def serve(artifact: Path | str, config: ServerConfig, announce: Callable[[str], None] | None = None) -> None:
    """Load `artifact` and serve it until SIGTERM/SIGINT has drained the requests in flight. If a background
    compile is still under way then, the process ends here with exit 0 (`_exit_if_compiling`)."""
    artifact = Path(artifact)
    engine = load(artifact, device=config.device)
    say = announce or (lambda line: print(line, flush=True))
    compile_mode = config.compile_mode
    if compile_mode == "before":
        say("compiling the decode step (torch.compile; /health answers once it is done) ...")
        engine.compile_decode(mode="reduce-overhead" if engine.device.type == "cuda" else None)
    model_id = config.served_model_name or artifact.resolve().name
    app = create_app(engine, config, model_id)
    state = app.state.kiln
    background = None
    if compile_mode == "background":
        background = BackgroundCompile(engine.compile_decode, state.scheduler.has_work, say)
    drafter = state.scheduler.drafter
    if drafter is not None:
        say(f"speculative decoding: {type(drafter).__name__}, up to {config.draft_tokens} drafts a step"
            + (f", a tree of {drafter.tree_width} per depth for greedy requests"
               if getattr(drafter, "tree_width", 1) > 1 else "")
            + ("; prefix caching off (the head reads every prompt position's features)"
               if drafter.needs_features and config.prefix_caching else ""))
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level="warning", access_log=False,
                               lifespan="on", timeout_graceful_shutdown=30)
    server = GracefulServer(uv_config, state, say, background)
    try:
        server.run()
    except SystemExit as exc:  # uvicorn exits 1 when it cannot bind
        if exc.code not in (0, None):
            raise KilnError(f"cannot serve on {config.host}:{config.port} (see the line above)") from None
        _exit_if_compiling(background)
        raise
    _exit_if_compiling(background)


def _exit_if_compiling(background: BackgroundCompile | None) -> None:
    """Served and drained, with a background compile still under way: end the process now (exit 0, output
    flushed). The compile thread may be inside torch's C++ code, and the interpreter's teardown around it can
    crash (a segfault in place of exit 0)."""
    if background is not None and background.running:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
