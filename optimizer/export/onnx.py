"""`optimize export ART --format onnx -o DIR`: the artifact's decoder as one ONNX graph (opset 23) with a KV
cache, its weights kept in their stored number formats behind DequantizeLinear, so the graph computes what
Kiln's runtime computes (fp32 arithmetic on the dequantized values).

    DIR/model.onnx         the graph (DIR/model.onnx.data beside it holds the weights when they pass 1 GiB)
    DIR/onnx_check.json    the check run after writing: the runner, the tokens, the max |logit difference|
    DIR/kiln_export.json   the export marker

Interface (named dims: batch, seq, past_seq; total_seq = past_seq + seq):
    inputs   input_ids, position_ids            int64 [batch, seq]
             past_key_values.{i}.key / .value   float32 [batch, kv_heads, past_seq, head_dim] for each layer i
                                                (past_seq 0 for a prefill)
    outputs  logits                             float32 [batch, seq, vocab]
             present.{i}.key / .value           float32 [batch, kv_heads, total_seq, head_dim]: past, then new
There is no attention_mask: cached keys sit at positions 0..total_seq-1 (as Kiln's cache holds them) and a
query at position p attends to the keys at positions <= p (and within a sliding window), so the rows of a
batch have one length; decoding feeds the presents back as the next step's past.

Lowering, per linear (weights [out, in] as stored; each product is Gemm(x [tokens, in], W, bias, transB=1)):
    dense (fp32/bf16/fp16)  float32 initializer
    fp8_e4m3                FLOAT8E4M3FN initializer -> DequantizeLinear (fp32 scale per tensor, or [out] axis 0)
    nvfp4                   FLOAT4E2M1 codes [out, Kp] (the artifact's bytes), FLOAT8E4M3FN block scales
                            [out, Kp/16] and the fp32 global scale: DequantizeLinear(block scales, global) gives
                            the fp32 block scales, DequantizeLinear(codes, those, axis 1, block_size 16) the
                            weight; Slice drops the padding columns (K -> Kp, a multiple of 16)
    mxfp4                   FLOAT4E2M1 codes [out, Kp] and the E8M0 block scales as bfloat16 (every power of two
                            2^-127..2^127 is exact there; opset 23 has no E8M0): DequantizeLinear(axis 1,
                            block_size 32, output_dtype float), then Slice
  the linear's input, first rotated (`input_rotation`: block Hadamard as MatMul on [.., K/b, b]), then:
    fp8_static_per_tensor   QuantizeLinear -> DequantizeLinear with the calibrated input_scale (FLOAT8E4M3FN)
    fp8_dynamic_per_token   scale = max|x| over the row / 448 (1 where 0); Cast(Clip(x / scale), FLOAT8E4M3FN),
                            Cast back, times scale: kernels.fp8's fake quantizer, op for op
    nvfp4 / mxfp4 (W4A4)    refused: dynamic FP4 block quantization of activations is not lowered
KV cache (the manifest's kv_cache table): the new K/V pass through the layer's format before joining the
presents, as Kiln's cache stores them, and the presents stay float32 holding the stored values:
    bf16                    unchanged (fp32, as Kiln's CPU runtime holds a BF16 layer's cache)
    fp8_e4m3                QuantizeLinear -> DequantizeLinear with the static per-tensor or per-KV-head scale
                            (axis 1), around the calibrated offset when there is one; "dynamic": one scale per
                            token computed with ops as above
    nvfp4                   refused (not lowered)
Structures: dense GQA/MHA decoders (Llama, Mistral, Qwen2/3 with q/k norms, biases, sliding windows, a
low-rank K/V pair, fused qkv / gate_up linears split after their one Gemm; a layer's kernel fusions change no
numerics and are not expressed). MLA and MoE layers are refused; extra modules (draft heads, MTP layers) are not
exported and the summary says so.

The check, after writing (a failure is one line and leaves nothing): onnxruntime's CPU provider runs the
graph (onnx.reference.ReferenceEvaluator runs FP4 graphs: onnxruntime 1.32 has no FP4 DequantizeLinear) on a
batch of two rows, a prefill from an empty past and then one token at a time with the presents fed back, and
every position's logits are compared with Kiln's runtime (`runtime.load(ART).logits`).
    no activation/KV quantizers  every position within 1e-3
    with them                    1e-3 cannot hold: Kiln's own W8A8 logits move by more when its input moves by
                                 one fp32 ulp (SmolLM2-135M: by up to 2.9), because an activation within
                                 rounding of an FP8 midpoint rounds the other way and the KV cache carries that
                                 to every later position. So (a) every quantizer's output in the graph, on the
                                 check's own activations, must equal kernels/' fake quantizer of its input bit
                                 for bit, and (b) the graph lowered without them must match the runtime without
                                 them (activation "none", BF16 KV) within 1e-3. The full graph's figures are
                                 recorded too (onnx_check.json: max difference, positions within 1e-3, top-1).
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import ml_dtypes
import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import set_external_data

from kiln.kernels.errors import KilnError
from kiln.kernels.formats import ActivationFormat, KvFormat, WeightFormat
from kiln.kernels.fp8 import E4M3_MAX
from kiln.optimizer.output_dir import atomic_directory, check_output, mark_export
from kiln.optimizer.export.unfuse import artifact_is_fused, unfuse_artifact
from kiln.passes.fuse import unfuse_spec
from kiln.runtime.artifact import WEIGHTS, artifact_file, clip, read_manifest
from kiln.runtime.kv_format import KvStream, resolve_kv_streams
from kiln.runtime.spec import AttentionSpec, LayerSpec, LinearSpec, ModelSpec, RotarySpec, spec_from_json

OPSET = 23
IR_VERSION = 11  # the IR that opset 23 (and FLOAT4E2M1) needs
MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
CHECK_FILE = "onnx_check.json"
EXTERNAL_DATA_BYTES = 1 << 30
"""Weights above this go to DATA_FILE (a protobuf holds at most 2 GiB); below it they stay in the graph."""
EXTERNAL_MIN_BYTES = 1024  # smaller initializers (shapes, scalars) stay inline either way
TOLERANCE = 1e-3
"""Largest |logit difference| the check accepts between the graph and Kiln's runtime."""
CHECK_PREFILL, CHECK_DECODE, CHECK_BATCH = 5, 3, 2
FP4_BLOCK = {WeightFormat.NVFP4: 16, WeightFormat.MXFP4: 32}
LOWEST = float(np.finfo(np.float32).min)  # the additive mask: exp(LOWEST - max) is 0, with no inf arithmetic


def export_onnx(artifact: Path | str, output: Path | str, overwrite: bool = False,
                external_data: bool | None = None) -> Path:
    """Write the artifact as DIR/model.onnx and check it against Kiln's runtime (see the module docstring).
    `external_data`: weights in DIR/model.onnx.data (None: when they pass EXTERNAL_DATA_BYTES)."""
    from kiln.runtime import load

    artifact, output = Path(artifact), Path(output)
    manifest = read_manifest(artifact)
    fused = artifact_is_fused(manifest)
    spec = unfuse_spec(spec_from_json(manifest["architecture"]))
    check_lowerable(spec, manifest)
    check_output(output, overwrite, [artifact])
    engine = load(artifact)  # checks every tensor against the spec (shapes, dtypes, finite values, KV scales)
    weights = artifact_file(artifact, manifest, WEIGHTS)
    with _open_tensors(weights) as tensors:
        if external_data is None:
            external_data = _exported_bytes(tensors) > EXTERNAL_DATA_BYTES
        if fused:  # the fuse pass's qkv / gate_up linears go into the graph as their parts, as the HF exports write
            manifest, tensors = unfuse_artifact(manifest, {name: tensors[name] for name in tensors})
        with atomic_directory(output, overwrite, [artifact]) as tmp:
            taps = _write(tmp, spec, manifest["formats"], manifest.get("kv_cache"), tensors, external_data)
            onnx.checker.check_model(str(tmp / MODEL_FILE), full_check=True)
            check = check_export(tmp, engine, spec, manifest["formats"], tensors, taps, external_data)
            check["skipped_modules"] = [f"{m.kind} {m.name}" for m in spec.extra_modules]
            (tmp / CHECK_FILE).write_text(json.dumps(check, indent=2) + "\n")
            mark_export(tmp, artifact, "onnx")
    return output


def _write(directory: Path, spec: ModelSpec, formats: Mapping, kv_table: Mapping | None, tensors: _Tensors,
           external: bool, fake_quantize: bool = True) -> list[_Tap]:
    with _Initializers(directory / DATA_FILE if external else None) as inits:
        model, taps = lower(spec, formats, kv_table, tensors, inits, fake_quantize)
    onnx.save_model(model, str(directory / MODEL_FILE))
    return taps


def describe(path: Path | str) -> str:
    """What an ONNX export at `path` holds and how its check went, for the CLI's one line."""
    c = json.loads((Path(path) / CHECK_FILE).read_text())
    head = f"(onnx, opset {OPSET}, weights {c['weights']}, KV {c['kv_cache']}); {c['runner']}"
    steps = f"a {c['prefill']}-token prefill and {c['decode_steps']} decode steps"
    skipped = f"; not exported: {', '.join(c['skipped_modules'])}" if c.get("skipped_modules") else ""
    apart = (f" (max {c['max_abs_logit_diff']:.2e}: activations within fp32 rounding of an FP8 midpoint round "
             "apart)" if c["positions_within_tolerance"] < c["positions"] else "")
    if "quantizers_bit_exact" not in c:
        return f"{head} logits match the runtime's within {c['max_abs_logit_diff']:.2e} over {steps}{skipped}"
    return (f"{head}: its {c['quantizers_bit_exact']} activation/KV quantizers match Kiln's bit for bit, and without "
            f"them its logits match the runtime's within {c['without_quantizers_max_abs_logit_diff']:.2e} over "
            f"{steps}; with them {c['positions_within_tolerance']} of {c['positions']} positions are within "
            f"{c['tolerance']:g}{apart}{skipped}")


# --- what can be lowered --------------------------------------------------------------------------------------

def check_lowerable(spec: ModelSpec, manifest: Mapping) -> None:
    """Refuse, in one line, a structure or format the graph does not lower."""
    for layer in spec.layers:
        a = layer.attention
        if a.kind not in ("gqa", "mha"):
            raise KilnError(f"--format onnx lowers dense GQA/MHA decoders; layer {layer.index} has {a.kind} "
                            "attention (MLA is not lowered)")
        if layer.mlp.kind != "dense":
            raise KilnError(f"--format onnx lowers dense MLPs; layer {layer.index} has a {layer.mlp.kind} MLP "
                            "(MoE is not lowered)")
        if a.rotary.interleaved or a.rotary.dim != a.head_dim:
            raise KilnError(f"--format onnx: layer {layer.index}'s rotary embedding (dim {a.rotary.dim} of "
                            f"{a.head_dim}, interleaved {a.rotary.interleaved}) is not lowered; full-width "
                            "half-rotation RoPE only")
    for name, entry in manifest["formats"].items():
        if entry.get("format") not in (WeightFormat.DENSE, WeightFormat.FP8_E4M3, *FP4_BLOCK):
            raise KilnError(f"--format onnx: {name} is stored as {entry.get('format')}, which ONNX has no type for; "
                            "export a recipe without it (FP8, NVFP4 or MXFP4 weights)")
        act = entry.get("activation", ActivationFormat.NONE)
        if act in (ActivationFormat.NVFP4, ActivationFormat.MXFP4):
            raise KilnError(f"--format onnx: {name} quantizes its input to {act} (W4A4), which is not lowered; "
                            "export a weight-only FP4 recipe (nvfp4-w4a16, mxfp4-w4a16) or an FP8 one")
    for layer, entry in (manifest.get("kv_cache") or {}).items():
        if entry.get("format") == KvFormat.NVFP4:
            raise KilnError(f"--format onnx: layer {layer}'s KV cache is NVFP4, which is not lowered; "
                            "export a recipe with a BF16 or FP8 KV cache")


# --- reading the artifact's tensors one at a time -------------------------------------------------------------

class _Tensors(Mapping):
    """The artifact's tensors by name, read from the safetensors file when asked (one at a time)."""

    def __init__(self, handle):
        self.handle = handle
        self.names = set(handle.keys())

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.names:
            raise KeyError(name)
        return self.handle.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self.names))

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, name: object) -> bool:
        return name in self.names


@contextlib.contextmanager
def _open_tensors(path: Path) -> Iterator[_Tensors]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        yield _Tensors(handle)


def _exported_bytes(tensors: _Tensors) -> int:
    """About what the initializers take: floats widen to fp32; bytes (codes, E8M0 scales) at most double."""
    total = 0
    for name in tensors:
        piece = tensors.handle.get_slice(name)
        numel = int(np.prod(piece.get_shape(), dtype=np.int64))
        total += numel * {"F32": 4, "BF16": 4, "F16": 4, "F8_E4M3": 1, "U8": 2}.get(piece.get_dtype(), 8)
    return total


class _Initializers:
    """The graph's initializers. With a data file, every one of EXTERNAL_MIN_BYTES or more is appended to it as
    it is made, so memory holds one weight at a time however large the model."""

    def __init__(self, data_path: Path | None):
        self.data_path = data_path
        self.file = None
        self.tensors: list[TensorProto] = []

    def __enter__(self) -> Self:
        if self.data_path is not None:
            self.file = open(self.data_path, "wb")
        return self

    def __exit__(self, *exc) -> None:
        if self.file is not None:
            self.file.close()

    def add(self, tensor: TensorProto) -> str:
        if self.file is not None and len(tensor.raw_data) >= EXTERNAL_MIN_BYTES:
            offset = -self.file.tell() % 4096 + self.file.tell()  # page-aligned, so a runtime can map it
            self.file.seek(offset)
            self.file.write(tensor.raw_data)
            set_external_data(tensor, DATA_FILE, offset, len(tensor.raw_data))
            tensor.ClearField("raw_data")
        self.tensors.append(tensor)
        return tensor.name


# --- the graph ----------------------------------------------------------------------------------------------

class _Graph:
    """Nodes and initializers being built; every op returns its output's name."""

    def __init__(self, inits: _Initializers):
        self.inits = inits
        self.nodes: list[onnx.NodeProto] = []
        self.constants: dict[tuple, str] = {}
        self.count = 0

    def op(self, op_type: str, inputs: list[str], name: str, **attrs) -> str:
        return self.ops(op_type, inputs, name, 1, **attrs)[0]

    def ops(self, op_type: str, inputs: list[str], name: str, outputs: int, **attrs) -> list[str]:
        self.count += 1
        outs = [f"{name}/{op_type}_{self.count}" + (f":{k}" if k else "") for k in range(outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=outs[0], **attrs))
        return outs

    def initializer(self, name: str, array: np.ndarray) -> str:
        return self.inits.add(numpy_helper.from_array(np.ascontiguousarray(array), name))

    def raw(self, name: str, dtype: int, dims: tuple[int, ...], data: bytes) -> str:
        return self.inits.add(helper.make_tensor(name, dtype, list(dims), data, raw=True))

    def const(self, value, dtype=np.float32) -> str:
        """A small shared constant (a shape, an axis list, a scalar)."""
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self.constants:
            self.constants[key] = self.initializer(f"const_{len(self.constants)}", array)
        return self.constants[key]


def _float32(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().contiguous().numpy()


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(torch.uint8).numpy().tobytes()


@dataclass(frozen=True)
class _Tap:
    """One activation or KV quantizer in the graph: what goes in, what comes out, and how kernels/ compute it."""

    kind: str  # an ActivationFormat, or "kv"
    where: str  # the linear whose input it quantizes, or the layer's cached stream
    x: str
    y: str
    scale: np.ndarray | None = None  # fp8_static_per_tensor
    stream: KvStream | None = None  # kv

    def expected(self, x: np.ndarray) -> np.ndarray:
        """Kiln's own fake quantizer on the graph's input `x` (kernels.fp8, kernels.kv_quant)."""
        from kiln.kernels import fp8
        from kiln.kernels.kv_quant import kv_fake_quantize

        t = torch.from_numpy(x)
        if self.kind == ActivationFormat.FP8_DYNAMIC_PER_TOKEN:
            return fp8.fp8_fake_quantize_per_token(t).numpy()
        if self.kind == ActivationFormat.FP8_STATIC_PER_TENSOR:
            return fp8.fp8_fake_quantize_per_tensor(t, torch.from_numpy(self.scale)).numpy()
        s = self.stream  # x [B, H, T, D] -> the kernels' [tokens, H, D] and back
        tokens = t.transpose(1, 2).reshape(-1, *t.shape[1:2], t.shape[3])
        out = kv_fake_quantize(tokens, s.format, s.scaling, s.scale, s.offset)
        return out.reshape(t.shape[0], t.shape[2], t.shape[1], t.shape[3]).transpose(1, 2).numpy()


@dataclass
class _Lowering:
    g: _Graph
    spec: ModelSpec
    formats: Mapping[str, Mapping]
    tensors: _Tensors
    tokens_shape: str = ""  # Shape(input_ids): [B, T]
    embedding: str = ""  # the embedding's initializer (a tied lm_head reads it too)
    weight_kinds: set[str] = field(default_factory=set)  # the formats lowered, for the summary
    rotaries: int = 0  # distinct RotarySpecs so far
    fake_quantize: bool = True  # False: leave out the activation and KV quantizers (the check's bypass graph)
    taps: list[_Tap] = field(default_factory=list)  # every quantizer: its input and output, for the check

    # -- weights ------------------------------------------------------------------------------------------------
    def weight(self, lin: LinearSpec) -> str:
        """The fp32 [out, in] weight of `lin` as the graph computes it from the stored format."""
        g, name = self.g, lin.name
        entry = self.formats.get(name, {"format": WeightFormat.DENSE})
        if name == "lm_head" and self.spec.lm_head_tied(set(self.tensors)):
            self.weight_kinds.add("dense")
            return self.embedding
        fmt = entry["format"]
        self.weight_kinds.add(fmt)
        w = self.tensors[f"{name}.weight"]
        if fmt == WeightFormat.DENSE:
            return g.initializer(f"{name}.weight", _float32(w))
        if fmt == WeightFormat.FP8_E4M3:
            codes = g.raw(f"{name}.weight", TensorProto.FLOAT8E4M3FN, tuple(w.shape), _bytes(w))
            scale = _float32(self.tensors[f"{name}.weight_scale"])
            if scale.size == 1:
                return g.op("DequantizeLinear", [codes, g.initializer(f"{name}.weight_scale", scale.reshape(()))],
                            name)
            return g.op("DequantizeLinear", [codes, g.initializer(f"{name}.weight_scale", scale.reshape(-1))],
                        name, axis=0)
        block = FP4_BLOCK[fmt]
        out, padded = w.shape[0], w.shape[1] * 2
        codes = g.raw(f"{name}.weight", TensorProto.FLOAT4E2M1, (out, padded), _bytes(w))
        stored = self.tensors[f"{name}.weight_scale"]
        if fmt == WeightFormat.NVFP4:
            block_scale = g.raw(f"{name}.weight_scale", TensorProto.FLOAT8E4M3FN, tuple(stored.shape), _bytes(stored))
            global_scale = g.initializer(f"{name}.weight_scale_2",
                                         _float32(self.tensors[f"{name}.weight_scale_2"]).reshape(()))
            scale = g.op("DequantizeLinear", [block_scale, global_scale], f"{name}.weight_scale")
            value = g.op("DequantizeLinear", [codes, scale], name, axis=1, block_size=block)
        else:  # mxfp4: E8M0 code e is 2^(e - 127), exact in bfloat16 (8 exponent bits, subnormals for 2^-127)
            powers = np.ldexp(np.float32(1.0), stored.numpy().astype(np.int32) - 127).astype(np.float32)
            scale = g.initializer(f"{name}.weight_scale", powers.astype(ml_dtypes.bfloat16))
            value = g.op("DequantizeLinear", [codes, scale], name, axis=1, block_size=block,
                         output_dtype=TensorProto.FLOAT)
        if padded == lin.in_features:
            return value
        return g.op("Slice", [value, g.const([0], np.int64), g.const([lin.in_features], np.int64),
                              g.const([1], np.int64)], name)

    def linear(self, lin: LinearSpec, x: str, inputs: dict) -> str:
        """x [tokens, in] -> [tokens, out]; `inputs` caches the transformed input shared by sibling linears."""
        entry = self.formats.get(lin.name, {"format": WeightFormat.DENSE})
        x = self.input_transform(lin, entry, x, inputs)  # as the runtime: the entry's, even for a tied lm_head
        operands = [x, self.weight(lin)]
        if lin.bias:
            operands.append(self.g.initializer(f"{lin.name}.bias", _float32(self.tensors[f"{lin.name}.bias"])))
        return self.g.op("Gemm", operands, lin.name, transB=1)

    def input_transform(self, lin: LinearSpec, entry: Mapping, x: str, inputs: dict) -> str:
        name = lin.name
        rotation = entry.get("input_rotation")
        if rotation:
            key = (x, "rotation", rotation["block_size"])
            if key not in inputs:
                inputs[key] = self.rotate(x, lin.in_features, rotation["block_size"], name)
            x = inputs[key]
        act = entry.get("activation", ActivationFormat.NONE)
        if act == ActivationFormat.NONE or not self.fake_quantize:
            return x
        key = (x, act, name if act == ActivationFormat.FP8_STATIC_PER_TENSOR else "")  # static: its own scale
        if key not in inputs:
            if act == ActivationFormat.FP8_STATIC_PER_TENSOR:
                scale = _float32(self.tensors[f"{name}.input_scale"]).reshape(())
                inputs[key] = self.fp8_static(x, scale, None, f"{name}.input")
                self.taps.append(_Tap(act, name, x, inputs[key], scale=scale))
            else:  # fp8_dynamic_per_token (check_lowerable refused the FP4 ones)
                inputs[key] = self.fp8_dynamic(x, [1], name)
                self.taps.append(_Tap(act, name, x, inputs[key]))
        return inputs[key]

    def fp8_static(self, x: str, scale: np.ndarray, axis: int | None, name: str) -> str:
        """QuantizeLinear -> DequantizeLinear to FLOAT8E4M3FN with a fixed scale (0-dim, or 1-D along `axis`)."""
        g = self.g
        zero = g.raw(f"{name}.zero_point", TensorProto.FLOAT8E4M3FN, scale.shape, bytes(scale.size))
        scale_name = g.initializer(f"{name}.scale", scale)
        kw = {} if axis is None else {"axis": axis}
        return g.op("DequantizeLinear", [g.op("QuantizeLinear", [x, scale_name, zero], name, **kw), scale_name],
                    name, **kw)

    def fp8_dynamic(self, x: str, axes: list[int], name: str) -> str:
        """kernels.fp8's dynamic fake quantizer: one scale per slice over `axes` (amax / 448, 1 where 0)."""
        g = self.g
        amax = g.op("ReduceMax", [g.op("Abs", [x], name), g.const(axes, np.int64)], name, keepdims=1)
        scale = g.op("Div", [amax, g.const(E4M3_MAX)], name)
        scale = g.op("Where", [g.op("Greater", [scale, g.const(0.0)], name), scale, g.const(1.0)], name)
        scaled = g.op("Clip", [g.op("Div", [x, scale], name), g.const(-E4M3_MAX), g.const(E4M3_MAX)], name)
        codes = g.op("Cast", [scaled], name, to=TensorProto.FLOAT8E4M3FN)
        return g.op("Mul", [g.op("Cast", [codes], name, to=TensorProto.FLOAT), scale], name)

    def rotate(self, x: str, in_features: int, block_size: int, name: str) -> str:
        """x R for kernels.rotation's block Hadamard R: whole blocks as one MatMul on [tokens, K/b, b], then
        the tail's power-of-two pieces."""
        from kiln.kernels.rotation import block_sizes, hadamard_matrix

        g = self.g
        full = (in_features // block_size) * block_size
        parts, start = [], 0

        def piece(lo: int, hi: int) -> str:
            if lo == 0 and hi == in_features:
                return x
            return g.op("Slice", [x, g.const([lo], np.int64), g.const([hi], np.int64), g.const([1], np.int64)],
                        name)

        if full:
            blocks = g.op("Reshape", [piece(0, full), g.const([-1, full // block_size, block_size], np.int64)], name)
            rotated = g.op("MatMul", [blocks, g.const(hadamard_matrix(block_size).numpy())], name)
            parts.append(g.op("Reshape", [rotated, g.const([-1, full], np.int64)], name))
            start = full
        for size in block_sizes(in_features, block_size)[full // block_size:]:
            parts.append(g.op("MatMul", [piece(start, start + size), g.const(hadamard_matrix(size).numpy())], name))
            start += size
        return parts[0] if len(parts) == 1 else g.op("Concat", parts, name, axis=1)

    # -- blocks ------------------------------------------------------------------------------------------------
    def rms_norm(self, x: str, weight: str, axis: int = -1) -> str:
        g = self.g
        mean = g.op("ReduceMean", [g.op("Mul", [x, x], weight), g.const([axis], np.int64)], weight, keepdims=1)
        inv = g.op("Reciprocal", [g.op("Sqrt", [g.op("Add", [mean, g.const(self.spec.rms_norm_eps)], weight)],
                                       weight)], weight)
        # Gemma: the norm scales by (1 + w), added in fp32 here as the runtime adds it
        w = g.initializer(weight, _float32(self.tensors[weight]) + np.float32(self.spec.norm_offset))
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
        """cos, sin [B, 1, T, D] for one RotarySpec (runtime.model.Rotary)."""
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
        if stream.format == KvFormat.BF16 or not self.fake_quantize:
            return x
        g = self.g
        centered, offset = x, None
        if stream.offset is not None:
            offset = g.initializer(f"{name}.offset", _float32(stream.offset)[:, None, :])  # [H, 1, D]
            centered = g.op("Sub", [x, offset], name)
        if stream.scaling == "dynamic":
            out = self.fp8_dynamic(centered, [1, 3], name)  # one scale per token, over heads and dims
        elif stream.scaling == "per_head":
            out = self.fp8_static(centered, _float32(stream.scale).reshape(-1), 1, name)
        else:
            out = self.fp8_static(centered, _float32(stream.scale).reshape(()), None, name)
        out = out if offset is None else g.op("Add", [out, offset], name)
        self.taps.append(_Tap("kv", name, x, out, stream=stream))
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


def lower(spec: ModelSpec, formats: Mapping[str, Mapping], kv_table: Mapping | None, tensors: _Tensors,
          inits: _Initializers, fake_quantize: bool = True) -> tuple[onnx.ModelProto, list[_Tap]]:
    """The ONNX model of `spec` with the artifact's tensors (see the module docstring), and its quantizers.
    `fake_quantize` False leaves the activation and KV quantizers out (the check's bypass graph)."""
    g = _Graph(inits)
    low = _Lowering(g, spec, formats, tensors, fake_quantize=fake_quantize)
    streams = resolve_kv_streams(spec, kv_table, tensors)
    low.tokens_shape = g.op("Shape", ["input_ids"], "tokens")
    low.embedding = g.initializer(spec.embedding, _float32(tensors[spec.embedding]))
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


# --- the check --------------------------------------------------------------------------------------------

def _runner(path: Path):
    """(name, run(feeds, outputs) -> arrays): onnxruntime's CPU provider, or onnx.reference for FP4 graphs
    (onnxruntime has no FP4 DequantizeLinear) and where onnxruntime is not installed."""
    import importlib.util

    model = onnx.load(str(path), load_external_data=False)
    fp4 = any(t.data_type == TensorProto.FLOAT4E2M1 for t in model.graph.initializer)
    if not fp4 and importlib.util.find_spec("onnxruntime") is not None:
        import onnxruntime

        try:
            session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        except Exception as exc:  # noqa: BLE001 -- an onnxruntime without these opset 23 kernels: the install's
            detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise KilnError(f"onnxruntime {onnxruntime.__version__} cannot load the graph ({clip(detail, 160)}); "
                            "the onnx extra needs onnxruntime>=1.32") from None
        return f"onnxruntime {onnxruntime.__version__}", session.run
    from onnx.reference import ReferenceEvaluator

    evaluator = ReferenceEvaluator(str(path))
    return f"onnx.reference {onnx.__version__}", lambda outputs, feeds: evaluator.run(outputs, feeds)


def _empty_past(spec: ModelSpec, batch: int) -> dict[str, np.ndarray]:
    past = {}
    for layer in spec.layers:
        a = layer.attention
        past[f"past_key_values.{layer.index}.key"] = np.zeros((batch, a.num_kv_heads, 0, a.head_dim), np.float32)
        past[f"past_key_values.{layer.index}.value"] = np.zeros((batch, a.num_kv_heads, 0, a.v_head_dim), np.float32)
    return past


def _feeds(rows: np.ndarray, start: int, end: int, past: dict) -> dict[str, np.ndarray]:
    ids = np.ascontiguousarray(rows[:, start:end])
    positions = np.broadcast_to(np.arange(start, end, dtype=np.int64), ids.shape).copy()
    return {"input_ids": ids, "position_ids": positions, **past}


def _decode(path: Path, spec: ModelSpec, rows: np.ndarray, prefill: int) -> tuple[str, np.ndarray]:
    """The graph's logits [B, L, V] for `rows`: a prefill of `prefill` tokens from an empty past, then one token
    at a time with the presents fed back as the past."""
    runner, run = _runner(path)
    outputs = ["logits"] + [f"present.{layer.index}.{kind}" for layer in spec.layers for kind in ("key", "value")]
    past, pieces, start = _empty_past(spec, rows.shape[0]), [], 0
    for end in [prefill, *range(prefill + 1, rows.shape[1] + 1)]:
        logits, *presents = run(outputs, _feeds(rows, start, end, past))
        pieces.append(logits)
        past = {name.replace("present.", "past_key_values.", 1): value for name, value in zip(outputs[1:], presents)}
        start = end
    cached = next(iter(past.values())).shape[2]
    if cached != rows.shape[1]:
        raise KilnError(f"onnx export: after {rows.shape[1]} tokens the graph's presents hold {cached}")
    return runner, np.concatenate(pieces, axis=1)


def _compare(got: np.ndarray, expected: np.ndarray) -> dict:
    if got.shape != expected.shape:
        raise KilnError(f"onnx export: the graph gave logits {got.shape}, the runtime {expected.shape}")
    per_position = np.abs(got - expected).max(axis=-1)
    return {"max_abs_logit_diff": float(per_position.max()), "positions": int(per_position.size),
            "positions_within_tolerance": int((per_position <= TOLERANCE).sum()),
            "top1_agreement": float((got.argmax(-1) == expected.argmax(-1)).mean())}


def _check_quantizers(path: Path, taps: list[_Tap], feeds: dict[str, np.ndarray]) -> None:
    """Every activation and KV quantizer of the graph, run on the check's own activations, must give what
    kernels/ gives on the same input, bit for bit."""
    model = onnx.load(str(path), load_external_data=False)
    names = list(dict.fromkeys(n for tap in taps for n in (tap.x, tap.y)))
    del model.graph.output[:]
    model.graph.output.extend(helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names)
    tapped = path.with_name(".taps.onnx")  # beside the weights file, which it refers to
    onnx.save_model(model, str(tapped))
    try:
        _, run = _runner(tapped)
        values = dict(zip(names, run(names, feeds)))
    finally:
        tapped.unlink()
    for tap in taps:
        expected = tap.expected(values[tap.x])
        if not np.array_equal(values[tap.y], expected):
            diff = float(np.abs(values[tap.y] - expected).max())
            raise KilnError(f"onnx export: the {tap.kind} quantizer on {tap.where} differs from Kiln's "
                            f"by {diff:.3g} on the same input; nothing was written")


def check_export(directory: Path, artifact_engine, spec: ModelSpec, formats: Mapping[str, Mapping],
                 tensors: _Tensors, taps: list[_Tap], external: bool, prefill: int = CHECK_PREFILL,
                 decode_steps: int = CHECK_DECODE, batch: int = CHECK_BATCH) -> dict:
    """Run the graph in `directory` against Kiln's runtime (see the module docstring); raise a KilnError where
    it disagrees. With activation or KV quantizers the graph's logits cannot be held to 1e-3: Kiln's own
    logits move by more when its input moves by one fp32 ulp (an activation within rounding of an FP8
    midpoint rounds the other way, and the KV cache carries that to every later position). So then each
    quantizer is held to Kiln's bit for bit, and the graph without them to the runtime without them."""
    from kiln.runtime.engine import Engine

    path = directory / MODEL_FILE
    generator = torch.Generator().manual_seed(0)
    rows = torch.randint(0, spec.vocab_size, (batch, prefill + decode_steps), generator=generator)
    if spec.bos_token_id is not None:
        rows[:, 0] = spec.bos_token_id
    expected = torch.stack(artifact_engine.logits(rows.tolist())).numpy()
    rows = rows.numpy().astype(np.int64)
    runner, got = _decode(path, spec, rows, prefill)
    model = onnx.load(str(path), load_external_data=False)
    props = {p.key: p.value for p in model.metadata_props}
    record = {"runner": runner, "batch": batch, "prefill": prefill, "decode_steps": decode_steps,
              "tolerance": TOLERANCE, "weights": props.get("kiln.weights", "?"),
              "kv_cache": props.get("kiln.kv_cache", "?"), **_compare(got, expected)}
    if not taps:
        if record["max_abs_logit_diff"] > TOLERANCE:
            raise KilnError(f"onnx export: {runner}'s logits differ from the runtime's by "
                            f"{record['max_abs_logit_diff']:.3g} (> {TOLERANCE:g}); nothing was written")
        return record
    _check_quantizers(path, taps, _feeds(rows, 0, prefill, _empty_past(spec, batch)))
    record["quantizers_bit_exact"] = len(taps)
    bypass = directory / ".bypass"
    bypass.mkdir()
    try:
        _write(bypass, spec, formats, {}, tensors, external, fake_quantize=False)
        plain_formats = {name: {**entry, "activation": ActivationFormat.NONE} for name, entry in formats.items()}
        plain = Engine(spec, tensors, plain_formats, kv_cache={})
        _, plain_got = _decode(bypass / MODEL_FILE, spec, rows, prefill)
        unquantized = _compare(plain_got, torch.stack(plain.logits(rows.tolist())).numpy())
    finally:
        shutil.rmtree(bypass)
    record["without_quantizers_max_abs_logit_diff"] = unquantized["max_abs_logit_diff"]
    if unquantized["max_abs_logit_diff"] > TOLERANCE:
        raise KilnError(f"onnx export: without its activation/KV quantizers, {runner}'s logits differ from the "
                        f"runtime's by {unquantized['max_abs_logit_diff']:.3g} (> {TOLERANCE:g}); nothing was written")
    return record
