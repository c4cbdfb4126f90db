"""What the server's handlers share: its configuration, the scheduler and its engine thread, metrics, request
validation, and the draining flag.

    config = ServerConfig(max_num_seqs=8, request_timeout=60)    # every field checked, the bad value named
    state = ServingState(engine, config, "s260k", log=print)
    choices = state.submit(state.parse(body, state.completion_prompts(body.prompt), chat=False), time.monotonic())

Bounds: the wait queue (`max_queue`; a full queue answers 429 with Retry-After) plus the fixed KV block pool; a
request that could never fit the context or the pool is refused with 400 (RequestParser) before it queues.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from kiln.kernels.errors import KilnError
from kiln.runtime.engine_loop import Choices, EngineLoop
from kiln.runtime.openai_api import ApiError, bad_request
from kiln.runtime.request_validation import ParsedRequest, RequestParser
from kiln.runtime.scheduler import QueueFull, Scheduler, draft_pool_blocks
from kiln.runtime.server_metrics import ServerMetrics
from kiln.runtime.speculative import check_draft_tokens, check_tree_width

RETRY_AFTER_SECONDS = 1
COMPILE_MODES = ("auto", "background", "before", "off")


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
    # torch.compile of the decode step: "background" (compiled on a second thread while requests are answered
    # eagerly; runtime.background_compile), "before" (before the server listens: minutes of start-up), "off",
    # or "auto": background on the CPU, off on a GPU (CUDA graphs are captured before serving: "before")
    compile_decode: str = "auto"
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

    @property
    def compile_mode(self) -> str:
        """`compile_decode` with "auto" resolved for the device."""
        if self.compile_decode != "auto":
            return self.compile_decode
        return "background" if self.device == "cpu" else "off"

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
        if self.compile_decode not in COMPILE_MODES:
            raise KilnError(f"--compile must be one of {', '.join(COMPILE_MODES)}, got {self.compile_decode!r}")
        if self.compile_decode == "background" and self.device != "cpu":
            raise KilnError("--compile background runs on the CPU only (a GPU captures CUDA graphs, which must not "
                            "share the device with serving): use --compile before or off")
        if self.speculative not in (None, "auto", "head", "prompt-lookup"):
            raise KilnError(f"--speculative must be auto, head or prompt-lookup, got {self.speculative!r}")
        check_draft_tokens(self.draft_tokens)
        if self.tree_width is not None:
            check_tree_width(self.tree_width)


class ServingState(RequestParser):
    """What the app's handlers share: the engine, its scheduler thread, metrics, and the draining flag; it
    validates requests as a RequestParser of this server's limits."""

    def __init__(self, engine, config: ServerConfig, model_id: str, log: Callable[[str], None]):
        self.engine = engine
        self.config = config
        pool = draft_pool_blocks(config.num_blocks or engine.kv_cache_blocks, config.max_num_seqs,
                                 config.draft_tokens, engine.kv_block_size)
        drafter = (engine.drafter(config.speculative, tree_width=config.tree_width, num_blocks=pool)
                   if config.speculative is not None else None)
        self.scheduler = Scheduler(engine, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens, max_queue=config.max_queue,
                                   prefix_caching=config.prefix_caching, num_blocks=config.num_blocks,
                                   tokenizer=engine.tokenizer, drafter=drafter, draft_tokens=config.draft_tokens)
        self.metrics = ServerMetrics(config.ttft_slo, config.tpot_slo)
        self.metrics.decode_compiled.set_function(lambda: float(engine.compiled))
        self.engine_loop = EngineLoop(self.scheduler, self.metrics, log)
        context = engine.spec.max_position_embeddings
        # the most tokens (prompt + output) one request may hold: the context, and what the pool holds of one
        # sequence, its sliding-window layers keeping only their windows (the last token is sampled, never written)
        step = 1 + self.scheduler._width_of(self.scheduler.draft_tokens)
        max_request_tokens = min(context, self.scheduler.cache.max_sequence_tokens(step) + 1)
        super().__init__(engine.tokenizer, engine.spec.vocab_size, context, max_request_tokens, config.max_queue,
                         model_id, log)
        self.draining = False
        self.in_flight = 0
        self.created = int(time.time())

    def submit(self, parsed: ParsedRequest, arrival: float) -> Choices:
        """Queue each choice of `parsed`; a full queue is a 429 (the choices queued already are aborted)."""
        deadline = None if self.config.request_timeout is None else arrival + self.config.request_timeout
        choices = Choices(self.engine_loop, self.metrics, deadline, self.config.request_timeout)
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
            raise bad_request(str(exc)) from None
        return choices
