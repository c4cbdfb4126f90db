"""The ONNX export's lowering: a ModelSpec and the artifact's tensors -> one ONNX graph (opset 23) with a KV
cache, as optimizer/export/onnx.py's docstring describes it (interface, each linear, the KV cache, structures).

    model, taps = lower(spec, formats, kv_table, tensors, inits)      the graph and its quantizers
    taps = write_graph(directory, spec, formats, kv_table, tensors, external)    DIR/model.onnx
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from kiln.kernels.formats import ActivationFormat, WeightFormat
from kiln.optimizer.export.onnx_graph import (
    DATA_FILE,
    MODEL_FILE,
    ArtifactTensors,
    GraphBuilder,
    Initializers,
    float32,
)
from kiln.optimizer.export.onnx_qdq import Tap, fp8_dynamic, fp8_static, kv_store, rotate, weight_nodes
from kiln.runtime.kv_format import KvStream, resolve_kv_streams
from kiln.runtime.spec import AttentionSpec, LayerSpec, LinearSpec, ModelSpec, RotarySpec

OPSET = 23
IR_VERSION = 11  # the IR that opset 23 (and FLOAT4E2M1) needs
LOWEST = float(np.finfo(np.float32).min)  # the additive mask: exp(LOWEST - max) is 0, with no inf arithmetic


def write_graph(directory: Path, spec: ModelSpec, formats: Mapping, kv_table: Mapping | None,
                tensors: ArtifactTensors, external: bool, fake_quantize: bool = True) -> list[Tap]:
    """Lower the model into directory/model.onnx (its weights in model.onnx.data when `external`)."""
    with Initializers(directory / DATA_FILE if external else None) as inits:
        model, taps = lower(spec, formats, kv_table, tensors, inits, fake_quantize)
    onnx.save_model(model, str(directory / MODEL_FILE))
    return taps


@dataclass
class Lowering:
    """The graph being lowered: each block of the model as nodes, reading the artifact's tensors."""

    g: GraphBuilder
    spec: ModelSpec
    formats: Mapping[str, Mapping]
    tensors: ArtifactTensors
    tokens_shape: str = ""  # Shape(input_ids): [B, T]
    embedding: str = ""  # the embedding's initializer (a tied lm_head reads it too)
    weight_kinds: set[str] = field(default_factory=set)  # the formats lowered, for the summary
    rotaries: int = 0  # distinct RotarySpecs so far
    fake_quantize: bool = True  # False: leave out the activation and KV quantizers (the check's bypass graph)
    taps: list[Tap] = field(default_factory=list)  # every quantizer: its input and output, for the check

    # -- weights ------------------------------------------------------------------------------------------------
    def weight(self, lin: LinearSpec) -> str:
        """The fp32 [out, in] weight of `lin` as the graph computes it from the stored format."""
        name = lin.name
        entry = self.formats.get(name, {"format": WeightFormat.DENSE})
        if name == "lm_head" and self.spec.lm_head_tied(set(self.tensors)):
            self.weight_kinds.add("dense")
            return self.embedding
        fmt = entry["format"]
        self.weight_kinds.add(fmt)
        return weight_nodes(self.g, lin, fmt, self.tensors)

    def linear(self, lin: LinearSpec, x: str, inputs: dict) -> str:
        """x [tokens, in] -> [tokens, out]; `inputs` caches the transformed input shared by sibling linears."""
        entry = self.formats.get(lin.name, {"format": WeightFormat.DENSE})
        x = self.input_transform(lin, entry, x, inputs)  # as the runtime: the entry's, even for a tied lm_head
        operands = [x, self.weight(lin)]
        if lin.bias:
            operands.append(self.g.initializer(f"{lin.name}.bias", float32(self.tensors[f"{lin.name}.bias"])))
        return self.g.op("Gemm", operands, lin.name, transB=1)

    def input_transform(self, lin: LinearSpec, entry: Mapping, x: str, inputs: dict) -> str:
        name = lin.name
        rotation = entry.get("input_rotation")
        if rotation:
            key = (x, "rotation", rotation["block_size"])
            if key not in inputs:
                inputs[key] = rotate(self.g, x, lin.in_features, rotation["block_size"], name)
            x = inputs[key]
        act = entry.get("activation", ActivationFormat.NONE)
        if act == ActivationFormat.NONE or not self.fake_quantize:
            return x
        key = (x, act, name if act == ActivationFormat.FP8_STATIC_PER_TENSOR else "")  # static: its own scale
        if key not in inputs:
            if act == ActivationFormat.FP8_STATIC_PER_TENSOR:
                scale = float32(self.tensors[f"{name}.input_scale"]).reshape(())
                inputs[key] = fp8_static(self.g, x, scale, None, f"{name}.input")
                self.taps.append(Tap(act, name, x, inputs[key], scale=scale))
            else:  # fp8_dynamic_per_token (check_lowerable refused the FP4 ones)
                inputs[key] = fp8_dynamic(self.g, x, [1], name)
                self.taps.append(Tap(act, name, x, inputs[key]))
        return inputs[key]

    # -- blocks ------------------------------------------------------------------------------------------------
    def rms_norm(self, x: str, weight: str, axis: int = -1) -> str:
        g = self.g
        mean = g.op("ReduceMean", [g.op("Mul", [x, x], weight), g.const([axis], np.int64)], weight, keepdims=1)
        inv = g.op("Reciprocal", [g.op("Sqrt", [g.op("Add", [mean, g.const(self.spec.rms_norm_eps)], weight)],
                                       weight)], weight)
        # Gemma: the norm scales by (1 + w), added in fp32 here as the runtime adds it
        w = g.initializer(weight, float32(self.tensors[weight]) + np.float32(self.spec.norm_offset))
        return g.op("Mul", [w, g.op("Mul", [x, inv], weight)], weight)

    def heads(self, x: str, heads: int, dim: int, name: str) -> str:
        """[B*T, heads*dim] -> [B, T, heads, dim]."""
        shape = self.g.op("Concat", [self.tokens_shape, self.g.const([heads, dim], np.int64)], name, axis=0)
        return self.g.op("Reshape", [x, shape], name)

    def rope(self, x: str, cos: str, sin: str, name: str) -> str:
        """x [B, H, T, D], cos/sin [B, 1, T, D]: x cos + rotate_half(x) sin."""
        g = self.g
        first, second = g.ops("Split", [x], name, 2, axis=-1, num_outputs=2)
        rotated = g.op("Concat", [g.op("Neg", [second], name), first], name, axis=-1)
        return g.op("Add", [g.op("Mul", [x, cos], name), g.op("Mul", [rotated, sin], name)], name)

    def rotary_tables(self, spec: RotarySpec, positions: str) -> tuple[str, str]:
        """cos, sin [B, 1, T, D] for one RotarySpec (runtime.attention.Rotary)."""
        g = self.g
        inv_freq = g.initializer(f"rotary.{self.rotaries}.inv_freq", np.asarray(spec.inv_freq, np.float32))
        self.rotaries += 1
        freqs = g.op("Mul", [g.op("Unsqueeze", [positions, g.const([-1], np.int64)], "rotary"), inv_freq], "rotary")
        emb = g.op("Unsqueeze", [g.op("Concat", [freqs, freqs], "rotary", axis=-1), g.const([1], np.int64)], "rotary")
        cos, sin = g.op("Cos", [emb], "rotary"), g.op("Sin", [emb], "rotary")
        if spec.attention_scaling != 1.0:
            cos = g.op("Mul", [cos, g.const(spec.attention_scaling)], "rotary")
            sin = g.op("Mul", [sin, g.const(spec.attention_scaling)], "rotary")
        return cos, sin

    def kv_store(self, x: str, stream: KvStream, name: str) -> str:
        """What the layer's KV format stores for new K or V [B, Hkv, T, D], read back in fp32."""
        if not stream.codec.quantized or not self.fake_quantize:
            return x
        out, tap = kv_store(self.g, x, stream, name)
        self.taps.append(tap)
        return out

    def projection(self, a: AttentionSpec, role: str, x: str, inputs: dict) -> str:
        if role in a.linears:
            return self.linear(a.linears[role], x, inputs)
        return self.linear(a.linears[f"{role}_up"], self.linear(a.linears[f"{role}_down"], x, inputs), {})

    def attention(self, layer: LayerSpec, x: str, rope: tuple[str, str], mask: str, streams) -> str:
        g, a = self.g, layer.attention
        p = f"{layer.prefix}.self_attn"
        i = layer.index
        inputs: dict = {}
        widths = (a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.v_head_dim)
        if "qkv" in a.linears:  # fused by passes/fuse.py: one Gemm, its output split as the runtime splits it
            q, k, v = g.ops("Split", [self.linear(a.linears["qkv"], x, inputs), g.const(widths, np.int64)], p, 3,
                            axis=1)
        else:
            q, k, v = (self.linear(a.linears["q"], x, inputs), self.projection(a, "k", x, inputs),
                       self.projection(a, "v", x, inputs))
        q = self.heads(q, a.num_heads, a.head_dim, p)
        k = self.heads(k, a.num_kv_heads, a.head_dim, p)
        v = self.heads(v, a.num_kv_heads, a.v_head_dim, p)
        if a.qk_norm:
            q, k = self.rms_norm(q, f"{p}.q_norm.weight"), self.rms_norm(k, f"{p}.k_norm.weight")
        q, k, v = (g.op("Transpose", [t], p, perm=[0, 2, 1, 3]) for t in (q, k, v))  # [B, H, T, D]
        q, k = self.rope(q, *rope, p), self.rope(k, *rope, p)
        k, v = self.kv_store(k, streams[0], f"{p}.k_cache"), self.kv_store(v, streams[1], f"{p}.v_cache")
        g.nodes.append(helper.make_node("Concat", [f"past_key_values.{i}.key", k], [f"present.{i}.key"], axis=2,
                                        name=f"present.{i}.key"))
        g.nodes.append(helper.make_node("Concat", [f"past_key_values.{i}.value", v], [f"present.{i}.value"], axis=2,
                                        name=f"present.{i}.value"))
        # GQA without repeating K/V: the H query heads as [B, Hkv, groups, T, D] against [B, Hkv, 1, S, D]
        groups = a.num_heads // a.num_kv_heads
        q5 = g.op("Reshape", [q, g.const([0, a.num_kv_heads, groups, -1, a.head_dim], np.int64)], p)
        k5 = g.op("Unsqueeze", [f"present.{i}.key", g.const([2], np.int64)], p)
        v5 = g.op("Unsqueeze", [f"present.{i}.value", g.const([2], np.int64)], p)
        scores = g.op("MatMul", [q5, g.op("Transpose", [k5], p, perm=[0, 1, 2, 4, 3])], p)
        scores = g.op("Add", [g.op("Mul", [scores, g.const(a.softmax_scale)], p), mask], p)
        out = g.op("MatMul", [g.op("Softmax", [scores], p, axis=-1), v5], p)  # [B, Hkv, groups, T, Dv]
        out = g.op("Reshape", [out, g.const([0, a.num_heads, -1, a.v_head_dim], np.int64)], p)
        out = g.op("Transpose", [out], p, perm=[0, 2, 1, 3])
        out = g.op("Reshape", [out, g.const([-1, a.num_heads * a.v_head_dim], np.int64)], p)
        return self.linear(a.linears["o"], out, {})

    def mlp(self, layer: LayerSpec, x: str) -> str:
        g, lin = self.g, layer.mlp.linears
        inputs: dict = {}
        name = f"{layer.prefix}.mlp"
        if "gate_up" in lin:  # fused by passes/fuse.py
            width = lin["down"].in_features
            gate, up = g.ops("Split", [self.linear(lin["gate_up"], x, inputs), g.const([width, width], np.int64)],
                             name, 2, axis=1)
        else:
            gate, up = self.linear(lin["gate"], x, inputs), self.linear(lin["up"], x, inputs)
        if layer.mlp.activation == "gelu_tanh":  # x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3): runtime.gelu_tanh
            cube = g.op("Mul", [g.op("Mul", [gate, gate], name), gate], name)
            inner = g.op("Add", [gate, g.op("Mul", [cube, g.const(0.044715)], name)], name)
            twice_u = g.op("Mul", [inner, g.const(2 * 0.7978845608028654)], name)
            act = g.op("Mul", [gate, g.op("Sigmoid", [twice_u], name)], name)
        else:
            act = g.op("Mul", [gate, g.op("Sigmoid", [gate], name)], name)
        hidden = g.op("Mul", [act, up], name)
        return self.linear(lin["down"], hidden, {})

    def mask(self, positions: str, window: int | None) -> str:
        """Additive mask [B, 1, 1, T, S]: 0 where key position <= query position (and within the window)."""
        g = self.g
        past = g.op("Shape", [f"past_key_values.{self.spec.layers[0].index}.key"], "mask", start=2, end=3)
        seq = g.op("Shape", ["input_ids"], "mask", start=1, end=2)
        total = g.op("Squeeze", [g.op("Add", [past, seq], "mask"), g.const([0], np.int64)], "mask")
        keys = g.op("Range", [g.const(0, np.int64), total, g.const(1, np.int64)], "mask")  # [S]
        queries = g.op("Unsqueeze", [positions, g.const([1, 2, 4], np.int64)], "mask")  # [B, 1, 1, T, 1]
        allowed = g.op("LessOrEqual", [keys, queries], "mask")
        if window is not None:
            start = g.op("Sub", [queries, g.const(window, np.int64)], "mask")
            allowed = g.op("And", [allowed, g.op("Greater", [keys, start], "mask")], "mask")
        return g.op("Where", [allowed, g.const(0.0), g.const(LOWEST)], "mask")


def lower(spec: ModelSpec, formats: Mapping[str, Mapping], kv_table: Mapping | None, tensors: ArtifactTensors,
          inits: Initializers, fake_quantize: bool = True) -> tuple[onnx.ModelProto, list[Tap]]:
    """The ONNX model of `spec` with the artifact's tensors (see the module docstring), and its quantizers.
    `fake_quantize` False leaves the activation and KV quantizers out (the check's bypass graph)."""
    g = GraphBuilder(inits)
    low = Lowering(g, spec, formats, tensors, fake_quantize=fake_quantize)
    streams = resolve_kv_streams(spec, kv_table, tensors)
    low.tokens_shape = g.op("Shape", ["input_ids"], "tokens")
    low.embedding = g.initializer(spec.embedding, float32(tensors[spec.embedding]))
    x = g.op("Reshape", [g.op("Gather", [low.embedding, "input_ids"], "embed", axis=0),
                         g.const([-1, spec.hidden_size], np.int64)], "embed")  # [B*T, C]
    if spec.embedding_scale != 1.0:  # Gemma: rows times sqrt(hidden), an fp32 scalar
        x = g.op("Mul", [x, g.const(spec.embedding_scale)], "embed")
    positions = g.op("Cast", ["position_ids"], "rotary", to=TensorProto.FLOAT)
    tables: dict[RotarySpec, tuple[str, str]] = {}
    masks: dict[int | None, str] = {}
    for layer, layer_streams in zip(spec.layers, streams, strict=True):
        a = layer.attention
        if a.rotary not in tables:
            tables[a.rotary] = low.rotary_tables(a.rotary, positions)
        if a.sliding_window not in masks:
            masks[a.sliding_window] = low.mask("position_ids", a.sliding_window)
        h = low.rms_norm(x, layer.norms[0])
        attended = low.attention(layer, h, tables[a.rotary], masks[a.sliding_window], layer_streams)
        mlp_norm = layer.norms[1]
        if layer.output_norms:  # Gemma's sandwich: each sublayer's output normed before its residual add
            attended = low.rms_norm(attended, layer.output_norms[0])
        x = g.op("Add", [x, attended], layer.prefix)
        out = low.mlp(layer, low.rms_norm(x, mlp_norm))
        if layer.output_norms:
            out = low.rms_norm(out, layer.output_norms[1])
        x = g.op("Add", [x, out], layer.prefix)
    logits = low.linear(spec.lm_head, low.rms_norm(x, spec.final_norm), {})
    shape = g.op("Concat", [low.tokens_shape, g.const([spec.vocab_size], np.int64)], "logits", axis=0)
    g.nodes.append(helper.make_node("Reshape", [logits, shape], ["logits"], name="logits"))

    def value(name, elem, dims):
        return helper.make_tensor_value_info(name, elem, dims)

    inputs = [value("input_ids", TensorProto.INT64, ["batch", "seq"]),
              value("position_ids", TensorProto.INT64, ["batch", "seq"])]
    outputs = [value("logits", TensorProto.FLOAT, ["batch", "seq", spec.vocab_size])]
    for layer in spec.layers:
        a, i = layer.attention, layer.index
        for kind, dim in (("key", a.head_dim), ("value", a.v_head_dim)):
            inputs.append(value(f"past_key_values.{i}.{kind}", TensorProto.FLOAT,
                                ["batch", a.num_kv_heads, "past_seq", dim]))
            outputs.append(value(f"present.{i}.{kind}", TensorProto.FLOAT, ["batch", a.num_kv_heads, "total_seq", dim]))
    graph = helper.make_graph(g.nodes, f"kiln-{spec.model_type}", inputs, outputs, initializer=inits.tensors)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="kiln",
                              ir_version=IR_VERSION)
    kinds = sorted(low.weight_kinds)
    kv = sorted({f"{s.format}" + (f" {s.scaling}" if s.scaling != "none" else "") for layer in streams for s in layer})
    helper.set_model_props(model, {"kiln.weights": ", ".join(kinds), "kiln.kv_cache": ", ".join(kv)})
    return model, low.taps
