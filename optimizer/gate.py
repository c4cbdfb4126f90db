"""The accuracy gate: baseline vs candidate on held-out text, computed by the runtime's own numerics.

The candidate graph is lowered to the artifact's tensors, round-tripped through safetensors, and loaded by
`runtime.Engine` exactly as `runtime.load` would; no fake-quant stand-in. Metrics per the fixed protocol
(calibration.data): perplexity, mean per-token KL(baseline || candidate), top-1 agreement.
Recovery = ppl_baseline / ppl_candidate.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kiln.calibration.data import length_batches
from kiln.calibration.metrics import kl_terms
from kiln.kernels.errors import KilnError
from kiln.optimizer.lower import kv_cache_table, lower_tensors, roundtrip
from kiln.passes.base import GateResult, MetricResult, PassMetric
from kiln.passes.graph import ModelGraph
from kiln.runtime.engine import Engine

MAX_FLOOR = 1.5


def check_floor(floor: float | None, name: str = "--min-recovery") -> None:
    """A recovery floor is a fraction of the baseline: in (0, MAX_FLOOR]. None means the pass's default."""
    if floor is not None and not 0 < floor <= MAX_FLOOR:
        raise KilnError(f"{name} must be in (0, {MAX_FLOOR}], got {floor}")


def check_baseline(manifest: dict, baseline: ModelGraph) -> None:
    """Refuse a baseline that is not the artifact's recorded source (its safetensors files' sha256)."""
    recorded = (manifest.get("source") or {}).get("weight_files") or {}
    given = dict(baseline.source.weight_files)
    if not recorded:
        raise KilnError("the artifact's manifest records no source weight hashes, so its baseline cannot be "
                        "checked; pass --any-baseline to compare against BASELINE anyway")
    if given != recorded:
        raise KilnError(f"baseline {baseline.source.name} is not this artifact's source "
                        f"{manifest['source'].get('checkpoint')!s:.80}: its weight files' sha256 differ; pass the "
                        "checkpoint the artifact was built from, or --any-baseline to compare anyway")


def engine_from_graph(graph: ModelGraph, tokenizer=None) -> Engine:
    tensors, formats = lower_tensors(graph)
    return Engine(graph.spec, roundtrip(tensors), formats, tokenizer,
                               kv_cache=kv_cache_table(graph))


@dataclass
class Score:
    nll: float  # summed over tokens
    tokens: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.tokens)


def log_probs(engine: Engine, token_lists: Sequence[Sequence[int]], progress: Callable[[int], None] | None = None):
    """Yield (index, log-probs [n-1, V] for next tokens, targets [n-1]) per token list."""
    for batch in length_batches(token_lists, 8192):
        logits = engine.logits([token_lists[i] for i in batch])
        for i, lg in zip(batch, logits, strict=True):
            targets = torch.as_tensor(token_lists[i][1:], dtype=torch.long)
            yield i, torch.log_softmax(lg[:-1].float(), dim=-1), targets
        if progress is not None:
            progress(len(batch))


def score(engine: Engine, token_lists: Sequence[Sequence[int]], progress=None) -> Score:
    nll, count = 0.0, 0
    for _, lp, targets in log_probs(engine, token_lists, progress):
        nll -= float(lp.gather(1, targets[:, None]).sum())
        count += len(targets)
    return Score(nll, count)


class AccuracyGate:
    """Callable gate: holds the baseline's log-probs once, scores each candidate graph against them."""

    def __init__(self, baseline: Engine, token_lists: Sequence[Sequence[int]], progress=None):
        self.token_lists = list(token_lists)
        self.progress = progress
        self.baseline_lp: list[torch.Tensor | None] = [None] * len(self.token_lists)
        nll, count = 0.0, 0
        for i, lp, targets in log_probs(baseline, self.token_lists, progress):
            self.baseline_lp[i] = lp
            nll -= float(lp.gather(1, targets[:, None]).sum())
            count += len(targets)
        self.baseline = Score(nll, count)

    def compare(self, candidate: Engine, floor: float) -> GateResult:
        start = time.perf_counter()
        nll, kl, agree, count = 0.0, 0.0, 0, 0
        for i, lp, targets in log_probs(candidate, self.token_lists, self.progress):
            base = self.baseline_lp[i]
            nll -= float(lp.gather(1, targets[:, None]).sum())
            kl += float(kl_terms(base, lp).sum())
            agree += int((base.argmax(-1) == lp.argmax(-1)).sum())
            count += len(targets)
        return GateResult(
            perplexity=math.exp(nll / count), baseline_perplexity=self.baseline.perplexity,
            kl=kl / count, top1=agree / count, tokens=count, floor=floor,
            seconds=time.perf_counter() - start,
        )

    def __call__(self, graph: ModelGraph, floor: float, metrics: Sequence[PassMetric] = (),
                 before: ModelGraph | None = None) -> GateResult:
        start = time.perf_counter()
        candidate = engine_from_graph(graph)
        result = self.compare(candidate, floor)
        measured = ()
        if metrics:
            if before is None:
                raise ValueError("pass metrics are measured against the graph before the pass: pass `before`")
            reference = engine_from_graph(before)
            measured = tuple(MetricResult(m.name, float(m.measure(candidate, reference, self.token_lists)), m.floor,
                                          m.higher_is_better) for m in metrics)
        return dataclasses.replace(result, metrics=measured, seconds=time.perf_counter() - start)
