"""What a gated WeightQuantization hands from one attempt to its back-off steps: the calibration product of
each block (BlockProduct) and the calibration set's hidden states at block inputs, so that a step recalibrates
only what its newly kept linears change (CalibrationCache; passes.weight_quant.WeightQuantization.back_offs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kiln.passes.base import PassResult
from kiln.passes.graph import ModelGraph, QuantizedWeight

CHECKPOINT_BYTES = 1 << 30
"""A back-off's cache keeps the calibration set's hidden states at the input of every block, or of every k-th
block so that they fit this (SmolLM2-135M, 13082 observed tokens: 30 MB a block, every block kept; an 8B model's
4096-wide states: every 7th): a back-off step then resumes at its first recalibrated block (or at most k - 1
blocks before it) instead of replaying every block before it."""


@dataclass
class BlockProduct:
    """What calibrating one block (or the lm_head, `layer` None) left in the graph, before any tuning: the
    quant annotation of each linear it quantized, the tensor entries it replaced (AWQ folds: norms, producer
    rows, consumer columns; as stored, possibly spilled), and its lines of the result. `exact`: it is what a full
    calibration with the same keep list gives (every block before it was, and it was calibrated on the inputs
    they compute); False for a block a back_off_scope "touched" step kept after a recalibrated one, or
    recalibrated on an earlier attempt's inputs."""

    layer: int | None
    chosen: frozenset[str]  # the block's linears this calibration quantized
    quant: dict[str, QuantizedWeight]
    tensors: dict[str, object]  # graph.tensors overlay entries the block replaced
    changed: dict[str, str]
    metrics: dict[str, float]
    notes: list[str]
    idle: list[str]  # linears that saw no calibration token
    seconds: float
    checkpoint: Any = None  # the session's hidden states at this block's input (session.checkpoint), or None
    exact: bool = True


class CalibrationCache:
    """The calibration product of one gated WeightQuantization, carried from the first attempt to its back-offs
    (the pass keeps no state: `back_offs` hands this object to each config it yields, `reusing`).

    Calibration is sequential: block i is calibrated on the outputs of blocks 0..i-1 as quantized. Keeping a
    linear of block f back in source precision changes block f and so the inputs of every block after it, but
    nothing before it. A back-off attempt restores the stored product (quant annotations, AWQ-folded tensors,
    result lines) of every block it need not redo, and calibrates the others from the kept inputs of the
    attempt before (the session's checkpoints):

    - back_off_scope "downstream": the blocks from f on are redone. The step stores exactly what a full
      calibration with the same keep list stores, and costs as much as the blocks from f on.
    - "touched" (the default): only the blocks whose chosen linears differ are redone, each on the inputs the
      attempt before gave it; the blocks after them keep their product. The step keeps its linears as
      `back_off_keep`, whose definition is exactly that (the inputs are those of the calibration without
      them), so the config rebuilds it. A full calibration with them in `keep` would round some weights of
      the later blocks the other way (benchmarks/results/backoff.md measures how many); the step costs its
      touched blocks only. Each block product says whether it is what that full calibration gives
      (BlockProduct.exact), so a later "downstream" attempt (ship_exact's: WeightQuantization.shipping)
      redoes the blocks from the first one that is not.

    End-to-end tuning (tune_steps) fits every block at once, so it is redone whole, from the attempt's
    untuned product.

    `blocks` is the latest attempt's product (each back-off only adds kept linears, so the latest shares the
    most blocks with the next); `start` the graph the first attempt started from (every attempt starts from
    the same snapshot: a cache for another graph is not used)."""

    def __init__(self, config_key: tuple, start: tuple, blocks: list[BlockProduct], seconds: float):
        self.config_key = config_key
        self.start = start
        self.blocks = blocks
        self.first_seconds = seconds  # the first attempt's calibration (the block loop; tuning not counted)
        self.steps = 0  # back-off attempts that used it

    def matches(self, config_key: tuple, start: tuple) -> str | None:
        """Why this cache cannot serve an attempt with `config_key` on a graph in state `start`, or None."""
        if config_key != self.config_key:
            return "its config differs beyond the keep list"
        if not same_state(start, self.start):
            return "the graph is not the one it was calibrated on"
        return None

    def clear(self) -> None:
        self.blocks = []

    def reusable(self, order: Sequence[int | None], chosen: Mapping[int | None, frozenset[str]],
                 downstream: bool) -> dict[int | None, BlockProduct]:
        """The blocks of `order` whose product this cache holds for exactly the linears `chosen` quantizes in them,
        by layer: `downstream`, only the leading exact ones (their inputs are then the same too: every block before
        them is); otherwise every one (a block after a recalibrated one keeps the product of its earlier
        inputs)."""
        cached = {block.layer: block for block in self.blocks}
        reused = {}
        for layer in order:
            block = cached.get(layer)
            if block is not None and block.chosen == chosen[layer] and (block.exact or not downstream):
                reused[layer] = block
            elif downstream:
                break
        return reused

    def resume(self, session, position: int, exact: bool) -> tuple[int | None, bool]:
        """Have `session` stand at the latest kept block input at or before `position` (a block to recalibrate),
        rather than replay every block before it from the embedding: the position it stands at, or None (no
        checkpoint served: the session goes on from where it stands), and whether the resume was exact. `exact`:
        only where the graph holds what those blocks computed with (the session checks by identity; restored
        objects are the same) and the states were computed so; otherwise at the earlier attempt's inputs,
        whatever changed since (RuntimeCalibrationSession.resume), exactly where they still hold."""
        resume = getattr(session, "resume", None)
        found = [b.checkpoint for b in self.blocks if b.checkpoint is not None and b.checkpoint.position <= position]
        for checkpoint in sorted(found, key=lambda c: -c.position) if resume is not None else ():
            if resume(checkpoint, exact=True):
                return checkpoint.position, True
            if not exact and resume(checkpoint, exact=False):
                return checkpoint.position, False
        return None, True



def graph_state(graph: ModelGraph) -> tuple:
    """What an attempt starts from, by identity (passes replace tensors and annotations, never mutate them)."""
    t = graph.tensors
    return (graph.spec, t.base, dict(t.overlay), frozenset(t.removed),
            {name: lin.quant for name, lin in graph.linears.items()})


def same_state(a: tuple, b: tuple) -> bool:
    spec_a, base_a, overlay_a, removed_a, quant_a = a
    spec_b, base_b, overlay_b, removed_b, quant_b = b
    return (spec_a is spec_b and base_a is base_b and removed_a == removed_b
            and overlay_a.keys() == overlay_b.keys() and all(overlay_a[k] is overlay_b[k] for k in overlay_a)
            and quant_a.keys() == quant_b.keys() and all(quant_a[k] is quant_b[k] for k in quant_a))


def block_label(layer: int | None) -> str:
    return "lm_head" if layer is None else str(layer)


def block_span(layers: Sequence[int | None]) -> str:
    """Blocks in calibration order as runs: "0..3", "0..1, 28..29, lm_head"."""
    if not layers:
        return "none"
    runs: list[list[int | None]] = []
    for layer in layers:
        last = runs[-1][-1] if runs else None
        if runs and layer is not None and last is not None and layer == last + 1:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return ", ".join(block_label(r[0]) if len(r) == 1 else f"{block_label(r[0])}..{block_label(r[-1])}"
                     for r in runs)


def restore_block(graph: ModelGraph, block: BlockProduct, result: PassResult, idle: list[str]) -> BlockProduct:
    """Put a cached block's product back: the same annotation and tensor objects, so the calibration session's
    fingerprints (identity) see the graph the attempt before saw."""
    graph.tensors.overlay.update(block.tensors)
    for name, qw in block.quant.items():
        graph.linears[name].quant = qw
    result.changed.update(block.changed)
    result.metrics.update(block.metrics)
    result.notes.extend(block.notes)
    idle.extend(block.idle)
    return block
