"""What the scheduler and speculative decoding need of a model runner, as typing protocols.

    def speculative_generate(runner: Runner, ...): ...      # runtime.speculative
    Scheduler(engine: ServingRunner, ...)                   # runtime.scheduler

`ModelRunner` (runtime.model_runner) is a `Runner`; `Engine` (runtime.engine) is a `ServingRunner`: its runner's
forwards and pools, plus the tokenizer and the repetition penalty a request falls back to. Anything else with
these members serves too (a test double, a runner on another backend).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from kiln.runtime.paged_kv_cache import PagedKVCache
from kiln.runtime.spec import ModelSpec


class Runner(Protocol):
    spec: ModelSpec
    device: torch.device
    kv_cache_blocks: int  # the size of `kv_pool`, and of a scheduler's own pool by default

    @property
    def kv_pool(self) -> PagedKVCache:
        """The block pool generation serves from."""

    def new_kv_cache(self, num_blocks: int, block_size: int | None = None,
                     prefix_caching: bool = False) -> PagedKVCache:
        """An empty paged cache in the model's KV formats."""

    def decode_logits(self, tokens: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """tokens, positions [B, 1] prepared in `cache` -> logits [B, V]."""

    def features(self, tokens: torch.Tensor, positions: torch.Tensor, cache, collect: tuple[int, ...] = ()):
        """tokens, positions [B, T] prepared in `cache` -> the last layer's output before the final norm
        [B, T, C]; with `collect`, (that, those layers' outputs concatenated)."""

    def logits_from_features(self, features: torch.Tensor) -> torch.Tensor:
        """The final norm and the lm_head: [..., C] -> [..., V]."""

    def prefill_rows(self, cache: PagedKVCache, rows: Sequence, prompts: Sequence[Sequence[int]],
                     collect: tuple[int, ...] | None = None):
        """The logits after each prompt of `rows` [B, V]; with `collect`, (logits, features, collected)."""


class ServingRunner(Runner, Protocol):
    tokenizer: object  # None without one (requests with stop strings are refused)
    repetition_penalty: float  # a request's when its SamplingParams names none
