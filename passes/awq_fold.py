"""AWQ inside weight quantization: per block, per-input-channel scales searched on the block's activations
(calibration.awq) and folded into what produces the input, so the fp32 function is unchanged.

    awq_groups(graph, layer)          the foldable groups of a GQA/MHA block with a dense MLP: q/k/v and gate/up
                                      (scaled through their input norm), o_proj (through v_proj's rows, per KV
                                      head) and down_proj (through up_proj's rows)
    fold_input_scale(graph, g, s)     x W^T = (x / s) (W diag s)^T, written into `graph.tensors`
    awq_block(graph, session, ...)    search and fold one block's scales; the observations still valid after
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kiln.calibration.awq import awq_search
from kiln.calibration.grids import WeightLayout
from kiln.calibration.observers import InputObserver
from kiln.calibration.quantize import activation_fake_quantizer
from kiln.calibration.scale_search import mse_scales
from kiln.kernels.registry import weight_format as format_object
from kiln.kernels.rotation import block_hadamard
from kiln.passes.base import CalibrationSession, PassResult
from kiln.passes.graph import Linear, ModelGraph
from kiln.passes.linear_quant import stage_of

AWQ_EXACT_FLOPS = 2e10
"""A weight-only AWQ loss costlier than this per candidate (2 N K min(K, tokens)) is estimated from a sketch of
AWQ_SKETCH_ROWS rows (calibration.awq): every group of SmolLM2-135M is exact; an 8B model's cost 3-24 times
that (with exact losses an 8B block took about 9 minutes of 2 CPU cores)."""
AWQ_SKETCH_ROWS = 256


@dataclass(frozen=True)
class AwqGroup:
    """Linears that read one input, and what produces it: a norm weight or the rows of a linear."""

    consumers: tuple[str, ...]
    producer: str  # tensor name of the norm weight, or the producing linear's name
    producer_is_norm: bool
    tie: torch.Tensor | None = None  # consumer input channel -> producer output channel (GQA o_proj)


def awq_groups(graph: ModelGraph, layer: int) -> tuple[list[AwqGroup], str | None]:
    """The foldable groups of block `layer`, or ([], why not)."""
    block = graph.blocks[layer]
    a, m = block.attention, block.mlp
    if a.kind not in ("mha", "gqa") or m.kind != "dense":
        return [], f"AWQ folding supports GQA/MHA attention with a dense MLP, not {a.kind}/{m.kind}"
    q, k, v, o = (a.linears[r].name for r in ("q", "k", "v", "o"))
    gate, up, down = (m.linears[r].name for r in ("gate", "up", "down"))
    groups = [AwqGroup((q, k, v), block.norms[0], True), AwqGroup((gate, up), block.norms[1], True)]
    if a.v_head_dim == a.head_dim:
        per_kv = a.num_heads // a.num_kv_heads  # query head h reads kv head h // per_kv
        head = torch.arange(a.num_heads).repeat_interleave(a.v_head_dim)
        dim = torch.arange(a.v_head_dim).repeat(a.num_heads)
        groups.append(AwqGroup((o,), v, False, tie=(head // per_kv) * a.v_head_dim + dim))
    groups.append(AwqGroup((down,), up, False))
    return groups, None


def fold_input_scale(graph: ModelGraph, group: AwqGroup, scale: torch.Tensor) -> None:
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


def awq_block(graph: ModelGraph, session: CalibrationSession, layer: int | None, lins: list[Linear],
              result: PassResult, observe: Callable[[list[Linear], int], dict[str, InputObserver]], *,
              fmt: str, granularity: str, activations: str, rotation_block: int,
              true_sequential: bool) -> dict[str, InputObserver]:
    """Search and fold the block's AWQ scales (`observe(linears, max_samples)`: their unrotated inputs). Returns
    the input statistics of the groups whose inputs do not change before they are quantized, as they are after
    folding (the observation divided by the folded scale): the first stage (q/k/v: nothing before them
    changes), and every group when not true_sequential; empty when the pass rotates inputs (R mixes the
    channels)."""
    if layer is None:
        result.notes.append("awq: the lm_head is not scaled (its input norm feeds a tied embedding in many models)")
        return {}
    groups, why_not = awq_groups(graph, layer)
    if why_not:
        result.notes.append(f"awq: layer {layer} skipped: {why_not}")
        return {}
    chosen = {lin.name for lin in lins}
    groups = [g for g in groups if chosen & set(g.consumers)]
    act_quantizer = activation_fake_quantizer(fmt, activations)
    samples = 2048 if act_quantizer is not None else 0
    # weight-only: the loss is tr(D H D^T), 2 N K^2 per candidate; from the input rows themselves it is
    # 2 N K T, cheaper when there are fewer tokens T than input channels K (an 8B model's down_proj reads
    # K = 14336, and --calib-tokens 2048 gives T = 2048). Then every row is kept (T rows: 117 MB there).
    widest = max(graph.linears[g.consumers[0]].in_features for g in groups) if groups else 0
    rows = getattr(session, "tokens", 0)
    if act_quantizer is None and 0 < rows < widest:
        samples = rows
    # every group's input, observed once with the block still in source precision (earlier blocks quantized)
    stats = observe([graph.linears[g.consumers[0]] for g in groups], samples)
    layout = WeightLayout(fmt, granularity)

    def rotate(x: torch.Tensor) -> torch.Tensor:  # R is symmetric and orthogonal: rotating back is rotating again
        return block_hadamard(x, rotation_block) if rotation_block else x

    # FP8 weight-only: inside the alpha search (21 candidates per group) absmax scales rank the alphas as
    # the MSE scale search (16 candidates per row, each a full rounding of the weight) does, at 1/16 of the
    # cost (benchmarks/results/precision.md); AutoAWQ searches with its plain quantizer too. With
    # quantized activations and FP4's block scales the MSE scales matter.
    fp8_search = format_object(fmt).absmax_ranks_like_mse and act_quantizer is None

    def fake_quantize(w: torch.Tensor) -> torch.Tensor:
        w = rotate(w)
        scales = layout.absmax_scales(w) if fp8_search else mse_scales(layout, w)
        return rotate(layout.quantize(w, scales))

    if act_quantizer is not None and rotation_block:
        quantize_input = act_quantizer
        act_quantizer = lambda x: rotate(quantize_input(rotate(x)))

    picked = []
    derived: dict[str, InputObserver] = {}
    for g in groups:
        first_stage = g.producer_is_norm and all(stage_of(graph.linears[n]) == 0 for n in g.consumers)
        reusable = (first_stage or not true_sequential) and not rotation_block
        if reusable:
            derived.update({n: stats[g.consumers[0]] for n in g.consumers if n in chosen})
        touched = [*g.consumers, *([] if g.producer_is_norm else [g.producer])]
        if any(graph.linears[n].quant is not None for n in touched):
            picked.append(f"{g.consumers[0].rsplit('.', 1)[-1]} skipped (a linear it scales is already quantized)")
            continue
        obs = stats[g.consumers[0]]
        weights = [graph.weight(n).float() for n in g.consumers if n in chosen]
        found = _search(weights, obs, g, fake_quantize, act_quantizer, samples)
        picked.append(f"{g.consumers[0].rsplit('.', 1)[-1]} alpha {found.alpha:.2f}")
        if found.alpha == 0:
            continue
        fold_input_scale(graph, g, found.scale)
        if reusable:  # the observation is not needed any more as it was: rescaled once, in place
            obs.rescale_(found.scale)
    result.notes.append(f"awq: layer {layer}: " + ", ".join(picked))
    return derived


def _search(weights: list[torch.Tensor], obs: InputObserver, g: AwqGroup, fake_quantize, act_quantizer,
            samples: int):
    """One group's scale search: from the kept input rows, the Hessian, or (quantized activations) a sample."""
    out_features = sum(w.shape[0] for w in weights)
    inner = min(obs.in_features, obs.tokens)  # the exact weight-only loss: 2 N K inner per candidate
    sketch = AWQ_SKETCH_ROWS if 2 * out_features * obs.in_features * inner > AWQ_EXACT_FLOPS else 0
    if act_quantizer is None and samples and obs.tokens <= samples and obs.tokens < obs.in_features:
        return awq_search(weights, fake_quantize, obs.abs_mean, sample=obs.sample, tie=g.tie,  # every row
                          sketch=sketch)
    if act_quantizer is None:
        return awq_search(weights, fake_quantize, obs.abs_mean, hessian=obs.hessian, tie=g.tie, sketch=sketch)
    return awq_search(weights, fake_quantize, obs.abs_mean, sample=obs.sample, act_quantize=act_quantizer,
                      tie=g.tie)
