"""End-to-end tuning after calibration: the quantized linears' grid points and the norms fitted by KL to the
source model (`tune_end_to_end`), on the calibration text and samples the source writes (`source_samples`), if
its cost fits a budget (`over_budget`). Used by WeightQuantization and the precision passes."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kiln.calibration import progress
from kiln.calibration.data import token_cap
from kiln.calibration.grids import Scales
from kiln.calibration.quantize import stored_layout
from kiln.calibration.tuning import FakeQuantWeight, tune
from kiln.kernels.errors import KilnError
from kiln.passes.graph import ModelGraph

TUNE_BUDGETS = {"cpu": 2**40, "cuda": 2**50}
TUNE_BUDGET = TUNE_BUDGETS["cpu"]


def linear_weight_count(graph: ModelGraph) -> int:
    """Weight elements of every linear of the graph."""
    return sum(lin.out_features * lin.in_features for lin in graph.linears.values())


@dataclass
class TunedWeights:
    tensors: dict[str, dict[str, torch.Tensor]]  # linear -> its stored tensors after tuning (input_scale kept)
    norms: dict[str, torch.Tensor]  # norm weight name -> tuned fp32 weight
    note: str


def check_tune_budget(value: object, field_name: str = "tune_budget") -> None:
    if value is None:  # the device's (TUNE_BUDGETS)
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise KilnError(f"{field_name} must be a positive number (token-weights), got {value!r}")


def over_budget(graph: ModelGraph, steps: int, batch_tokens: int, budget: float | None, device: Any = "cpu",
                skipped: str = "not tuned", kind: str = "tuning", field_name: str = "tune_budget") -> str | None:
    """Why a distillation of `steps` x `batch_tokens` on this model's linear weights is skipped (its cost in
    token-weights is over `budget`, None: the budget of `device`, where the distillation runs; both models
    whole in fp32, step after step), or None when it fits."""
    place = torch.device(device).type
    if budget is None:
        budget = TUNE_BUDGETS.get(place, TUNE_BUDGET)
    weights = linear_weight_count(graph)
    cost = steps * batch_tokens * weights
    if cost <= budget:
        return None
    return (f"{skipped}: {steps} steps of {batch_tokens} tokens on {weights / 1e6:.1f}M weights is {cost:.2g} "
            f"token-weights, over the {kind} budget of {budget:.2g} on {place} ({field_name})")


SAMPLE_PROMPT_TOKENS = 4
# samples at most this many times the calibration paragraphs tuned on (stories260K: 6000 for 1500, the ratio
# measured): they widen the calibration text, and a small one (a test's) is not drowned in minutes of sampling
SAMPLES_PER_PARAGRAPH = 4


def source_samples(graph: ModelGraph, runner, count: int, seed: int = 0) -> list[list[int]]:
    """`count` paragraphs the model as it stands (the source, before a pass changes it) writes at temperature 1,
    each from the first SAMPLE_PROMPT_TOKENS tokens of a calibration paragraph (cycled; paragraph i sampled
    with seed + i), up to the calibration paragraphs' length (calibration.data.token_cap) or its end-of-sequence
    token. End-to-end tuning fits these beside the calibration text: the model's own distribution, as much of
    it as wanted, rather than the calibration paragraphs' few tokens over and over (held-out KL falls:
    benchmarks/results/precision.md)."""
    prompts = [list(t[:SAMPLE_PROMPT_TOKENS]) for t in runner.calibration_tokens if len(t) > SAMPLE_PROMPT_TOKENS]
    if not prompts or count <= 0:
        return []
    new = token_cap(graph.spec.max_position_embeddings) - SAMPLE_PROMPT_TOKENS
    if new <= 0:
        return []
    out: list[list[int]] = []
    chunk = 64
    with progress.stage("sample tuning text", total=count, unit="paragraphs") as task:
        for start in range(0, count, chunk):
            batch = [prompts[i % len(prompts)] for i in range(start, min(start + chunk, count))]
            made = runner.generate(graph, batch, new, temperature=1.0, seed=seed + start,
                                   stop_ids=graph.spec.eos_token_ids)
            out += [p + g for p, g in zip(batch, made, strict=True)]
            task.advance(len(batch))
    return out


def tune_end_to_end(graph: ModelGraph, session, names: list[str], steps: int, lr: float, batch_tokens: int,
                    log: Callable[[str], None], budget: float | None = None, embedding: bool = False,
                    extra_token_lists: Sequence[Sequence[int]] = ()) -> TunedWeights:
    """Tune the grid points (scales fixed) of the quantized linears `names`, each on its own format's grid,
    and the norms of their blocks and the final norm, by KL to the source model on the calibration text
    (`session.distillation`, calibration.tuning). The graph is not changed: the caller stores the result.
    `embedding`: the embedding's rows are tuned too (kept in its precision: they are stored back in its dtype),
    and so the lm_head's when it reads them (tied), unless that lm_head is quantized (the note says so).
    `extra_token_lists` are fitted beside the calibration paragraphs (source_samples).

    Nothing is tuned when steps x batch tokens x the model's linear weights exceed `budget` (None: the
    session's device's, TUNE_BUDGETS): the note says so."""
    device = session.device  # the latents and norms live where the distillation runs (the graph stays on the CPU)
    note = over_budget(graph, steps, batch_tokens, budget, device)
    if note is not None:
        log(note)
        return TunedWeights({}, {}, note)
    latents: dict[str, FakeQuantWeight] = {}
    for name in names:
        qw = graph.linears[name].quant
        layout = stored_layout(qw.format, qw.tensors)
        values = qw.dequantize()
        scales = layout.scales_from_stored(dict(qw.tensors), values.shape[0])
        scales = Scales(scales.multiplier.to(device), scales.stored)  # pack reads only the stored (CPU) scales
        latents[name] = FakeQuantWeight(layout, values.to(device), scales)
    layers = {graph.linears[n].layer for n in names if graph.linears[n].layer is not None}
    norm_names = [n for block in graph.blocks if block.index in layers for n in block.norms[:2]]
    norm_names.append(graph.final_norm)
    skipped = ""
    if embedding:
        head = graph.linears[graph.spec.lm_head.name]
        if head.tied_to == graph.embedding and head.quant is not None:
            skipped = "; the embedding is not tuned: the quantized lm_head reads it"
        elif graph.embedding_quant is not None:
            skipped = f"; the embedding is not tuned: it is stored {graph.embedding_quant.format} (embedding-quant)"
        else:
            norm_names.append(graph.embedding)
    norms = {n: torch.nn.Parameter(graph.tensors[n].to(device, torch.float32, copy=True)) for n in norm_names}
    objective = session.distillation(latents, norms, batch_tokens, extra_token_lists)
    # one CPU thread: the tuned grid points then do not depend on torch's thread count (calibration.tuning.tune)
    history = tune([fq.latent for fq in latents.values()] + list(norms.values()), objective.loss, steps, lr, log=log,
                   cpu_threads=1)
    tensors = {}
    for name, fq in latents.items():
        extra = {k: v for k, v in graph.linears[name].quant.tensors.items() if k == "input_scale"}
        tensors[name] = {**fq.layout.pack(fq.values().cpu(), fq.scales), **extra}
    samples = f" (calibration text + {len(extra_token_lists)} model samples)" if extra_token_lists else ""
    note = (f"tuned {steps} steps on {len(objective)} batches{samples}"
            f"{' with the embedding' if graph.embedding in norms else ''}: KL {history[0]:.5f} -> "
            f"{history[-1]:.5f} (last step){skipped}")
    return TunedWeights(tensors, {n: p.detach().to("cpu", copy=True) for n, p in norms.items()}, note)
