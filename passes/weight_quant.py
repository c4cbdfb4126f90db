"""Weight quantization: store chosen linears as FP8 E4M3, NVFP4, MXFP4 or MXFP6, optionally with activations.

Preconditions: a loaded graph; the target must run the format (Hopper: FP4 only weight-only); calibration
text (`ctx.runner`, which the build driver sets from --calib-data) for GPTQ, AWQ, tuning and static
activation scales. Without it, static scales are an error and the rest falls back to data-free MSE scales,
with a warning and a note in the result (the manifest says "mse" for every linear).
What it does: for every linear whose role is selected and whose name is not kept, replace its precision
annotation with a `QuantizedWeight` holding the packed tensors (ModelOpt unified names). Source fp32/bf16
weights stay in the graph, so a later back-off or revert can re-quantize from them. How the stored values
are chosen:

    method="rtn"   round to nearest, absmax scales (the kernels' reference quantizers)
    method="mse"   scales from calibration.scale_search: per NVFP4 block the E4M3 scale swept from the block
                   maximum on 6 to the maximum on 4 ("4 over 6") and between; MXFP4 exponents +-1; FP8 per
                   channel; errors weighted by E[x^2] of each input channel
    method="gptq"  GPTQ on the format's grid (calibration.gptq) with those scales, `damping`, `act_order`
    awq=True       first, per-input-channel scales searched on each block's activations (calibration.awq) and
                   folded into the preceding norm (q/k/v, gate/up) or linear (v_proj -> o_proj, up_proj ->
                   down_proj): `graph.tensors` entries are replaced, the fp32 function is unchanged
    tune_steps=n   last, the grid points (scales fixed) and the norm weights tuned end to end on the
                   calibration text against the source model: KL, straight-through rounding (calibration.tuning)
    rotation_block=b  store W R and have the runtime rotate the input by the same R first (the artifact's
                   "input_rotation"; R = block Hadamard, kernels.rotation): x R (W R)^T = x W^T exactly, while
                   outliers spread over each block before the activations are quantized (MR-GPTQ, QuaRot)

Calibration is sequential (`sequential=True`): block i is calibrated on the outputs of blocks 0..i-1 as
already quantized, and within a block q/k/v, o, gate/up and down are quantized in that order; with
`true_sequential=True` (AutoGPTQ's name) each is observed through the quantized ones before it, with False
every linear of the block is observed in one forward before any is quantized (llm-compressor's layer-wise
pipeline; half the block forwards). AWQ's observation serves the stages it can: its statistics divided by the
folded scale are exactly those of the folded block (q/k/v always; every group when not true_sequential).
`activations="static"` stores calibrated input scales: FP8 per tensor (input maximum / 448), NVFP4's
per-tensor activation scale (maximum / (6 * 448)).
What it does not handle: routers and norms (always kept: tiny and sensitive); embeddings. AWQ skips the
lm_head (tied to the embedding in many models) and blocks other than GQA/MHA attention with a dense MLP,
and says so in the result.
Back-off: keep the linears with the largest relative weight error in source precision, 1, 2, 4, ... of them.
A back-off attempt reuses the calibration of the attempt before it (CalibrationCache, carried by the config
`back_offs` yields) and recalibrates only what its kept linears change:
- back_off_scope "touched" (the default): the step's kept linears are `back_off_keep`, which leave what every
  block is calibrated on as the attempt without them had it (as ModelOpt's auto_quantize assembles layers it
  calibrated once). Only the blocks holding one are recalibrated, on those inputs; the others keep their
  product. The recorded config rebuilds the same bytes (a build with `back_off_keep` calibrates without them,
  then recalibrates their blocks), so what ships is what the config says, at a few percent of a calibration.
- "downstream": the kept linears join `keep`; the blocks from the first one holding one are recalibrated,
  since their inputs changed (sequential), and the stored tensors are bit for bit a full calibration's with
  that keep list. `ship_exact` asks the same of a touched step that passed: its keep list is recalibrated so
  from its first inexact block and gated again before it ships.
End-to-end tuning fits every block at once: it is redone whole on each attempt. The log says what each step
cost.
Where the parts live: one linear and fused siblings quantized, the stage order (passes/linear_quant.py); AWQ's
search and folds (passes/awq_fold.py); the calibrated path, block by block, and its reuse on back-off
(passes/block_calibration.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from kiln.calibration.metrics import relative_error
from kiln.calibration.quantize import METHODS, WEIGHT_FORMATS, shared_global_scales
from kiln.kernels.errors import KilnError, check_choice
from kiln.kernels.formats import WeightFormat
from kiln.kernels.registry import parse_weight_format
from kiln.kernels.registry import weight_format as format_object
from kiln.kernels.rotation import block_hadamard
from kiln.kernels.targets import Target
from kiln.passes.base import (
    MAX_BACK_OFFS,
    MAX_BATCH_TOKENS,
    MAX_LR,
    MAX_STEPS,
    STEPS_WHY,
    Pass,
    PassContext,
    PassResult,
    check_range,
)
from kiln.passes.block_calibration import BlockCalibration
from kiln.passes.calibration_cache import CalibrationCache, graph_state
from kiln.passes.end_to_end_tuning import check_tune_budget, tune_end_to_end
from kiln.passes.graph import Linear, ModelGraph, QuantizedWeight
from kiln.passes.linear_quant import activation_format, fusion_key, quantize_linear_weight
from kiln.passes.tensor_store import release_freed_memory

ACTIVATION_MODES = ("none", "dynamic", "static")
BACK_OFF_SCOPES = ("touched", "downstream")
GRANULARITIES = ("per_channel", "per_tensor")
QUANTIZABLE_ROLES = ("q", "k", "v", "o", "q_a", "q_b", "kv_a", "kv_b", "gate", "up", "down", "expert", "lm_head")
DEFAULT_ROLES = tuple(r for r in QUANTIZABLE_ROLES if r != "lm_head")

# Default gate floors (recovery = ppl_source / ppl) per weight format and activation mode, used unless the
# context sets one: the weight-only FP4 floors of the precision issue, and for FP8 and W4A4 what the built-in
# recipes reach on stories260K (benchmarks/results/precision.md) less a margin, so a build backs off (and pays
# for another calibration) only when it really falls short.
DEFAULT_FLOORS = {("fp8", "none"): 0.99, ("fp8", "dynamic"): 0.99, ("fp8", "static"): 0.99,
                  ("nvfp4", "none"): 0.97, ("nvfp4", "dynamic"): 0.88, ("nvfp4", "static"): 0.88,
                  ("mxfp4", "none"): 0.94, ("mxfp4", "dynamic"): 0.8, ("mxfp6", "none"): 0.99}
# Default KL ceilings (nats/token) and top-1 floors, beside recovery, from what the built-in recipes cost on
# stories260K (600 evaluation paragraphs; benchmarks/results/precision.md). Each ceiling is twice the recipe's
# KL (one significant figure), each floor allows 1.5 times its disagreement (rounded down to 0.01); static
# activations take the dynamic figures.
DEFAULT_MAX_KL = {("fp8", "none"): 0.01, ("fp8", "dynamic"): 0.02, ("fp8", "static"): 0.02,
                  ("nvfp4", "none"): 0.05, ("nvfp4", "dynamic"): 0.2, ("nvfp4", "static"): 0.2,
                  ("mxfp4", "none"): 0.1, ("mxfp4", "dynamic"): 0.4, ("mxfp6", "none"): 0.01}
DEFAULT_MIN_TOP1 = {("fp8", "none"): 0.94, ("fp8", "dynamic"): 0.91, ("fp8", "static"): 0.91,
                    ("nvfp4", "none"): 0.89, ("nvfp4", "dynamic"): 0.77, ("nvfp4", "static"): 0.77,
                    ("mxfp4", "none"): 0.84, ("mxfp4", "dynamic"): 0.69, ("mxfp6", "none"): 0.94}


# End-to-end tuning runs only when steps x tokens per step x the model's linear weights fit this budget (the
# passes' `tune_budget`, by default the device's; a recipe file may set it): the whole distillation in fp32,
# forward and backward, is about 6 x that many FLOPs, some 3 minutes of 2 CPU cores. stories260K (0.28M
# weights: 400 steps of 4096 tokens, 4.6e11) tunes on the CPU; SmolLM2-135M (200 steps of 2048 tokens: 5.5e13;
# a 4096-token step took about 110 s there) does not, and the pass says so. A GPU's fp32 matmuls are about
# 1000 times 2 CPU cores' (an H100's 50-60 TFLOP/s): the same few minutes there are 2^50, SmolLM2's 200 steps
# about 20 s; an 8B model's (2.9e15, and both models and Adam's state in fp32: some 150 GB) stay over.
MAX_ROTATION_BLOCK = 4096  # widest online Hadamard block: its cost per token grows with the width


@dataclass
class WeightQuantResult(PassResult):
    """A PassResult that also carries the calibration product for the pass's back-offs (never serialized)."""

    calibration: CalibrationCache | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class WeightQuantization(BlockCalibration, Pass):
    """Quantize the weights of selected linears to one format.

    Fields:
        format        "fp8" (E4M3), "nvfp4", "mxfp4" or "mxfp6" (weight-only)
        activations   "none" (weight-only), "dynamic" (per-token FP8 / dynamic FP4 blocks) or "static"
                      (calibrated per-tensor scale: FP8, and NVFP4's activation global scale)
        granularity   FP8 weight scales: "per_channel" (one per output row) or "per_tensor"
        roles         which linear roles to quantize (routers are never quantized)
        keep          module names kept in source precision
        back_off_keep module names the back-off kept in source precision (back_off_scope "touched"): every block
                      is calibrated on the inputs the build without them gives it, then the blocks holding them
                      are recalibrated with them kept (what the back-off step stored; a recipe may name them too)
        max_back_offs how many back-off steps to try before reverting
        back_off_scope  what a back-off step recalibrates (CalibrationCache): "touched" (default) only the blocks
                      holding a newly kept linear (kept as back_off_keep), the rest restored; "downstream" those
                      blocks and every block after them (kept as keep), so that the step stores exactly what a
                      full calibration with that keep list stores
        ship_exact    a "touched" step that passes the gate is recalibrated as "downstream" (its back_off_keep
                      joining keep) from its first block that is not what that full calibration gives, and gated
                      again, before it ships (default False: the touched product ships; its config rebuilds it)
        method        "rtn", "mse" (scale search) or "gptq" (see the module docstring)
        awq           fold AWQ per-channel scales into the preceding norms / linears first
        act_order     GPTQ: quantize the most active input channels first (scales chosen up front)
        damping       GPTQ: added to the Hessian's diagonal, as a fraction of its mean
        sequential    calibrate each block on the outputs of the already-quantized blocks before it
        true_sequential  within a block, observe each stage through the stages quantized before it (False: one
                      observation per block)
        tune_steps    steps of end-to-end tuning of the grid points and norms on the calibration text (0: none)
        tune_lr       the tuning's Adam learning rate (cosine decay to 0)
        tune_batch_tokens  calibration tokens per tuning step (whole paragraphs, padded)
        tune_budget   tuning runs only if tune_steps x tune_batch_tokens x the model's linear weights is at
                      most this (None: TUNE_BUDGETS of the device it runs on, 2^40 on a CPU: small models;
                      2^50 on cuda); otherwise it is skipped, with a note
        rotation_block  > 0: store W R and rotate each input by R online, R = the block Hadamard transform
                      with blocks of this size (kernels.rotation; the artifact's "input_rotation"); 0: none
    """

    format: str = "fp8"
    activations: str = "none"
    granularity: str = "per_channel"
    roles: tuple[str, ...] = DEFAULT_ROLES
    keep: tuple[str, ...] = ()
    back_off_keep: tuple[str, ...] = ()
    max_back_offs: int = 4
    back_off_scope: str = "touched"
    ship_exact: bool = False
    method: str = "rtn"
    awq: bool = False
    act_order: bool = True
    damping: float = 0.01
    sequential: bool = True
    true_sequential: bool = True
    tune_steps: int = 0
    tune_lr: float = 5e-4
    tune_batch_tokens: int = 2048
    tune_budget: float | None = None
    rotation_block: int = 0

    name: ClassVar[str] = "weight-quant"
    default_floor: ClassVar[float] = 0.98
    exclusive: ClassVar[str | None] = "weights' format"
    runs_after: ClassVar[frozenset[str]] = frozenset({"mla"})  # so MLA's new projections are quantized too
    # Not config (no field: never in a recipe or the manifest): the calibration a back-off attempt may reuse,
    # handed over explicitly by `back_offs` through `reusing` (CalibrationCache).
    reuse: ClassVar[CalibrationCache | None] = None
    # Not config either: set on the config `shipping` returns, so the log names it for what it is
    ships: ClassVar[bool] = False
    # Not config either: the first half of a build with back_off_keep (calibration only; its tuning would be
    # undone)
    calibration_only: ClassVar[bool] = False
    # ... and its second half, which the log names as such rather than as a back-off step
    rebuilding: ClassVar[bool] = False

    def __post_init__(self):
        check_choice("format", self.format, WEIGHT_FORMATS)
        check_choice("activations", self.activations, ACTIVATION_MODES)
        check_choice("granularity", self.granularity, GRANULARITIES)
        check_choice("method", self.method, METHODS)
        check_choice("back_off_scope", self.back_off_scope, BACK_OFF_SCOPES)
        object.__setattr__(self, "roles", tuple(self.roles))
        for field_name in ("keep", "back_off_keep"):
            names = getattr(self, field_name)
            if not isinstance(names, tuple | list) or not all(isinstance(n, str) for n in names):
                raise KilnError(f"{field_name} must be a list of module names, got {names!r}")
            object.__setattr__(self, field_name, tuple(sorted(set(names))))
        for role in self.roles:
            check_choice("roles entry", role, QUANTIZABLE_ROLES)
        if not self.roles:
            raise KilnError("roles is empty: the pass would quantize nothing")
        codec = format_object(self.format)
        if self.activations != "none" and codec.weight_only:
            raise KilnError(f"activations={self.activations!r} is not allowed for {self.format}: Kiln runs it "
                            f"weight-only (W{codec.bits_per_weight:.0f}A16); use activations 'none'")
        if self.activations == "static" and codec.static_activation_refusal:
            raise KilnError(f"activations='static' is not allowed for {self.format} "
                            f"({codec.static_activation_refusal}); use 'dynamic' or 'none', or format fp8 / nvfp4")
        for flag in ("awq", "act_order", "sequential", "true_sequential", "ship_exact"):
            if not isinstance(getattr(self, flag), bool):
                raise KilnError(f"{flag} must be true or false, got {getattr(self, flag)!r}")
        check_range("damping", self.damping, 0, 1)
        check_range("max_back_offs", self.max_back_offs, 0, MAX_BACK_OFFS, integer=True, why="each is a gate run")
        check_range("tune_steps", self.tune_steps, 0, MAX_STEPS, integer=True, why=STEPS_WHY)
        check_range("tune_batch_tokens", self.tune_batch_tokens, 1, MAX_BATCH_TOKENS, integer=True)
        check_range("tune_lr", self.tune_lr, 0, MAX_LR, low_open=True)
        check_tune_budget(self.tune_budget)
        check_range("rotation_block", self.rotation_block, 0, MAX_ROTATION_BLOCK, integer=True,
                    why="0: no rotation; each input is rotated online by a Hadamard block this wide")
        if self.rotation_block & (self.rotation_block - 1):
            raise KilnError(f"rotation_block must be 0 (no rotation) or a power of two, got {self.rotation_block!r}")

    def conflict(self, earlier: Pass) -> str | None:
        """Two weight passes may split the linears by role (each quantizes what the other leaves); one that
        follows a precision pass finds every linear taken."""
        if isinstance(earlier, WeightQuantization):
            shared = [r for r in self.roles if r in earlier.roles]
            roles = ", ".join(shared[:4]) + (", ..." if len(shared) > 4 else "")
            return f"both quantize the same linears (roles {roles})" if shared else None
        if earlier.exclusive == self.exclusive:
            return f"both set the {self.exclusive} ({earlier.name!r} assigns every linear a format)"
        return None

    @property
    def weight_format(self) -> WeightFormat:
        """The stored format `format` names ("fp8" is FP8 E4M3)."""
        return parse_weight_format(self.format, WEIGHT_FORMATS)

    def floor(self, ctx: PassContext) -> float:
        if ctx.floor is not None:
            return ctx.floor
        return DEFAULT_FLOORS.get((self.format, self.activations), self.default_floor)

    def max_kl(self, ctx: PassContext) -> float:
        if ctx.max_kl is not None:
            return ctx.max_kl
        return DEFAULT_MAX_KL.get((self.format, self.activations), self.default_max_kl)

    def min_top1(self, ctx: PassContext) -> float:
        if ctx.min_top1 is not None:
            return ctx.min_top1
        return DEFAULT_MIN_TOP1.get((self.format, self.activations), self.default_min_top1)

    def check(self, graph: ModelGraph, target: Target) -> None:
        if self.activations == "none":
            target.check_weight_only(self.format)
        else:
            target.check_weight_activation(self.format)
        for field_name in ("keep", "back_off_keep"):
            unknown = sorted(set(getattr(self, field_name)) - set(graph.linears))
            if unknown:
                raise KilnError(f"{field_name} names modules that do not exist: {', '.join(unknown[:5])}")

    def _selected(self, graph: ModelGraph) -> tuple[list[Linear], dict[str, str]]:
        chosen, skipped = [], {}
        for lin in graph.iter_linears():
            if lin.role == "router":
                skipped[lin.name] = "router: kept in high precision"
            elif lin.role not in self.roles:
                skipped[lin.name] = f"role {lin.role!r} not selected"
            elif lin.name in self.keep:
                skipped[lin.name] = "kept in source precision (keep list / back-off)"
            elif lin.name in self.back_off_keep:
                skipped[lin.name] = "kept in source precision by the back-off (back_off_keep)"
            elif lin.quant is not None:
                skipped[lin.name] = f"already quantized ({lin.quant.format})"
            else:
                chosen.append(lin)
        return chosen, skipped

    def needs_calibration(self) -> bool:
        return self.method == "gptq" or self.awq or self.tune_steps > 0 or self.activations == "static"

    def reusing(self, cache: CalibrationCache | None) -> WeightQuantization:
        """This config, reading (and updating) `cache`'s calibration product: the attempt restores the blocks
        before the first one whose chosen linears differ and calibrates the rest (CalibrationCache)."""
        out = replace(self)
        object.__setattr__(out, "reuse", cache)
        return out

    def shipping(self, result: PassResult) -> WeightQuantization | None:
        """With ship_exact, a back-off step that passed the gate with blocks calibrated on an earlier attempt's
        inputs (touched): its kept linears as `keep`, recalibrated from the first such block (downstream: bit for
        bit a full calibration's), to be gated again; None when ship_exact is off (the touched product ships: its
        back_off_keep config rebuilds it), or the step already is a full calibration's under `keep`."""
        cache = getattr(result, "calibration", None)
        if not self.ship_exact or cache is None or (not self.back_off_keep and all(b.exact for b in cache.blocks)):
            return None  # (with back_off_keep: even when nothing is redone, the config that ships names them keep)
        out = replace(self, keep=(*self.keep, *self.back_off_keep), back_off_keep=(),
                      back_off_scope="downstream").reusing(cache)
        object.__setattr__(out, "ships", True)
        return out

    def _config_key(self) -> tuple:
        """Everything that decides a block's calibration except which linears are kept."""
        return (type(self), *((f.name, getattr(self, f.name)) for f in dataclasses.fields(self)
                              if f.name not in ("keep", "back_off_keep", "max_back_offs", "back_off_scope",
                                                "ship_exact")))

    def apply(self, graph: ModelGraph, ctx: PassContext) -> PassResult:
        start_state = graph_state(graph)  # what a back-off's cache is checked against
        if self.back_off_keep and ctx.runner is not None and self.needs_calibration() and \
                (self.sequential or self.awq) and \
                (self.reuse is None or self.reuse.matches(self._config_key(), start_state) is not None):
            return self._rebuild_back_off(graph, ctx)  # no calibration without them to start from
        result = WeightQuantResult(self.name)
        chosen, result.skipped = self._selected(graph)
        if not chosen:
            return result
        method = self.method
        if ctx.runner is None and self.needs_calibration():
            if self.activations == "static":
                raise KilnError(f"{self.name}: activations='static' needs calibration text for its input scales, "
                                "and the pass context has no runner (optimize build --calib-data FILE, or "
                                "build(..., calib_data=...)); or use activations='dynamic'")
            # Like the precision passes: the best data-free values, said loudly, rather than no build at all.
            note = (f"no calibration text: {self._calibration_reason()} not possible, data-free MSE scales "
                    "instead (pass --calib-data / build(calib_data=...) for GPTQ, AWQ and tuning)")
            ctx.log(f"warning: {self.name}: {note}")
            result.notes.append(note)
            method = "mse"
        if ctx.runner is None or (method == "rtn" and not self.needs_calibration()):
            layers: dict[int | None, list[Linear]] = {}
            for lin in chosen:
                layers.setdefault(lin.layer, []).append(lin)
            for members in layers.values():  # one layer's fp32 weights at a time (fused siblings share a layer)
                release_freed_memory()
                weights = {lin.name: self._rotate(graph.weight(lin).float()) for lin in members}
                shared = self._global_scales(members, weights)
                for lin in members:
                    w = weights[lin.name]
                    qw = quantize_linear_weight(w, self.format, self.granularity, self._act(), method=method,
                                                global_scale=shared.get(lin.name))
                    self._store(lin, w, replace(qw, rotation_block=self.rotation_block), result)
            return result
        self._calibrate(graph, ctx, chosen, result, start_state)
        return result

    def _rebuild_back_off(self, graph: ModelGraph, ctx: PassContext) -> PassResult:
        """What a back-off step with this back_off_keep stored, from scratch: the calibration without them (the
        inputs every block is calibrated on), then the blocks holding them recalibrated with them kept."""
        ctx.log(f"{self.name}: back_off_keep ({len(self.back_off_keep)} linears): calibrating without them first, "
                "then recalibrating the blocks that hold them")
        state = graph.snapshot()
        base = replace(self, back_off_keep=())
        object.__setattr__(base, "calibration_only", True)
        cache = base.apply(graph, ctx).calibration
        graph.restore(state)
        step = self.reusing(cache)
        object.__setattr__(step, "rebuilding", True)
        try:
            return step.apply(graph, ctx)
        finally:
            if cache is not None:
                cache.clear()

    # --- internals ---------------------------------------------------------------------------------------------
    def _act(self) -> str:
        return activation_format(self.format, self.activations)

    def _global_scales(self, lins: list[Linear], weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """NVFP4: one per-tensor scale per fused set of `lins` (q/k/v, gate/up); other formats: none."""
        if not format_object(self.format).takes_global_scale:
            return {}
        return shared_global_scales(weights, {lin.name: fusion_key(lin) for lin in lins})

    def _calibration_reason(self) -> str:
        wanted = [why for flag, why in ((self.method == "gptq", "method='gptq'"), (self.awq, "awq"),
                                        (self.tune_steps > 0, "tune_steps"),
                                        (self.activations == "static", "activations='static'")) if flag]
        return ", ".join(wanted) or "calibration"

    def _method_label(self, tuned: bool) -> str:
        parts = (["awq"] if self.awq else []) + [self.method] + (["tuned"] if tuned else [])
        return "+".join(parts)

    def _store(self, lin: Linear, w: torch.Tensor, qw: QuantizedWeight, result: PassResult) -> None:
        lin.quant = qw
        act = qw.activation
        result.changed[lin.name] = f"{qw.format}" + (f" + {act} activations" if act != "none" else "") + \
            (f" ({qw.method})" if qw.method != "rtn" else "")
        result.metrics[lin.name] = relative_error(qw.dequantize(), w)

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x R along the last dim (inputs, and weight rows) when the pass rotates; x otherwise."""
        return block_hadamard(x, self.rotation_block) if self.rotation_block else x

    def _tune(self, graph: ModelGraph, session, chosen: list[Linear], result: PassResult,
              log: Callable[[str], None]) -> bool:
        """Tune end to end and store the result; False when nothing was tuned (over the budget)."""
        tuned = tune_end_to_end(graph, session, [lin.name for lin in chosen], self.tune_steps, self.tune_lr,
                                self.tune_batch_tokens, log, self.tune_budget)
        result.notes.append(tuned.note)
        if not tuned.tensors:
            return False
        for lin in chosen:
            w = self._rotate(graph.weight(lin).float())
            qw = replace(lin.quant, tensors=tuned.tensors[lin.name], method=self._method_label(tuned=True))
            self._store(lin, w, qw, result)
        graph.tensors.update(tuned.norms)  # fp32, like the tuning
        return True

    def back_offs(self, graph: ModelGraph, result: PassResult) -> Iterator[Pass]:
        """Keep the 1, 2, 4, ... linears with the largest relative weight error in source precision. Each
        config reuses the calibration of the attempt before it (`result.calibration`, CalibrationCache): only
        the blocks holding a newly kept linear are recalibrated (back_off_scope "touched": they are kept as
        back_off_keep), or those and every block after the first of them ("downstream": kept as keep)."""
        worst = sorted(result.metrics, key=lambda name: -result.metrics[name])
        cache = getattr(result, "calibration", None)
        count = 1
        try:
            for _ in range(self.max_back_offs):
                if count >= len(worst):
                    break
                if self.back_off_scope == "touched":
                    step = replace(self, back_off_keep=(*self.back_off_keep, *worst[:count]))
                else:
                    step = replace(self, keep=(*self.keep, *worst[:count]))
                yield step.reusing(cache)
                count *= 2
        finally:  # the series is over (a step passed, or none did): its products are not needed any more
            if cache is not None:
                cache.clear()
