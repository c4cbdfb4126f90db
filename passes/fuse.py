"""Fusion: q/k/v into one linear, gate/up into one, and the kernel-level fusions a GPU runtime launches.

Preconditions: every other pass has run (`must_be_last`): the fused linears take the stored formats the passes
before left, and no later pass has to know the fused roles.
What it does, per decoder layer:
    qkv      GQA/MHA attention: q_proj, k_proj, v_proj become `self_attn.qkv_proj` (role "qkv"), their stored
             weights (and biases, e.g. Qwen2's) concatenated along the output dim
    gate_up  a dense MLP's gate_proj and up_proj, and a MoE layer's shared expert's, become `gate_up_proj`
             (role "gate_up")
    kernels  no weight changes; recorded in the layer's spec (`LayerSpec.fusions`, runtime.spec.KernelFusion) so a
             GPU runtime launches one kernel for each:
                 rmsnorm_quant  an RMSNorm and the activation quantization of the one linear reading it (fused
                                qkv or gate_up with FP8 / FP4 activations)
                 swiglu_quant   silu(gate) * up and the down projection's activation quantization
                 rope_kv_write  RoPE on q and k and the KV-cache write (any cache format)
The fused linear's `LinearSpec.parts` lists the linears it replaced; the runtime runs one F.linear and splits
its output (runtime/model_weights.py fused_split); `graph.metadata["fusion"]` (the manifest's records) lists every fused group.
How the stored formats concatenate (each output row is quantized on its own in every format):
    dense      weights concatenated
    fp8_e4m3   values and per-channel scales concatenated; per-tensor scales kept when equal, otherwise each part's
               scale repeated over its rows (per-channel, exact; `fp8_per_tensor="skip"` skips the group instead)
    nvfp4      codes and block scales concatenated; the per-tensor scale (weight_scale_2) must be one value
               (weight-quant and the precision passes share it across q/k/v and across gate/up, as serving
               engines need for their own fused GEMM)
    mxfp4      codes and E8M0 block scales concatenated (mxfp6 alike)
    all        one input, one quantizer: activation formats, input scales and input rotations must be identical
A group that breaks a rule is skipped and the result says why. Not handled (skipped, with the reason): MLA
attention (q_a/kv_a could fuse too), routed MoE experts (a grouped-GEMM MoE kernel fuses them its own way),
extra modules (draft heads, MTP layers: speculative decoding builds them unfused).
Gate: a fused graph computes what the unfused one did up to the order of float sums, so the pass declares the
metric "max logit diff (relative)": max |logits fused - logits unfused| / max |logits unfused| over the first
`check_paragraphs` paragraphs of the gate text, at most `max_logit_diff` (1e-5); its recovery, KL and top-1
floors are those of an identity rewrite. No back-off: a failure reverts it.
Exports (optimizer/export/unfuse.py) write the parts back under their own names: vLLM, SGLang and TensorRT-LLM load
q_proj/k_proj/v_proj and gate_proj/up_proj and fuse them themselves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import reduce
from typing import ClassVar

import torch

from kiln.calibration import progress
from kiln.kernels.errors import KilnError, check_choice
from kiln.kernels.formats import ActivationFormat, WeightFormat
from kiln.kernels.registry import weight_format
from kiln.passes.base import MAX_PARAGRAPHS, Pass, PassContext, PassResult, check_range
from kiln.passes.gate_result import ExecutedGraph, PassMetric
from kiln.passes.graph import Linear, ModelGraph, QuantizedWeight
from kiln.passes.tensor_store import release_freed_memory
from kiln.runtime.spec import KernelFusion, LayerSpec, LinearSpec, ModelSpec

FP8_PER_TENSOR = ("per_channel", "skip")
ROW_TENSORS = ("weight",)  # one row per output row in every format
SHARED_TENSORS = ("weight_scale_2", "input_scale")  # one value per linear: fused parts must agree
CHECK_BATCH_TOKENS = 1024  # tokens per logits call of the gate metric ([tokens, vocab] twice at a time)


# --- stored tensors ---------------------------------------------------------------------------------------------
def concat_stored(fmt: str, parts: Sequence[Mapping[str, torch.Tensor]], rows: Sequence[int],
                  fp8_per_tensor: str = "per_channel") -> tuple[dict[str, torch.Tensor], tuple[str, ...]] | str:
    """The stored tensors (no module prefix) of one linear whose output rows are `parts`' rows in order, and each
    part's FP8 scale granularity when per-tensor scales had to become per-channel (else ()); or why not."""
    keys = set(parts[0])
    if any(set(p) != keys for p in parts):
        return f"their stored tensors differ ({', '.join(sorted(set().union(*parts) - keys)) or 'some are missing'})"
    out: dict[str, torch.Tensor] = {}
    part_scales: tuple[str, ...] = ()
    for key in sorted(keys):
        values = [p[key] for p in parts]
        if len({v.dtype for v in values}) > 1:
            return f"their {key} dtypes differ"
        if key in ROW_TENSORS or (key == "weight_scale" and not weight_format(fmt).per_tensor_weight_scale):
            out[key] = torch.cat(values)
        elif key == "weight_scale":  # FP8: [rows, 1] per channel, or one value per tensor
            per_tensor = [v.numel() == 1 for v in values]
            if not any(per_tensor):
                out[key] = torch.cat([v.reshape(n, 1) for v, n in zip(values, rows, strict=True)])
                continue
            if all(per_tensor) and all(torch.equal(v.reshape(()), values[0].reshape(())) for v in values):
                out[key] = values[0].clone()
                continue
            if fp8_per_tensor == "skip":
                return ("their FP8 weight scales are per-tensor and differ (" +
                        ", ".join(f"{float(v.reshape(-1)[0]):.4g}" if t else "per-channel"
                                  for v, t in zip(values, per_tensor, strict=True)) +
                        "); fp8_per_tensor='skip'")
            out[key] = torch.cat([v.reshape(1, 1).expand(n, 1) if t else v.reshape(n, 1)
                                  for v, t, n in zip(values, per_tensor, rows, strict=True)]).contiguous()
            part_scales = tuple("per_tensor" if t else "per_channel" for t in per_tensor)
        elif key in SHARED_TENSORS:
            if not all(torch.equal(v.reshape(-1), values[0].reshape(-1)) for v in values):
                what = ("NVFP4 per-tensor scales (weight_scale_2)" if key == "weight_scale_2"
                        else "activation quantizers (input_scale)")
                return (f"their {what} differ: " + ", ".join(f"{float(v.reshape(-1)[0]):.6g}" for v in values) +
                        "; one GEMM has one")
            out[key] = values[0].clone()
        else:
            return f"stored tensor {key!r} is not one this pass knows how to concatenate"
    return out, part_scales


def split_stored(fmt: str, tensors: Mapping[str, torch.Tensor], rows: Sequence[int],
                 part_scales: Sequence[str] = ()) -> list[dict[str, torch.Tensor]]:
    """`concat_stored`'s inverse: each part's stored tensors. A part recorded as per-tensor FP8 gets its one
    scale back (its rows must all hold it)."""
    out: list[dict[str, torch.Tensor]] = [{} for _ in rows]
    for key, value in tensors.items():
        if key in ROW_TENSORS or (key == "weight_scale" and (not weight_format(fmt).per_tensor_weight_scale
                                                              or value.numel() > 1)):
            if value.shape[0] != sum(rows):
                raise KilnError(f"fused tensor {key} has {value.shape[0]} rows, its parts {sum(rows)}")
            for i, piece in enumerate(value.split(list(rows))):
                if key == "weight_scale" and i < len(part_scales) and part_scales[i] == "per_tensor":
                    if not bool((piece == piece.reshape(-1)[0]).all()):
                        raise KilnError(f"fused FP8 part {i} is recorded per-tensor but its row scales differ")
                    piece = piece.reshape(-1)[0]
                out[i][key] = piece.clone()
        else:
            for part in out:
                part[key] = value.clone()
    return out


def _promoted(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    dtype = reduce(torch.promote_types, (t.dtype for t in tensors))
    return torch.cat([t.to(dtype) for t in tensors])


# --- the structure ----------------------------------------------------------------------------------------------
def unfuse_linears(linears: Mapping[str, LinearSpec]) -> dict[str, LinearSpec]:
    """A layer's linears table with each fused linear replaced by its parts (key prefix kept: shared_gate_up ->
    shared_gate, shared_up), in the original order."""
    out: dict[str, LinearSpec] = {}
    for key, lin in linears.items():
        if not lin.parts:
            out[key] = lin
            continue
        prefix = key.removesuffix(lin.role)
        out.update({f"{prefix}{part.role}": part for part in lin.parts})
    return out


def unfuse_spec(spec: ModelSpec) -> ModelSpec:
    """The spec as it was before `fuse`: fused linears replaced by their parts, no kernel fusions."""
    layers = tuple(dataclasses.replace(
        layer, fusions=(),
        attention=dataclasses.replace(layer.attention, linears=unfuse_linears(layer.attention.linears)),
        mlp=dataclasses.replace(layer.mlp, linears=unfuse_linears(layer.mlp.linears))) for layer in spec.layers)
    return dataclasses.replace(spec, layers=layers)


def is_fused(spec: ModelSpec) -> bool:
    return any(lin.parts for lin in spec.linears()) or any(layer.fusions for layer in spec.layers)


# --- the gate metric ---------------------------------------------------------------------------------------------
def _batches(token_lists: Sequence[Sequence[int]], tokens: int) -> list[list[Sequence[int]]]:
    out: list[list[Sequence[int]]] = []
    size = 0
    for t in token_lists:
        if not out or size + len(t) > tokens:
            out.append([])
            size = 0
        out[-1].append(t)
        size += len(t)
    return out


def logit_difference(paragraphs: int) -> Callable[[ExecutedGraph, ExecutedGraph, Sequence[Sequence[int]]], float]:
    """max |logits(candidate) - logits(before)| / max |logits(before)| over the first `paragraphs` token lists
    (0: all), a batch at a time, so full-vocabulary logits of the whole text never exist at once."""
    def measure(candidate: ExecutedGraph, before: ExecutedGraph, token_lists: Sequence[Sequence[int]]) -> float:
        lists = list(token_lists)[: paragraphs or None]
        worst, scale = 0.0, 0.0
        for batch in _batches(lists, CHECK_BATCH_TOKENS):
            for fused, unfused in zip(candidate.logits(batch), before.logits(batch), strict=True):
                worst = max(worst, float((fused.float() - unfused.float()).abs().max()))
                scale = max(scale, float(unfused.float().abs().max()))
        return worst / scale if scale > 0 else worst

    return measure


# --- the pass -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fusion(Pass):
    """Fuse q/k/v and gate/up into single linears and record the kernel fusions (see the module docstring).

    Fields:
        qkv              fuse each GQA/MHA layer's q_proj, k_proj, v_proj into qkv_proj
        gate_up          fuse each dense MLP's (and shared expert's) gate_proj and up_proj into gate_up_proj
        kernels          record the kernel-level fusions (rmsnorm_quant, swiglu_quant, rope_kv_write)
        fp8_per_tensor   FP8 parts with different per-tensor scales: "per_channel" (each row keeps its part's
                         scale; exact) or "skip" (leave the group unfused)
        check_paragraphs paragraphs of the gate text the logit comparison runs on (0: all of them)
        max_logit_diff   the gate metric's ceiling: max |logit difference| / max |logit|
    """

    qkv: bool = True
    gate_up: bool = True
    kernels: bool = True
    fp8_per_tensor: str = "per_channel"
    check_paragraphs: int = 128
    max_logit_diff: float = 1e-5

    name: ClassVar[str] = "fuse"
    must_be_last: ClassVar[bool] = True
    # an exact rewrite up to float summation order: its figures must not move
    default_floor: ClassVar[float] = 0.9999
    default_max_kl: ClassVar[float] = 1e-6
    default_min_top1: ClassVar[float] = 0.9999

    def __post_init__(self):
        for flag in ("qkv", "gate_up", "kernels"):
            if not isinstance(getattr(self, flag), bool):
                raise KilnError(f"fuse: {flag} must be true or false, got {getattr(self, flag)!r}")
        if not (self.qkv or self.gate_up or self.kernels):
            raise KilnError("fuse: qkv, gate_up and kernels are all false: the pass would fuse nothing")
        check_choice("fp8_per_tensor", self.fp8_per_tensor, FP8_PER_TENSOR)
        check_range("fuse: check_paragraphs", self.check_paragraphs, 0, MAX_PARAGRAPHS, integer=True,
                    why="0: all of the gate's")
        check_range("fuse: max_logit_diff", self.max_logit_diff, 0, 1, low_open=True, high_open=True)

    def metrics(self) -> tuple[PassMetric, ...]:
        return (PassMetric("max logit diff (relative)", self.max_logit_diff,
                           logit_difference(self.check_paragraphs), higher_is_better=False),)

    def apply(self, graph: ModelGraph, ctx: PassContext) -> PassResult:
        result = PassResult(self.name)
        quant: dict[str, QuantizedWeight] = {}  # fused linear -> its stored weight, set once the spec has it
        record: dict[str, dict] = {"linears": {}, "kernels": {}}
        layers = []
        for layer in progress.track(graph.spec.layers, f"{self.name}: fuse", unit="layers"):
            release_freed_memory()  # the layer before's weights, now spilled or stored
            layers.append(self._layer(graph, layer, result, quant, record))
        for module in graph.spec.extra_modules:
            result.skipped[module.name] = f"{module.kind} module: left unfused (speculative decoding builds it as is)"
        graph.set_spec(dataclasses.replace(graph.spec, layers=tuple(layers)))
        for name, qw in quant.items():
            graph.linears[name].quant = qw
        graph.metadata["fusion"] = record
        result.metrics.update({"fused_linears": len(record["linears"]),
                               "kernel_fusions": sum(map(len, record["kernels"].values()))})
        return result

    # --- one layer ----------------------------------------------------------------------------------------------
    def _layer(self, graph: ModelGraph, layer: LayerSpec, result: PassResult, quant: dict[str, QuantizedWeight],
               record: dict) -> LayerSpec:
        a, m = layer.attention, layer.mlp
        attention_linears, mlp_linears = dict(a.linears), dict(m.linears)
        if a.kind == "mla":
            result.skipped[f"{layer.prefix}.self_attn"] = ("MLA attention: fusing q_a/kv_a and its kernels is not "
                                                           "implemented")
        elif "qkv" in a.linears:
            result.skipped[f"{layer.prefix}.self_attn"] = "already fused"
        elif self.qkv:
            if all(r in a.linears for r in ("q", "k", "v")):
                attention_linears = self._fuse(graph, a.linears, ("q", "k", "v"), "qkv", result, quant, record)
            else:
                result.skipped[f"{layer.prefix}.self_attn"] = (f"no plain q/k/v projections to fuse "
                                                               f"({', '.join(a.linears)})")
        if self.gate_up:
            prefixes = [""] if m.kind == "dense" else ["shared_"] if "shared_gate" in m.linears else []
            for prefix in prefixes:
                if f"{prefix}gate" in mlp_linears and f"{prefix}up" in mlp_linears:
                    mlp_linears = self._fuse(graph, mlp_linears, (f"{prefix}gate", f"{prefix}up"),
                                             f"{prefix}gate_up", result, quant, record)
        if m.kind == "moe":
            result.skipped[f"{layer.prefix}.mlp.experts"] = ("routed experts: left separate (a grouped-GEMM MoE "
                                                             "kernel fuses each expert's gate/up its own way)")
        fusions = self._kernels(graph, layer, attention_linears, mlp_linears, result, quant) if self.kernels else ()
        if fusions:
            record["kernels"][str(layer.index)] = [{"kind": f.kind, "ops": list(f.ops)} for f in fusions]
        return dataclasses.replace(layer, attention=dataclasses.replace(a, linears=attention_linears),
                                   mlp=dataclasses.replace(m, linears=mlp_linears),
                                   fusions=layer.fusions + fusions)

    def _fuse(self, graph: ModelGraph, linears: Mapping[str, LinearSpec], keys: tuple[str, ...], fused_key: str,
              result: PassResult, quant: dict[str, QuantizedWeight], record: dict) -> dict[str, LinearSpec]:
        """`linears` with `keys` replaced by one fused linear at the first one's place, or unchanged (and the
        reason in result.skipped) when the group cannot fuse."""
        specs = [linears[k] for k in keys]
        parent = specs[0].name.rsplit(".", 1)[0]
        name = f"{parent}.{fused_key.removeprefix('shared_')}_proj"
        role = fused_key.removeprefix("shared_")
        built = self._fused_weight(graph, specs, parent, name)
        if isinstance(built, str):
            result.skipped[name] = f"not fused: {built}"
            return dict(linears)
        weight, bias, qw, what = built
        fused = LinearSpec(name, role, specs[0].in_features, sum(s.out_features for s in specs), specs[0].layer,
                           bias=bias is not None, parts=tuple(specs))
        graph.tensors[f"{name}.weight"] = weight  # source precision (lowering stores `qw` in its place)
        if bias is not None:
            graph.tensors[f"{name}.bias"] = bias
        for s in specs:
            del graph.tensors[f"{s.name}.weight"]
            if s.bias:
                del graph.tensors[f"{s.name}.bias"]
        if qw is not None:
            quant[name] = qw
        result.changed[name] = what
        record["linears"][name] = [s.name for s in specs]
        out: dict[str, LinearSpec] = {}
        for key, lin in linears.items():
            if key == keys[0]:
                out[fused_key] = fused
            elif key not in keys:
                out[key] = lin
        return out

    def _fused_weight(self, graph: ModelGraph, specs: list[LinearSpec], parent: str, name: str
                      ) -> tuple[torch.Tensor, torch.Tensor | None, QuantizedWeight | None, str] | str:
        """(source weight, bias or None, stored weight or None, what it became) of the fused linear, or why not."""
        if any(s.name.rsplit(".", 1)[0] != parent for s in specs):
            return "they are not in one module"
        if name in graph.linears or f"{name}.weight" in graph.tensors:
            return f"{name} exists already"
        lins: list[Linear] = [graph.linears[s.name] for s in specs]
        formats = [lin.format for lin in lins]
        if len(set(formats)) > 1:
            return f"formats differ ({', '.join(formats)}): one GEMM has one format"
        short = " + ".join(s.name.rsplit(".", 1)[-1] for s in specs)
        rows = [s.out_features for s in specs]
        weight = _promoted([graph.tensors[f"{s.name}.weight"] for s in specs])
        bias = None
        if any(s.bias for s in specs):  # a part without one adds zeros (exact)
            bias = _promoted([graph.tensors[f"{s.name}.bias"] if s.bias else torch.zeros(s.out_features)
                              for s in specs])
        shape = f"[{sum(rows)}, {specs[0].in_features}]"
        extra = " + bias" if bias is not None else ""
        if lins[0].quant is None:
            return weight, bias, None, f"{short} -> one dense linear {shape}{extra}"
        qws = [lin.quant for lin in lins]
        for field_name, what in (("activation", "activation formats"), ("rotation_block", "input rotations"),
                                 ("in_features", "stored input widths")):
            values = [getattr(q, field_name) for q in qws]
            if len(set(values)) > 1:
                return f"their {what} differ ({', '.join(map(str, values))}); one GEMM has one input"
        stored = concat_stored(qws[0].format, [dict(q.tensors) for q in qws], rows, self.fp8_per_tensor)
        if isinstance(stored, str):
            return stored
        tensors, part_scales = stored
        methods = list(dict.fromkeys(q.method for q in qws))
        qw = dataclasses.replace(qws[0], tensors=tensors, method="/".join(methods), part_scales=part_scales)
        act = f" + {qw.activation} activations" if qw.activation != ActivationFormat.NONE else ""
        scales = " (per-tensor FP8 scales became per-channel)" if part_scales else ""
        return weight, bias, qw, f"{short} -> one {qw.format}{act} linear {shape}{extra}{scales}"

    # --- kernel fusions -----------------------------------------------------------------------------------------
    def _kernels(self, graph: ModelGraph, layer: LayerSpec, attention: Mapping[str, LinearSpec],
                 mlp: Mapping[str, LinearSpec], result: PassResult, quant: Mapping[str, QuantizedWeight]
                 ) -> tuple[KernelFusion, ...]:
        p, a, m = layer.prefix, layer.attention, layer.mlp
        if layer.fusions:
            result.skipped[f"{p}.kernel"] = "kernel fusions already recorded"
            return ()
        found: list[tuple[str, KernelFusion, str]] = []  # (result key, fusion, what)

        def stored(lin: LinearSpec) -> QuantizedWeight | None:
            if lin.name in quant:  # fused just now (a dense fused linear has no entry, nor a graph linear yet)
                return quant[lin.name]
            return graph.linears[lin.name].quant if lin.name in graph.linears else None

        def quantizes_input(lin: LinearSpec) -> str | None:
            """Why the linear's input quantization cannot fuse into the op before it, or None."""
            qw = stored(lin)
            if qw is None or qw.activation == ActivationFormat.NONE:
                fmt = qw.format if qw is not None else WeightFormat.DENSE
                return f"{lin.name.rsplit('.', 1)[-1]} quantizes no activations ({fmt} weights only)"
            if qw.rotation_block:
                return f"{lin.name.rsplit('.', 1)[-1]} rotates its input online (block Hadamard) before quantizing it"
            return None

        if a.kind == "mla":
            pass  # skipped with the attention above
        elif a.rotary.dim == 0:
            result.skipped[f"{p}.kernel.rope_kv_write"] = "no rotary embedding"
        else:
            producers = (attention["qkv"].name,) if "qkv" in attention else tuple(
                attention[r].name for r in ("q", "k", "v") if r in attention)
            found.append((f"{p}.kernel.rope_kv_write", KernelFusion("rope_kv_write", producers),
                          "RoPE on q/k + KV-cache write in one kernel"))
        candidates = []  # (key, kind, producer norm or gate/up ops, consumer)
        if a.kind != "mla":
            candidates.append((f"{p}.kernel.rmsnorm_quant.attention", "rmsnorm_quant", (layer.norms[0],),
                               attention.get("qkv"), "q/k/v are not fused: the norm feeds three linears"))
        if m.kind == "dense":
            candidates.append((f"{p}.kernel.rmsnorm_quant.mlp", "rmsnorm_quant", (layer.norms[1],),
                               mlp.get("gate_up"), "gate/up are not fused: the norm feeds two linears"))
            gate_ops = (mlp["gate_up"].name,) if "gate_up" in mlp else (mlp["gate"].name, mlp["up"].name)
            if m.activation == "silu":
                candidates.append((f"{p}.kernel.swiglu_quant", "swiglu_quant", gate_ops, mlp["down"], ""))
            else:
                result.skipped[f"{p}.kernel.swiglu_quant"] = (f"the MLP's gate is {m.activation}, not SiLU: no "
                                                              "swiglu_quant kernel for it")
        else:
            result.skipped[f"{p}.kernel.mlp"] = ("MoE MLP: the post-attention norm feeds the router in full "
                                                 "precision and the experts run grouped")
        for key, kind, ops, consumer, unfused in candidates:
            if consumer is None:
                result.skipped[key] = unfused
                continue
            why = quantizes_input(consumer)
            if why:
                result.skipped[key] = f"{why}: nothing to fuse"
                continue
            act = stored(consumer).activation
            what = ("RMSNorm + " if kind == "rmsnorm_quant" else "silu(gate) * up + ") + f"{act} quantization"
            found.append((key, KernelFusion(kind, (*ops, consumer.name)), what + " in one kernel"))
        for key, fusion, what in found:
            result.changed[key] = what
        return tuple(f for _, f, _ in found)
