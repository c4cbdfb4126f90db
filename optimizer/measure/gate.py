"""The accuracy gate: baseline vs candidate on held-out text, computed by the runtime's own numerics.

The candidate graph is lowered to the artifact's tensors, round-tripped through safetensors, and loaded by
`runtime.Engine` exactly as `runtime.load` would; no fake-quant stand-in. Metrics per the fixed protocol
(calibration.data): perplexity, mean per-token KL(baseline || candidate), top-1 agreement.
Recovery = ppl_baseline / ppl_candidate.

Sizes: full-vocabulary logits never exist for more than head_rows(V) positions at once (32 MiB of them). The
baseline keeps its final hidden states ([tokens, hidden] fp32, exact: its logits are one lm_head away) and its
lm_head (without a oneDNN copy: at Gemma 3's 262K vocabulary that copy is 671 MB for a whole build); a
candidate's hidden states are computed a batch at a time, and both heads are applied side by side to the same
positions, where NLL, KL and top-1 are reduced. Per scored token the baseline costs hidden x 4 bytes
(16 KiB at hidden 4096) instead of vocabulary x 4 (512 KiB at 128K): the figures are the same, up to the order
of float summation.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kiln.calibration.data import FORWARD_BATCH_TOKENS, length_batches
from kiln.calibration.metrics import kl_terms
from kiln.calibration.progress import stage
from kiln.kernels.errors import KilnError
from kiln.optimizer.lower import kv_cache_table, lower_tensors, roundtrip
from kiln.passes.base import Pass
from kiln.passes.gate_result import GateResult, MetricResult, PassMetric
from kiln.passes.graph import ModelGraph
from kiln.runtime.engine import Engine
from kiln.runtime.linear import QuantLinear

MAX_FLOOR = 1.5


def check_floors(min_recovery: float | None = None, max_kl: float | None = None,
                 min_top1: float | None = None) -> None:
    """Floors a user sets; None means each pass's default. A recovery floor is a fraction of the baseline, in
    (0, MAX_FLOOR]; a KL ceiling is nats per token, >= 0; a top-1 floor is a fraction of positions, in [0, 1]."""
    if min_recovery is not None and not 0 < min_recovery <= MAX_FLOOR:
        raise KilnError(f"--min-recovery must be in (0, {MAX_FLOOR}], got {min_recovery}")
    if max_kl is not None and not 0 <= max_kl < math.inf:
        raise KilnError(f"--max-kl must be a finite number of nats per token >= 0, got {max_kl}")
    if min_top1 is not None and not 0 <= min_top1 <= 1:
        raise KilnError(f"--min-top1 must be in [0, 1], got {min_top1}")


def check_baseline(manifest: dict, baseline: ModelGraph, log: Callable[[str], None] = lambda message: None) -> None:
    """Refuse a baseline that is not the artifact's recorded source: its safetensors files' sha256 and its
    config.json's (loader.config_digest) must both match, since the same weights under another config (rope_theta,
    norm eps, ...) are another model. An artifact built before the config's hash was recorded is checked on its
    weights alone, and `log` hears a warning saying so."""
    source = manifest.get("source") or {}
    recorded = source.get("weight_files") or {}
    given = dict(baseline.source.weight_files)
    if not recorded:
        raise KilnError("the artifact's manifest records no source weight hashes, so its baseline cannot be "
                        "checked; pass --any-baseline to compare against BASELINE anyway")
    where = f"baseline {baseline.source.name!s:.80} is not this artifact's source {source.get('checkpoint')!s:.80}"
    if given != recorded:
        raise KilnError(f"{where}: its weight files' sha256 differ; pass the checkpoint the artifact was built from, "
                        "or --any-baseline to compare anyway")
    config = source.get("config_sha256")
    if config is None:
        log("warning: the artifact's manifest records no hash of its source's config.json (built before Kiln "
            "recorded one): the baseline is checked on its weights only")
    elif config != baseline.source.config_sha256:
        raise KilnError(f"{where}: the weights match but its config.json differs (sha256 {config[:12]}... recorded, "
                        f"{str(baseline.source.config_sha256)[:12]}... given); pass the checkpoint the artifact was "
                        "built from, or --any-baseline to compare anyway")


def artifact_floors(manifest: dict) -> tuple[float, float]:
    """(KL ceiling, top-1 floor) for an artifact against its source: the floors its passes were held to, added
    up as the gate adds them (KL adds; so does the top-1 agreement each pass may lose). A pass that changed the
    model without a recorded gate counts with the defaults of a pass that declares none."""
    max_kl, lost_top1 = 0.0, 0.0
    for record in manifest.get("passes") or []:
        if record.get("decision") == "reverted":
            continue
        gate = record.get("gate") or {}
        kl, top1 = gate.get("max_kl"), gate.get("min_top1")
        max_kl += float(kl) if isinstance(kl, int | float) else Pass.default_max_kl
        lost_top1 += 1.0 - (float(top1) if isinstance(top1, int | float) else Pass.default_min_top1)
    return round(max_kl, 9), round(max(0.0, 1.0 - lost_top1), 9)  # 0.06 + 0.09 is 0.15, not 0.15000000000000002


def engine_from_graph(graph: ModelGraph, tokenizer=None, device: torch.device | str = "cpu",
                      dtype: torch.dtype | None = None, onednn_head: bool = True) -> Engine:
    """The graph as the runtime runs it once lowered (`device`, `dtype`, `onednn_head`: see runtime.Engine)."""
    tensors, formats = lower_tensors(graph)
    return Engine(graph.spec, roundtrip(tensors), formats, tokenizer, kv_cache=kv_cache_table(graph),
                  device=device, dtype=dtype, onednn_head=onednn_head)


HEAD_CHUNK = 128
"""Most positions whose full-vocabulary logits (and log-softmax) exist at once: [HEAD_CHUNK, V] fp32 is 24 MiB
at SmolLM2's 49K vocabulary (under glibc's 32 MiB, so reused from the heap: see calibration.data.
FORWARD_BATCH_TOKENS), whatever the amount of text scored. Larger vocabularies take fewer (`head_rows`)."""
HEAD_CHUNK_BYTES = 32 << 20
"""Bytes of one chunk's fp32 log-probs: [32, 262144] at Gemma 3's vocabulary, 65 rows at Llama 3's 128,256."""


def head_rows(vocab_size: int) -> int:
    """Positions per head chunk: HEAD_CHUNK, fewer where [rows, vocab_size] fp32 would pass HEAD_CHUNK_BYTES
    (at least 8, so a huge vocabulary still multiplies a few rows at a time)."""
    return min(HEAD_CHUNK, max(8, HEAD_CHUNK_BYTES // (4 * vocab_size)))
BATCH_TOKENS = FORWARD_BATCH_TOKENS
"""Tokens (padding included) per forward batch; the batch's hidden states are [BATCH_TOKENS, hidden]."""

FOREIGN_PERPLEXITY_FRACTION = 1 / 8
"""A text is foreign to a model whose perplexity on it exceeds this fraction of the vocabulary size. Perplexity P
means the model is as unsure as a uniform choice among P tokens; above V/8 it knows less than 3 bits per token
more than a uniform guess over its V-token vocabulary (random tokens score about V or worse). On such text
recovery, KL and top-1 compare near-uniform guesses and can pass anything (MXFP4 scored "recovery" 1.07 on
one). For scale: stories260K on TinyStories ~5 of 512 (limit 64), on this repository's README ~430; SmolLM2
~15 of 49152 (limit 6144)."""


@dataclass(frozen=True)
class Check:
    """One pass/fail figure of `optimize gate`, as CI reports it (one JSON entry, one JUnit test case).
    `relation` says how `value` is held to `floor`: ">=" a floor, "<=" a ceiling."""

    name: str
    value: float
    floor: float
    relation: str = ">="
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.value >= self.floor if self.relation == ">=" else self.value <= self.floor

    @property
    def failure(self) -> str:
        """The phrase CI prints when the check fails."""
        return (f"{self.name} {self.value:.5g} is "
                f"{'below the floor' if self.relation == '>=' else 'above the ceiling'} {self.floor:g}")

    def as_json(self) -> dict:
        return {"name": self.name, "value": self.value, "floor": self.floor, "relation": self.relation,
                "passed": self.passed, "detail": self.detail}


@dataclass
class Score:
    nll: float  # summed over tokens
    tokens: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.tokens)


def check_native_text(perplexity: float, vocab_size: int, what: str, force: bool = False,
                      log: Callable[[str], None] = lambda message: None) -> None:
    """Refuse to gate or score on text the model cannot read: `perplexity` (the model's own, on `what`) above
    FOREIGN_PERPLEXITY_FRACTION of `vocab_size`. With `force`, only warn."""
    limit = vocab_size * FOREIGN_PERPLEXITY_FRACTION
    if perplexity <= limit:
        return
    message = (f"{what} is foreign to the model: its perplexity {perplexity:.4g} is above {limit:g} (1/8 of the "
               f"vocabulary of {vocab_size} tokens), where accuracy figures mean nothing")
    if not force:
        raise KilnError(f"{message}; give text like the model's training data, or --force to score it anyway")
    log(f"warning: {message}; scoring it anyway (--force)")


def next_token_states(engine: Engine, token_lists: Sequence[Sequence[int]],
                      progress: Callable[[int], None] | None = None):
    """Per forward batch: (indices of its lists, final hidden states [N, C] of every position that predicts a
    next token, their targets [N]); rows are the lists' positions, list after list in `indices` order."""
    with stage("score", total=len(token_lists), unit="paragraphs") as task:
        for batch in length_batches(token_lists, BATCH_TOKENS):
            hidden = engine.hidden_states([token_lists[i] for i in batch])
            states = torch.cat([h[:-1] for h in hidden])
            yield (batch, states, torch.cat([torch.as_tensor(token_lists[i][1:], dtype=torch.long)
                                             for i in batch]).to(states.device))
            task.advance(len(batch))
            if progress is not None:
                progress(len(batch))


@torch.inference_mode()
def head_log_probs(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, vocab_size: int):
    """Yield (rows, log-probs [<= head_rows(V), V]) of `head` applied to `hidden` [N, C], chunk by chunk."""
    step = head_rows(vocab_size)
    for start in range(0, hidden.shape[0], step):
        rows = slice(start, start + step)
        yield rows, torch.log_softmax(head(hidden[rows]).float(), dim=-1)


def score(engine: Engine, token_lists: Sequence[Sequence[int]], progress=None) -> Score:
    nll, count = 0.0, 0
    for _, hidden, targets in next_token_states(engine, token_lists, progress):
        for rows, lp in head_log_probs(engine.head_logits, hidden, engine.spec.vocab_size):
            nll -= float(lp.gather(1, targets[rows, None]).sum())
        count += len(targets)
    return Score(nll, count)


BOOTSTRAP_RESAMPLES = 2000
MAX_RESAMPLES = 100_000
"""Most bootstrap resamples: time grows with resamples x documents, and one statistic per resample is kept
(10^11 asked for 745 GiB); the CLI's --resamples holds the same bound."""
BOOTSTRAP_SEED = 0
CONFIDENCE = 0.95


def recovery_interval(baseline_nll: Sequence[float], candidate_nll: Sequence[float], tokens: Sequence[int],
                      resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED,
                      confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Percentile interval on recovery = exp(-(NLL_candidate - NLL_baseline) / tokens) by a paired bootstrap
    over documents: each resample draws len(tokens) documents with replacement and keeps each one's baseline
    and candidate NLL together, so what the two models share (a hard document is hard for both) cancels.
    Deterministic for a given seed (numpy's PCG64)."""
    if isinstance(resamples, bool) or not isinstance(resamples, int) or not 1 <= resamples <= MAX_RESAMPLES:
        raise KilnError(f"--resamples must be an integer in [1, {MAX_RESAMPLES}], got {resamples!r}")
    diff = np.asarray(candidate_nll, dtype=np.float64) - np.asarray(baseline_nll, dtype=np.float64)
    counts = np.asarray(tokens, dtype=np.float64)
    if diff.shape != counts.shape or diff.ndim != 1 or len(diff) == 0:
        raise ValueError("one NLL pair and one token count per document are needed")
    rng = np.random.default_rng(seed)
    stats = np.empty(resamples)
    block = max(1, 2**22 // len(diff))  # resamples per draw: [block, documents] indices stay under 32 MiB
    for start in range(0, resamples, block):
        picks = rng.integers(0, len(diff), size=(min(block, resamples - start), len(diff)))
        stats[start:start + len(picks)] = np.exp(-diff[picks].sum(1) / counts[picks].sum(1))
    tail = (1 - confidence) / 2
    low, high = np.quantile(stats, [tail, 1 - tail])
    return float(low), float(high)


class AccuracyGate:
    """Callable gate: holds the baseline's final hidden states and lm_head once, and scores each candidate graph
    against them, baseline and candidate logits side by side a HEAD_CHUNK of positions at a time.

    Only the baseline's lm_head is kept, not its model, so a build holds one model beside the candidate's.
    Candidates are built on the baseline engine's device, in its compute dtype."""

    def __init__(self, baseline: Engine, token_lists: Sequence[Sequence[int]], progress=None,
                 resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED, keep: Sequence[torch.Tensor] = ()):
        # `keep`: graph tensors to hold for the gate's life (the embedding the baseline's tied head reads): a
        # graph's tensor store hands out the same tensor while someone holds it, so every candidate lowered
        # from it shares those bytes instead of reading a copy (671 MB at Gemma 3's 262K x 640)
        self._kept = tuple(keep)
        self.token_lists = list(token_lists)
        self.progress = progress
        self.resamples, self.seed = resamples, seed
        self.device, self.dtype = baseline.device, baseline.dtype  # each candidate runs where the baseline did
        self.baseline_head = baseline.model.lm_head
        if isinstance(self.baseline_head, QuantLinear):
            self.baseline_head.drop_onednn()  # kept for the build's whole length: its dense weight suffices
        self.vocab_size = baseline.spec.vocab_size
        self.baseline_hidden: list[torch.Tensor | None] = [None] * len(self.token_lists)  # [n-1, C] per list
        self.scored = np.array([len(t) - 1 for t in self.token_lists])  # tokens scored per document
        self.baseline_nll = np.zeros(len(self.token_lists))  # per document, for the paired bootstrap
        for batch, hidden, targets in next_token_states(baseline, self.token_lists, progress):
            start = 0
            for i in batch:
                self.baseline_hidden[i] = hidden[start:start + len(self.token_lists[i]) - 1]
                start += len(self.token_lists[i]) - 1
            nll = torch.cat([-lp.gather(1, targets[rows, None])[:, 0]
                             for rows, lp in head_log_probs(self.baseline_head, hidden, self.vocab_size)])
            self._add_per_document(self.baseline_nll, batch, nll)
        self.baseline = Score(float(self.baseline_nll.sum()), int(self.scored.sum()))

    def _add_per_document(self, into: np.ndarray, batch: Sequence[int], per_token: torch.Tensor) -> None:
        """Sum a batch's per-token figures ([N], documents one after another in `batch` order) per document."""
        sums = torch.split(per_token.double(), [int(self.scored[i]) for i in batch])
        for i, part in zip(batch, sums, strict=True):
            into[i] += float(part.sum())

    def compare(self, candidate: Engine, floor: float, max_kl: float | None = None,
                min_top1: float | None = None) -> GateResult:
        """Score `candidate` against the baseline (its lm_head loses any oneDNN copy: both heads multiply from
        their dense weights, so an unchanged model compares equal bit for bit)."""
        start = time.perf_counter()
        if isinstance(candidate.model.lm_head, QuantLinear):
            candidate.model.lm_head.drop_onednn()
        kl, agree = 0.0, 0
        nll = np.zeros(len(self.token_lists))
        for batch, hidden, targets in next_token_states(candidate, self.token_lists, self.progress):
            base_hidden = torch.cat([self.baseline_hidden[i] for i in batch])
            token_nll = []
            for (rows, lp), (_, base) in zip(head_log_probs(candidate.head_logits, hidden, self.vocab_size),
                                             head_log_probs(self.baseline_head, base_hidden, self.vocab_size),
                                             strict=True):
                token_nll.append(-lp.gather(1, targets[rows, None])[:, 0])
                kl += float(kl_terms(base, lp).sum())
                agree += int((base.argmax(-1) == lp.argmax(-1)).sum())
            self._add_per_document(nll, batch, torch.cat(token_nll))
        count = self.baseline.tokens
        return GateResult(
            perplexity=math.exp(nll.sum() / count), baseline_perplexity=self.baseline.perplexity,
            kl=kl / count, top1=agree / count, tokens=count, floor=floor, max_kl=max_kl, min_top1=min_top1,
            seconds=time.perf_counter() - start,
            recovery_interval=recovery_interval(self.baseline_nll, nll, self.scored, self.resamples, self.seed),
        )

    def __call__(self, graph: ModelGraph, floor: float, metrics: Sequence[PassMetric] = (),
                 before: ModelGraph | None = None) -> GateResult:
        start = time.perf_counter()
        candidate = engine_from_graph(graph, device=self.device, dtype=self.dtype, onednn_head=False)
        result = self.compare(candidate, floor)
        measured = ()
        if metrics:
            if before is None:
                raise ValueError("pass metrics are measured against the graph before the pass: pass `before`")
            reference = engine_from_graph(before, device=self.device, dtype=self.dtype)
            measured = tuple(MetricResult(m.name, float(m.measure(candidate, reference, self.token_lists)), m.floor,
                                          m.higher_is_better) for m in metrics)
        return dataclasses.replace(result, metrics=measured, seconds=time.perf_counter() - start)
