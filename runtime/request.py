"""A request's life in the scheduler: its sampling settings, its state as it runs, and what each step emits.

    params = SamplingParams(max_tokens=64, temperature=0.7, top_p=0.9, seed=1, stop=("\n\n",))
    request = scheduler.add_request(prompt_ids, params)     # a Request (runtime.scheduler)
    request.output_ids, request.text, request.finish_reason, request.ttft, request.tpot

`QueueFull` is what `Scheduler.add_request` raises when the wait queue is full.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

from kiln.kernels.errors import KilnError
from kiln.runtime.detokenizer import IncrementalDetokenizer
from kiln.runtime.sampling import check_repetition_penalty


class QueueFull(KilnError):
    """The wait queue is full: the caller should retry later (a server answers 429)."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None  # the request's own generator; None: torch's global one
    stop: tuple[str, ...] = ()  # stop strings (the output is cut before the first one)
    stop_ids: tuple[int, ...] | None = None  # None: the model's EOS ids; () to ignore EOS
    repetition_penalty: float | None = None  # None: the engine's default (the artifact's generation config)

    def checked(self) -> SamplingParams:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise KilnError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, int | float) or not 0 <= self.temperature < float("inf"):
            raise KilnError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            raise KilnError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise KilnError(f"seed must be an integer, got {self.seed!r}")
        if self.repetition_penalty is not None:
            check_repetition_penalty(self.repetition_penalty)
        return self


@dataclass(eq=False)
class Request:
    id: Hashable
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    penalty: float
    stop_check: Callable[[list[int]], bool] | None = None  # token-level stop test (lm-eval's stop strings)
    output_ids: list[int] = field(default_factory=list)
    text: str = ""  # the output decoded (with a tokenizer), cut before a stop string
    emitted: int = 0  # characters of `text` already returned in StepEvents
    finish_reason: str | None = None  # "length", "eos", "stop" or "abort"
    num_computed: int = 0  # tokens of prompt + output held in the KV cache
    cached_tokens: int = 0  # of those, found in the prefix cache at (the last) admission
    preemptions: int = 0
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    generator: torch.Generator | None = None
    detokenizer: IncrementalDetokenizer | None = None

    def __post_init__(self):
        self.tokens: list[int] = self.prompt_ids + self.output_ids  # prompt + output, grown in place (read only)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first (None below two tokens or before the end)."""
        if self.finished_at is None or self.first_token_at is None or len(self.output_ids) < 2:
            return None
        return (self.finished_at - self.first_token_at) / (len(self.output_ids) - 1)


@dataclass
class StepEvent:
    """What one step did for one request: the tokens and text it added, and whether it finished."""

    request: Request
    token_ids: list[int]
    text: str
    finished: bool
