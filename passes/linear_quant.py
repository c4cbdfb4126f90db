"""Linears quantized as the graph stores them, and the order calibration quantizes them in.

    quantize_linear_weight(w, fmt, ...)     one [out, in] weight -> QuantizedWeight (calibration.quantize)
    quantize_sibling_weights(ws, fmt, ...)  linears that read one input (one Hessian), quantized as one stack
    STAGES, stage_of(lin)                   a block's dataflow order: q/k/v, q_b/kv_b, o, gate/up, down, lm_head
    fusion_key(lin), sibling_leaders(lins)  the linears serving engines fuse into one GEMM (one NVFP4 per-tensor
                                            scale, one input scale), and the first of each set

The weight and precision passes (weight_quant.py, precision_plan.py) both quantize through these.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import torch

from kiln.calibration.quantize import WEIGHT_FORMATS, quantize_weight
from kiln.kernels.errors import KilnError
from kiln.kernels.formats import ActivationFormat
from kiln.kernels.registry import parse_weight_format
from kiln.kernels.registry import weight_format as format_object
from kiln.passes.graph import Linear, QuantizedWeight

# Dataflow order inside a block: a stage's inputs depend only on the stages before it.
STAGES = (("q", "k", "v", "q_a", "kv_a"), ("q_b", "kv_b"), ("o",), ("gate", "up"), ("down",), ("lm_head",))
MLP_INPUT_STAGE = STAGES.index(("gate", "up"))  # gate/up (an MoE layer's experts and its router read the same input)
STACK_BYTES = 128 << 20  # fp32 bytes of siblings quantized as one stack (SmolLM2's gate/up: 7 MB; 8B q/k/v: 100 MB)


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


def activation_format(fmt: str, mode: str) -> ActivationFormat:
    """The artifact's activation entry of `fmt` for a recipe's activations mode ("none", "dynamic", "static")."""
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
