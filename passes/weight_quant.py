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
`back_offs` yields) and recalibrates only the blocks that hold a newly kept linear, each from the inputs the
attempt before gave it (back_off_scope "touched"), or those blocks and every one after them, whose inputs the
kept linears changed (sequential), so that the stored tensors are bit for bit a full calibration's with the
same keep list ("downstream"). End-to-end tuning fits every block at once: it is redone whole on each attempt.
The log says what each step cost.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from kiln.calibration.awq import awq_search
from kiln.calibration.grids import WeightLayout
from kiln.calibration.metrics import relative_error
from kiln.calibration.observers import InputObserver
from kiln.calibration.quantize import (
    METHODS,
    WEIGHT_FORMATS,
    activation_fake_quantizer,
    quantize_weight,
    shared_global_scales,
    static_input_scale,
)
from kiln.calibration.scale_search import mse_scales
from kiln.kernels import progress
from kiln.kernels.errors import KilnError, check_choice
from kiln.kernels.formats import ActivationFormat, WeightFormat
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
    CalibrationSession,
    Pass,
    PassContext,
    PassResult,
    check_range,
)
from kiln.passes.calibration_cache import (
    CHECKPOINT_BYTES,
    BlockProduct,
    CalibrationCache,
    block_span,
    graph_state,
    restore_block,
)
from kiln.passes.end_to_end_tuning import (
    check_tune_budget,
    tune_end_to_end,
)
from kiln.passes.graph import Linear, ModelGraph, QuantizedWeight
from kiln.passes.tensor_store import release_freed_memory

ACTIVATION_MODES = ("none", "dynamic", "static")
BACK_OFF_SCOPES = ("touched", "downstream")
GRANULARITIES = ("per_channel", "per_tensor")
QUANTIZABLE_ROLES = ("q", "k", "v", "o", "q_a", "q_b", "kv_a", "kv_b", "gate", "up", "down", "expert", "lm_head")
DEFAULT_ROLES = tuple(r for r in QUANTIZABLE_ROLES if r != "lm_head")

# Dataflow order inside a block: a stage's inputs depend only on the stages before it.
STAGES = (("q", "k", "v", "q_a", "kv_a"), ("q_b", "kv_b"), ("o",), ("gate", "up"), ("down",), ("lm_head",))
MLP_INPUT_STAGE = STAGES.index(("gate", "up"))  # gate/up (an MoE layer's experts and its router read the same input)

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


def quantize_linear_weight(w: torch.Tensor, fmt: str, granularity: str = "per_channel",
                           activation: str = "none", *, method: str = "rtn", hessian: torch.Tensor | None = None,
                           act_order: bool = True, damping: float = 0.01,
                           input_scale: torch.Tensor | None = None,
                           global_scale: torch.Tensor | None = None, consume_hessian: bool = False) -> QuantizedWeight:
    """Quantize one [out, in] weight to `fmt` (calibration.quantize.quantize_weight) as the graph stores it.
    `input_scale` (static activations) is stored beside the weight. `consume_hessian`: GPTQ may overwrite
    `hessian`."""
    tensors = quantize_weight(w, fmt, granularity, method=method, hessian=hessian, act_order=act_order,
                              damping=damping, global_scale=global_scale, consume_hessian=consume_hessian)
    if input_scale is not None:
        tensors = {**tensors, "input_scale": input_scale.float().reshape(()).clone()}  # its own (siblings share a value)
    stored = parse_weight_format(fmt, WEIGHT_FORMATS)
    return QuantizedWeight(stored, tensors, activation,
                           in_features=w.shape[1] if format_object(stored).blocked else None, method=method)


# End-to-end tuning runs only when steps x tokens per step x the model's linear weights fit this budget (the
# passes' `tune_budget`, by default the device's; a recipe file may set it): the whole distillation in fp32,
# forward and backward, is about 6 x that many FLOPs, some 3 minutes of 2 CPU cores. stories260K (0.28M
# weights: 400 steps of 4096 tokens, 4.6e11) tunes on the CPU; SmolLM2-135M (200 steps of 2048 tokens: 5.5e13;
# a 4096-token step took about 110 s there) does not, and the pass says so. A GPU's fp32 matmuls are about
# 1000 times 2 CPU cores' (an H100's 50-60 TFLOP/s): the same few minutes there are 2^50, SmolLM2's 200 steps
# about 20 s; an 8B model's (2.9e15, and both models and Adam's state in fp32: some 150 GB) stay over.
MAX_ROTATION_BLOCK = 4096  # widest online Hadamard block: its cost per token grows with the width
STACK_BYTES = 128 << 20  # fp32 bytes of siblings quantized as one stack (SmolLM2's gate/up: 7 MB; 8B q/k/v: 100 MB)


def quantize_sibling_weights(ws: list[torch.Tensor], fmt: str, granularity: str = "per_channel",
                             activation: str = "none", *, method: str, hessian: torch.Tensor, act_order: bool = True,
                             damping: float = 0.01, input_scale: torch.Tensor | None = None,
                             global_scale: torch.Tensor | None = None,
                             consume_hessian: bool = False) -> list[QuantizedWeight]:
    """`quantize_linear_weight` of linears that read one input (one Hessian; fused siblings share the NVFP4
    per-tensor scale): rows are quantized independently of each other (per-row or per-block scales; GPTQ
    pushes errors along a row), so the weights are stacked and quantized once, one GPTQ instead of three for
    q/k/v, and split again. FP8 per-tensor scales span the rows, and stacks over STACK_BYTES would hold GPTQ's
    working copies of every sibling at once (an 8B model's gate/up: 0.47 GB each): quantized one by one.
    `consume_hessian`: the last GPTQ may overwrite `hessian` (the ones before it only read it)."""
    if len(ws) == 1 or (format_object(fmt).per_tensor_weight_scale and granularity != "per_channel") \
            or sum(4 * w.numel() for w in ws) > STACK_BYTES:
        return [quantize_linear_weight(w, fmt, granularity, activation, method=method, hessian=hessian,
                                       act_order=act_order, damping=damping, input_scale=input_scale,
                                       global_scale=global_scale, consume_hessian=consume_hessian and i == len(ws) - 1)
                for i, w in enumerate(ws)]
    stacked = quantize_linear_weight(torch.cat([w.float() for w in ws]), fmt, granularity, activation,
                                     method=method, hessian=hessian, act_order=act_order, damping=damping,
                                     input_scale=input_scale, global_scale=global_scale,
                                     consume_hessian=consume_hessian)
    rows = sum(w.shape[0] for w in ws)
    out, start = [], 0
    for w in ws:
        part = {k: v[start:start + w.shape[0]].clone() if v.ndim and v.shape[0] == rows else v.clone()
                for k, v in stacked.tensors.items()}
        out.append(replace(stacked, tensors=part))
        start += w.shape[0]
    return out


@dataclass
class WeightQuantResult(PassResult):
    """A PassResult that also carries the calibration product for the pass's back-offs (never serialized)."""

    calibration: CalibrationCache | None = field(default=None, repr=False, compare=False)


AWQ_EXACT_FLOPS = 2e10
"""A weight-only AWQ loss costlier than this per candidate (2 N K min(K, tokens)) is estimated from a sketch of
AWQ_SKETCH_ROWS rows (calibration.awq): every group of SmolLM2-135M is exact; an 8B model's cost 3-24 times
that (with exact losses an 8B block took about 9 minutes of 2 CPU cores)."""
AWQ_SKETCH_ROWS = 256


def activation_format(fmt: str, mode: str) -> ActivationFormat:
    if mode == "none":
        return ActivationFormat.NONE
    return format_object(parse_weight_format(fmt, WEIGHT_FORMATS)).activation_format(mode)


def stage_of(lin: Linear) -> int:
    role = lin.proj if lin.role == "expert" else lin.role
    for i, roles in enumerate(STAGES):
        if role in roles:
            return i
    raise KilnError(f"{lin.name}: no calibration stage for role {lin.role!r}")


def fusion_key(lin: Linear) -> str:
    """Linears that serving engines fuse into one GEMM (q/k/v; MLA q_a/kv_a; gate/up, also per expert): they
    run with one NVFP4 per-tensor scale (and one input scale), so they must store the same one."""
    if lin.role in ("q", "k", "v"):
        return f"layers.{lin.layer}.qkv"
    if lin.role in ("q_a", "kv_a"):
        return f"layers.{lin.layer}.qkv_a"
    if lin.role in ("gate", "up"):
        return f"layers.{lin.layer}.{'shared_' if 'shared' in lin.name else ''}gate_up"
    if lin.role == "expert" and lin.proj in ("gate", "up"):
        return f"layers.{lin.layer}.experts.{lin.expert}.gate_up"
    return lin.name


def sibling_leaders(lins: Iterable[Linear]) -> dict[str, str]:
    """Linear name -> the first of `lins` in its fusion set (fusion_key): siblings read one input, so observing
    the first serves them all."""
    first: dict[str, str] = {}
    return {lin.name: first.setdefault(fusion_key(lin), lin.name) for lin in lins}


@dataclass(frozen=True)
class _AwqGroup:
    """Linears that read one input, and what produces it: a norm weight or the rows of a linear."""

    consumers: tuple[str, ...]
    producer: str  # tensor name of the norm weight, or the producing linear's name
    producer_is_norm: bool
    tie: torch.Tensor | None = None  # consumer input channel -> producer output channel (GQA o_proj)


def _awq_groups(graph: ModelGraph, layer: int) -> tuple[list[_AwqGroup], str | None]:
    """The foldable groups of block `layer`, or ([], why not)."""
    block = graph.blocks[layer]
    a, m = block.attention, block.mlp
    if a.kind not in ("mha", "gqa") or m.kind != "dense":
        return [], f"AWQ folding supports GQA/MHA attention with a dense MLP, not {a.kind}/{m.kind}"
    q, k, v, o = (a.linears[r].name for r in ("q", "k", "v", "o"))
    gate, up, down = (m.linears[r].name for r in ("gate", "up", "down"))
    groups = [_AwqGroup((q, k, v), block.norms[0], True), _AwqGroup((gate, up), block.norms[1], True)]
    if a.v_head_dim == a.head_dim:
        per_kv = a.num_heads // a.num_kv_heads  # query head h reads kv head h // per_kv
        head = torch.arange(a.num_heads).repeat_interleave(a.v_head_dim)
        dim = torch.arange(a.v_head_dim).repeat(a.num_heads)
        groups.append(_AwqGroup((o,), v, False, tie=(head // per_kv) * a.v_head_dim + dim))
    groups.append(_AwqGroup((down,), up, False))
    return groups, None


@dataclass(frozen=True)
class WeightQuantization(Pass):
    """Quantize the weights of selected linears to one format.

    Fields:
        format        "fp8" (E4M3), "nvfp4", "mxfp4" or "mxfp6" (weight-only)
        activations   "none" (weight-only), "dynamic" (per-token FP8 / dynamic FP4 blocks) or "static"
                      (calibrated per-tensor scale: FP8, and NVFP4's activation global scale)
        granularity   FP8 weight scales: "per_channel" (one per output row) or "per_tensor"
        roles         which linear roles to quantize (routers are never quantized)
        keep          module names kept in source precision
        max_back_offs how many back-off steps to try before reverting
        back_off_scope  what a back-off step recalibrates (CalibrationCache): "touched" (default) only the blocks
                      holding a newly kept linear, each on the inputs the attempt before gave it, the rest
                      restored; "downstream" those blocks and every block after them, so that the step stores
                      exactly what a full calibration with its keep list stores
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
    max_back_offs: int = 4
    back_off_scope: str = "touched"
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

    def __post_init__(self):
        check_choice("format", self.format, WEIGHT_FORMATS)
        check_choice("activations", self.activations, ACTIVATION_MODES)
        check_choice("granularity", self.granularity, GRANULARITIES)
        check_choice("method", self.method, METHODS)
        check_choice("back_off_scope", self.back_off_scope, BACK_OFF_SCOPES)
        object.__setattr__(self, "roles", tuple(self.roles))
        object.__setattr__(self, "keep", tuple(sorted(self.keep)))
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
        for flag in ("awq", "act_order", "sequential", "true_sequential"):
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
        unknown = sorted(set(self.keep) - set(graph.linears))
        if unknown:
            raise KilnError(f"keep names modules that do not exist: {', '.join(unknown[:5])}")

    def _selected(self, graph: ModelGraph) -> tuple[list[Linear], dict[str, str]]:
        chosen, skipped = [], {}
        for lin in graph.iter_linears():
            if lin.role == "router":
                skipped[lin.name] = "router: kept in high precision"
            elif lin.role not in self.roles:
                skipped[lin.name] = f"role {lin.role!r} not selected"
            elif lin.name in self.keep:
                skipped[lin.name] = "kept in source precision (keep list / back-off)"
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

    def _config_key(self) -> tuple:
        """Everything that decides a block's calibration except which linears are kept."""
        return (type(self), *((f.name, getattr(self, f.name)) for f in dataclasses.fields(self)
                              if f.name not in ("keep", "max_back_offs", "back_off_scope")))

    def apply(self, graph: ModelGraph, ctx: PassContext) -> PassResult:
        start_state = graph_state(graph)  # what a back-off's cache is checked against
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
        for layer in progress.track(order, f"{self.name}: calibrate {self.format}", unit="blocks"):
            if layer in reused:  # as the attempt before calibrated it: restored, not recomputed
                products.append(restore_block(graph, reused[layer], result, idle))
                continue
            if reused and (self.back_off_scope == "touched" or not redone):  # start from the block's kept inputs
                self._resume(observe, len(graph.spec.layers) if layer is None else layer, ctx,
                             exact=self.back_off_scope == "downstream")
            redone.append(layer)
            products.append(self._calibrate_block(graph, observe, layer, by_layer[layer], result, idle))
            found = getattr(observe, "checkpoint", lambda: None)()  # the inputs this block was calibrated on
            if found is not None and found.position == (len(graph.spec.layers) if layer is None else layer):
                stride = stride or max(1, math.ceil(found.nbytes * len(order) / CHECKPOINT_BYTES))
                if (len(products) - 1) % stride == 0:
                    products[-1].checkpoint = found
            del found
        seconds = time.perf_counter() - calibration_start
        result.calibration = self._record_calibration(products, redone, order, seconds, start_state, result, ctx)
        if idle:
            result.notes.append(f"{len(idle)} linear(s) saw no calibration token (experts never routed to), "
                                f"data-free MSE scales: {', '.join(idle[:4])}{' ...' if len(idle) > 4 else ''}")
        if self.tune_steps:
            tune_start = time.perf_counter()
            if self._tune(graph, session, chosen, result, ctx.log):
                ctx.log(f"{self.name}: end-to-end tuning (every block, redone on each attempt): "
                        f"{time.perf_counter() - tune_start:.1f} s")
        return result

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

    # --- calibration reuse (back-off) --------------------------------------------------------------------------
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

    def _resume(self, session, position: int, ctx: PassContext, exact: bool) -> None:
        at = self.reuse.resume(session, position, exact)
        if at is not None:
            exactness = "" if exact else ", as the attempt before gave them"
            ctx.log(f"{self.name}: calibration resumes from the kept inputs of block {at}{exactness}")

    def _record_calibration(self, products: list[BlockProduct], redone: list[int | None],
                            order: list[int | None], seconds: float, start_state: tuple, result: PassResult,
                            ctx: PassContext) -> CalibrationCache:
        """Log what this attempt's calibration cost and hand its product on: the back-offs' cache, updated in
        place when this attempt reused one, a new one otherwise."""
        cache = self.reuse
        if cache is None or cache.matches(self._config_key(), start_state) is not None:
            ctx.log(f"{self.name}: calibrated blocks {block_span(order)} in {seconds:.1f} s")
            return CalibrationCache(self._config_key(), start_state, products, seconds)
        cache.steps += 1
        cache.blocks = products
        kept = block_span([layer for layer in order if layer not in redone])
        share = f"{100 * seconds / cache.first_seconds:.0f}%" if cache.first_seconds > 0 else "n/a"
        ctx.log(f"back-off step {cache.steps}: kept {len(self.keep)} linears in source precision, recalibrated "
                f"blocks {block_span(redone)} ({seconds:.1f} s, {share} of the first calibration); reused "
                f"blocks {kept}")
        inputs = ("the same linears, the same inputs" if self.back_off_scope == "downstream" else
                  "the same linears; back_off_scope 'touched': every block on the inputs the attempt before gave it")
        result.notes.append(f"calibration of blocks {kept} reused from the attempt before ({inputs}); blocks "
                            f"{block_span(redone)} recalibrated")
        return cache

    # --- internals ---------------------------------------------------------------------------------------------
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
        """Search and fold the block's AWQ scales. Returns the input statistics of the groups whose inputs do not
        change before they are quantized, as they are after folding (the observation divided by the folded
        scale): the first stage (q/k/v: nothing before them changes), and every group when not true_sequential;
        empty when the pass rotates inputs (R mixes the channels)."""
        if layer is None:
            result.notes.append("awq: the lm_head is not scaled (its input norm feeds a tied embedding in many models)")
            return {}
        groups, why_not = _awq_groups(graph, layer)
        if why_not:
            result.notes.append(f"awq: layer {layer} skipped: {why_not}")
            return {}
        chosen = {lin.name for lin in lins}
        groups = [g for g in groups if chosen & set(g.consumers)]
        act_quantizer = activation_fake_quantizer(self.format, self.activations)
        samples = 2048 if act_quantizer is not None else 0
        # weight-only: the loss is tr(D H D^T), 2 N K^2 per candidate; from the input rows themselves it is
        # 2 N K T, cheaper when there are fewer tokens T than input channels K (an 8B model's down_proj reads
        # K = 14336, and --calib-tokens 2048 gives T = 2048). Then every row is kept (T rows: 117 MB there).
        widest = max(graph.linears[g.consumers[0]].in_features for g in groups) if groups else 0
        rows = getattr(session, "tokens", 0)
        if act_quantizer is None and 0 < rows < widest:
            samples = rows
        # every group's input, observed once with the block still in source precision (earlier blocks quantized)
        keys = [graph.linears[g.consumers[0]] for g in groups]
        stats = self._observe(session, keys, max_samples=samples, rotate=False)
        layout = WeightLayout(self.format, self.granularity)
        rotate = self._rotate  # R is symmetric and orthogonal: rotating back is rotating again

        # FP8 weight-only: inside the alpha search (21 candidates per group) absmax scales rank the alphas as
        # the MSE scale search (16 candidates per row, each a full rounding of the weight) does, at 1/16 of the
        # cost (benchmarks/results/precision.md); AutoAWQ searches with its plain quantizer too. With
        # quantized activations and FP4's block scales the MSE scales matter.
        fp8_search = format_object(self.format).absmax_ranks_like_mse and act_quantizer is None

        def fake_quantize(w: torch.Tensor) -> torch.Tensor:
            w = rotate(w)
            scales = layout.absmax_scales(w) if fp8_search else mse_scales(layout, w)
            return rotate(layout.quantize(w, scales))

        if act_quantizer is not None and self.rotation_block:
            quantize_input = act_quantizer
            act_quantizer = lambda x: rotate(quantize_input(rotate(x)))

        picked = []
        derived: dict[str, InputObserver] = {}
        for g in groups:
            first_stage = g.producer_is_norm and all(stage_of(graph.linears[n]) == 0 for n in g.consumers)
            reusable = (first_stage or not self.true_sequential) and not self.rotation_block
            if reusable:
                derived.update({n: stats[g.consumers[0]] for n in g.consumers if n in chosen})
            touched = [*g.consumers, *([] if g.producer_is_norm else [g.producer])]
            if any(graph.linears[n].quant is not None for n in touched):
                picked.append(f"{g.consumers[0].rsplit('.', 1)[-1]} skipped (a linear it scales is already quantized)")
                continue
            obs = stats[g.consumers[0]]
            weights = [graph.weight(n).float() for n in g.consumers if n in chosen]
            out_features = sum(w.shape[0] for w in weights)
            inner = min(obs.in_features, obs.tokens)  # the exact weight-only loss: 2 N K inner per candidate
            sketch = AWQ_SKETCH_ROWS if 2 * out_features * obs.in_features * inner > AWQ_EXACT_FLOPS else 0
            if act_quantizer is None and samples and obs.tokens <= samples and obs.tokens < obs.in_features:
                found = awq_search(weights, fake_quantize, obs.abs_mean, sample=obs.sample, tie=g.tie,  # every row
                                   sketch=sketch)
            elif act_quantizer is None:
                found = awq_search(weights, fake_quantize, obs.abs_mean, hessian=obs.hessian, tie=g.tie,
                                   sketch=sketch)
            else:
                found = awq_search(weights, fake_quantize, obs.abs_mean, sample=obs.sample,
                                   act_quantize=act_quantizer, tie=g.tie)
            picked.append(f"{g.consumers[0].rsplit('.', 1)[-1]} alpha {found.alpha:.2f}")
            if found.alpha == 0:
                continue
            _fold_input_scale(graph, g, found.scale)
            if reusable:  # the observation is not needed any more as it was: rescaled once, in place
                obs.rescale_(found.scale)
        result.notes.append(f"awq: layer {layer}: " + ", ".join(picked))
        return derived

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
        the blocks holding a newly kept linear are recalibrated (back_off_scope "touched"), or those and every
        block after the first of them ("downstream")."""
        worst = sorted(result.metrics, key=lambda name: -result.metrics[name])
        cache = getattr(result, "calibration", None)
        count = 1
        try:
            for _ in range(self.max_back_offs):
                if count >= len(worst):
                    break
                yield replace(self, keep=tuple(sorted(set(self.keep) | set(worst[:count])))).reusing(cache)
                count *= 2
        finally:  # the series is over (a step passed, or none did): its products are not needed any more
            if cache is not None:
                cache.clear()


def _fold_input_scale(graph: ModelGraph, group: _AwqGroup, scale: torch.Tensor) -> None:
    """x W^T = (x / s) (W diag s)^T: every consumer's columns times s, the producer's output divided by s.
    Tensors are replaced, never changed in place (snapshots share them), and kept in fp32 so that what is
    stored unquantized (norms, kept linears) computes the same function as before."""
    for name in group.consumers:
        key = graph.linears[name].weight_name
        graph.tensors[key] = graph.tensors[key].float() * scale
    if group.producer_is_norm:  # a norm scaling by (offset + w) (Gemma: 1 + w) divides that by s
        offset = graph.spec.norm_offset
        graph.tensors[group.producer] = (graph.tensors[group.producer].float() + offset) / scale - offset
        return
    s = scale if group.tie is None else torch.zeros(int(group.tie.max()) + 1).index_copy_(0, group.tie, scale)
    lin = graph.linears[group.producer]
    graph.tensors[lin.weight_name] = graph.tensors[lin.weight_name].float() / s.unsqueeze(1)
    if lin.bias:
        graph.tensors[f"{lin.name}.bias"] = graph.tensors[f"{lin.name}.bias"].float() / s


def _unquantized_view(graph: ModelGraph) -> ModelGraph:
    """The graph with the same tensors dict (so AWQ folds show) but its own linears, which stay as they are
    now: observing through it calibrates every block on source-precision inputs (sequential=False)."""
    linears = {name: dataclasses.replace(lin) for name, lin in graph.linears.items()}
    view = dataclasses.replace(graph, linears=linears)
    view.tensors = graph.tensors
    return view
