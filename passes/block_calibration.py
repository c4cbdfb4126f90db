"""How weight quantization calibrates (passes/weight_quant.py): block by block, stage by stage, on the
calibration text, reusing what a back-off's attempt before calibrated.

`BlockCalibration` holds the calibrated path of `WeightQuantization`, whose config it reads; the pass's own
module keeps its fields, their checks, the data-free path and back-off. Per block (the lm_head last):
AWQ's folds (passes/awq_fold.py), then each stage (linear_quant.STAGES) observed through the stages quantized
before it (true_sequential) or all at once, and quantized (GPTQ consumes each Hessian); what the block left in
the graph is a `BlockProduct`, which a back-off attempt restores instead of recomputing (CalibrationCache).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import replace

import torch

from kiln.calibration import progress
from kiln.calibration.observers import InputObserver
from kiln.calibration.quantize import static_input_scale
from kiln.kernels.errors import KilnError
from kiln.passes.awq_fold import awq_block
from kiln.passes.base import CalibrationSession, PassContext, PassResult
from kiln.passes.calibration_cache import (
    CHECKPOINT_BYTES,
    BlockProduct,
    CalibrationCache,
    block_span,
    restore_block,
)
from kiln.passes.graph import Linear, ModelGraph
from kiln.passes.linear_quant import (
    quantize_linear_weight,
    quantize_sibling_weights,
    sibling_leaders,
    stage_of,
)
from kiln.passes.tensor_store import release_freed_memory


class BlockCalibration:
    """The calibrated path of WeightQuantization (a mixin: `self` is the pass, its fields the config)."""

    def _calibrate(self, graph: ModelGraph, ctx: PassContext, chosen: list[Linear], result: PassResult,
                   start_state: tuple) -> None:
        """Quantize `chosen` block by block on the calibration text (`ctx.runner`), then tune end to end."""
        session = ctx.runner.session(graph)  # before anything changes: its source is the distillation teacher
        observe = session if self.sequential else ctx.runner.session(_unquantized_view(graph))
        by_layer: dict[int | None, list[Linear]] = {}
        for lin in chosen:
            by_layer.setdefault(lin.layer, []).append(lin)
        idle: list[str] = []
        order = sorted(by_layer, key=lambda i: (i is None, i or 0))
        reused = self._reused_blocks(order, by_layer, start_state, ctx)
        products: list[BlockProduct] = []
        stride = 0  # keep the block inputs of every stride-th block (CHECKPOINT_BYTES); 0: not known yet
        calibration_start = time.perf_counter()
        redone: list[int | None] = []
        exact = True  # every block so far is what a full calibration with this keep list gives (BlockProduct.exact)
        replayed = self._replayed_blocks(graph, order)
        for layer in progress.track(order, f"{self.name}: calibrate {self.format}", unit="blocks"):
            # a back_off_keep block whose replayed inputs run through a block redone here is redone too
            stale = layer in replayed and bool(redone) and _position(graph, redone[-1]) >= replayed[layer]
            if layer in reused and not stale:  # as the attempt before calibrated it: restored, not recomputed
                block = restore_block(graph, reused[layer], result, idle)
                # after a recalibrated block its inputs moved (sequential; or an AWQ fold's rounding)
                exact = exact and block.exact and not (redone and (self.sequential or self.awq))
                products.append(block if block.exact == exact else replace(block, exact=False))
                continue
            if reused and (self.back_off_scope == "touched" or not redone):  # start from the block's kept inputs
                exact = self._resume(observe, _position(graph, layer), ctx,
                                     exact=self.back_off_scope == "downstream") and exact
            redone.append(layer)
            products.append(self._calibrate_block(graph, observe, layer, by_layer[layer], result, idle))
            found = getattr(observe, "checkpoint", lambda: None)()  # the inputs this block was calibrated on
            if found is not None and found.position != _position(graph, layer):
                found = None
            exact = products[-1].exact = exact and (found is None or found.faithful)
            if found is not None:
                stride = stride or max(1, math.ceil(found.nbytes * len(order) / CHECKPOINT_BYTES))
                if (len(products) - 1) % stride == 0:
                    products[-1].checkpoint = found
            del found
        seconds = time.perf_counter() - calibration_start
        result.calibration = self._record_calibration(products, redone, order, seconds, start_state, result, ctx)
        if idle:
            result.notes.append(f"{len(idle)} linear(s) saw no calibration token (experts never routed to), "
                                f"data-free MSE scales: {', '.join(idle[:4])}{' ...' if len(idle) > 4 else ''}")
        if self.tune_steps and not self.calibration_only:
            tune_start = time.perf_counter()
            if self._tune(graph, session, chosen, result, ctx.log):
                ctx.log(f"{self.name}: end-to-end tuning (every block, redone on each attempt): "
                        f"{time.perf_counter() - tune_start:.1f} s")

    def _calibrate_block(self, graph: ModelGraph, observe, layer: int | None, lins: list[Linear],
                         result: PassResult, idle: list[str]) -> BlockProduct:
        """Calibrate one block (or the lm_head): AWQ's folds, then each stage observed through the ones quantized
        before it (true_sequential) and quantized; what it left in the graph."""
        release_freed_memory()  # what the block before freed
        block_start = time.perf_counter()
        notes_before, idle_before, overlay_before = len(result.notes), len(idle), dict(graph.tensors.overlay)
        derived = self._awq(graph, observe, layer, lins, result) if self.awq else {}
        if not self.true_sequential:  # the whole block in one observation, before anything in it changes
            unseen = [lin for lin in lins if lin.name not in derived]
            derived.update(self._observe(observe, unseen) if unseen else {})
        for stage in self._stage_order(lins):
            members = [lin for lin in lins if stage_of(lin) == stage]
            if all(lin.name in derived for lin in members):
                stats = {lin.name: derived[lin.name] for lin in members}  # observed already (AWQ: scaled)
            else:
                stats = self._observe(observe, members)
            self._quantize_stage(graph, members, stats, result, idle)
            del stats
            for lin in members:  # this stage's observations (an 8B down_proj's Hessian: 0.8 GB) go now
                derived.pop(lin.name, None)
            release_freed_memory()  # and the heap the stage's GPTQ freed, before the next stage's
        names = [lin.name for lin in lins]
        overlay = graph.tensors.overlay
        return BlockProduct(
            layer, frozenset(names), {n: graph.linears[n].quant for n in names},
            {k: v for k, v in overlay.items() if overlay_before.get(k) is not v},
            {n: result.changed[n] for n in names}, {n: result.metrics[n] for n in names},
            result.notes[notes_before:], idle[idle_before:], time.perf_counter() - block_start)

    def _quantize_stage(self, graph: ModelGraph, members: list[Linear], stats: dict, result: PassResult,
                        idle: list[str]) -> None:
        """Quantize one stage's linears from their observations (GPTQ consumes each Hessian) and store them."""
        # an MoE expert the router never picked on the calibration text has no statistics: data-free
        # MSE scales, and (static activations) the largest input range its stage did see
        seen = [float(o.absmax) for o in stats.values() if o.tokens]
        weights = {lin.name: self._rotate(graph.weight(lin).float()) for lin in members}
        shared = self._global_scales(members, weights)
        siblings: dict[int, list[Linear]] = {}  # linears sharing one observer (and one global scale)
        for lin in members:
            siblings.setdefault(id(stats[lin.name]), []).append(lin)
        for group in siblings.values():
            obs = stats[group[0].name]
            input_scale = None
            if self.activations == "static":
                if not seen:
                    raise KilnError(f"{self.name}: no calibration token reached {group[0].name} or the "
                                    "linears beside it, so there is no input range for a static scale")
                absmax = obs.absmax if obs.tokens else torch.tensor(max(seen))
                input_scale = static_input_scale(self.format, absmax)
            if obs.tokens:
                # the observation's last reader: GPTQ factors its Hessian in place (an 8B down_proj:
                # no second 0.8 GB)
                found = quantize_sibling_weights([weights[lin.name] for lin in group], self.format,
                                                 self.granularity, self._act(), method=self.method,
                                                 hessian=obs.take_hessian(), act_order=self.act_order,
                                                 damping=self.damping, input_scale=input_scale,
                                                 global_scale=shared.get(group[0].name),
                                                 consume_hessian=True)
                found = [replace(qw, method=self._method_label(tuned=False)) for qw in found]
            else:
                idle.extend(lin.name for lin in group)
                found = [quantize_linear_weight(weights[lin.name], self.format, self.granularity,
                                                self._act(), method="rtn" if self.method == "rtn" else "mse",
                                                input_scale=input_scale,
                                                global_scale=shared.get(lin.name)) for lin in group]
            for lin, qw in zip(group, found, strict=True):
                self._store(lin, weights[lin.name], replace(qw, rotation_block=self.rotation_block), result)

    def _reused_blocks(self, order: list[int | None], by_layer: dict[int | None, list[Linear]],
                       start_state: tuple, ctx: PassContext) -> dict[int | None, BlockProduct]:
        """The blocks `self.reuse` holds the product of for exactly these chosen linears (CalibrationCache.reusable:
        back_off_scope "downstream", only the leading ones)."""
        cache = self.reuse
        if cache is None:
            return {}
        why_not = cache.matches(self._config_key(), start_state)
        if why_not is not None:
            ctx.log(f"{self.name}: the calibration cache is not used ({why_not}); calibrating every block")
            return {}
        chosen = {layer: frozenset(lin.name for lin in lins) for layer, lins in by_layer.items()}
        return cache.reusable(order, chosen, downstream=self.back_off_scope == "downstream")

    def _replayed_blocks(self, graph: ModelGraph, order: list[int | None]) -> dict[int | None, int]:
        """back_off_keep's blocks whose inputs a resume replays from an earlier block's kept inputs (the cache
        keeps every k-th: CHECKPOINT_BYTES), by layer: the position replay starts at. Such a block is
        recalibrated whenever a block in that span is, so that its product is what its config rebuilds
        (a rebuild recalibrates every block holding back_off_keep in one attempt) whatever the order of the
        steps before."""
        if (not self.back_off_keep or self.back_off_scope != "touched" or self.reuse is None
                or not (self.sequential or self.awq)):  # unsequential: the replay runs through source weights
            return {}
        kept = sorted(b.checkpoint.position for b in self.reuse.blocks if b.checkpoint is not None)
        held = {graph.linears[name].layer for name in self.back_off_keep if name in graph.linears}
        out = {}
        for layer in order:
            position = _position(graph, layer)
            start = max((c for c in kept if c <= position), default=0)
            if layer in held and start < position:
                out[layer] = start
        return out

    def _resume(self, session, position: int, ctx: PassContext, exact: bool) -> bool:
        """Resume `session` at the cache's latest kept inputs at or before `position`; whether the inputs it then
        stands at are what the blocks before compute now (False: an earlier attempt's, taken as they were)."""
        at, faithful = self.reuse.resume(session, position, exact)
        if at is not None:
            exactness = "" if faithful else ", as the attempt before gave them"
            ctx.log(f"{self.name}: calibration resumes from the kept inputs of block {at}{exactness}")
        return faithful

    def _record_calibration(self, products: list[BlockProduct], redone: list[int | None],
                            order: list[int | None], seconds: float, start_state: tuple, result: PassResult,
                            ctx: PassContext) -> CalibrationCache:
        """Log what this attempt's calibration cost and hand its product on: the back-offs' cache, updated in
        place when this attempt reused one, a new one otherwise."""
        cache = self.reuse
        if cache is None or cache.matches(self._config_key(), start_state) is not None:
            ctx.log(f"{self.name}: calibrated blocks {block_span(order)} in {seconds:.1f} s")
            return CalibrationCache(self._config_key(), start_state, products, seconds)
        cache.steps += 0 if self.ships else 1  # the step that passed, redone as it ships, is not another step
        cache.blocks = products
        kept = block_span([layer for layer in order if layer not in redone])
        share = f"{100 * seconds / cache.first_seconds:.0f}%" if cache.first_seconds > 0 else "n/a"
        inexact = [p.layer for p in products if not p.exact]
        exactness = ("every block as a full calibration with this keep list gives it" if not inexact else
                     f"blocks {block_span(inexact)} on inputs an earlier attempt gave them")
        if inexact and self.back_off_keep and self.back_off_scope == "touched":
            exactness = ("what its config rebuilds (back_off_keep: every block on the inputs the calibration "
                         "without them gives)")
        label = ("back_off_keep, rebuilt" if self.rebuilding else
                 f"back-off step {cache.steps}" + (", as it ships" if self.ships else ""))
        ctx.log(f"{label}: kept {len(self.keep) + len(self.back_off_keep)} linears in source precision, recalibrated "
                f"blocks {block_span(redone)} ({seconds:.1f} s, {share} of the first calibration); reused "
                f"blocks {kept}; {exactness}")
        inputs = ("the same linears, the same inputs" if self.back_off_scope == "downstream" else
                  "the same linears; back_off_scope 'touched': every block on the inputs the attempt before gave it")
        result.notes.append(f"calibration of blocks {kept} reused from the attempt before ({inputs}); blocks "
                            f"{block_span(redone)} recalibrated")
        return cache

    def _stage_order(self, lins: list[Linear]) -> list[int]:
        """The order a block's stages are quantized in. True-sequential: input to output, each observed through
        the ones before. Otherwise every stage was observed up front and none reads another's result, so the
        widest inputs go first: their Hessians (an 8B down_proj's: 0.8 GB) are freed before the other stages'
        GPTQ runs, not held through them (the artifact is the same in any order)."""
        stages = sorted({stage_of(lin) for lin in lins})
        if self.true_sequential:
            return stages
        widest = {stage: max(lin.in_features for lin in lins if stage_of(lin) == stage) for stage in stages}
        return sorted(stages, key=lambda stage: -widest[stage])

    def _observe(self, session: CalibrationSession, lins: list[Linear], max_samples: int = 0,
                 rotate: bool = True) -> dict[str, InputObserver]:
        # linears that read one input (q/k/v, gate/up: fusion_key) share one observer: observed once
        leaders = sibling_leaders(lins)
        stats = {name: InputObserver(lin.in_features, max_samples=max_samples, name=name)
                 for lin in lins if (name := lin.name) == leaders[name]}
        transform = self._rotate if rotate else (lambda x: x)
        session.observe(list(stats), lambda name, x: stats[name].update(transform(x)))
        return {lin.name: stats[leaders[lin.name]] for lin in lins}

    def _awq(self, graph: ModelGraph, session: CalibrationSession, layer: int | None, lins: list[Linear],
             result: PassResult) -> dict[str, InputObserver]:
        """The block's AWQ scales searched and folded (awq_fold.awq_block)."""
        return awq_block(graph, session, layer, lins, result,
                         lambda keys, samples: self._observe(session, keys, max_samples=samples, rotate=False),
                         fmt=self.format, granularity=self.granularity, activations=self.activations,
                         rotation_block=self.rotation_block, true_sequential=self.true_sequential)


def _position(graph: ModelGraph, layer: int | None) -> int:
    """A block's place in calibration order (the lm_head after the last block)."""
    return len(graph.spec.layers) if layer is None else layer


def _unquantized_view(graph: ModelGraph) -> ModelGraph:
    """The graph with the same tensors dict (so AWQ folds show) but its own linears, which stay as they are
    now: observing through it calibrates every block on source-precision inputs (sequential=False)."""
    linears = {name: dataclasses.replace(lin) for name, lin in graph.linears.items()}
    view = dataclasses.replace(graph, linears=linears)
    view.tensors = graph.tensors
    return view
