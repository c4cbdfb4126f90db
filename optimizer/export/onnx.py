"""`optimize export ART --format onnx -o DIR`: the artifact's decoder as one ONNX graph (opset 23) with a KV
cache, its weights kept in their stored number formats behind DequantizeLinear, so the graph computes what
Kiln's runtime computes (fp32 arithmetic on the dequantized values).

    DIR/model.onnx         the graph (DIR/model.onnx.data beside it holds the weights when they pass 1 GiB)
    DIR/onnx_check.json    the check run after writing: the runner, the tokens, the max |logit difference|
    DIR/kiln_export.json   the export marker

The graph's pieces: onnx_graph.py (tensors, initializers, the node builder), onnx_qdq.py (weights behind
DequantizeLinear, the activation and KV quantizers, the rotation), onnx_lowering.py (the model's blocks as nodes),
onnx_check.py (the check against Kiln's runtime).

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

import json
from collections.abc import Mapping
from pathlib import Path

import onnx

from kiln.kernels.errors import KilnError
from kiln.kernels.formats import ActivationFormat, KvFormat
from kiln.kernels.registry import weight_format
from kiln.optimizer.export.onnx_check import check_export
from kiln.optimizer.export.onnx_graph import MODEL_FILE, exported_bytes, open_tensors
from kiln.optimizer.export.onnx_lowering import OPSET, write_graph
from kiln.optimizer.export.onnx_qdq import WEIGHT_LOWERINGS
from kiln.optimizer.export.unfuse import artifact_is_fused, unfuse_artifact
from kiln.optimizer.output_dir import atomic_directory, check_output, mark_export
from kiln.passes.fuse import unfuse_spec
from kiln.runtime import load
from kiln.runtime.artifact import WEIGHTS, artifact_file, read_manifest
from kiln.runtime.spec import ModelSpec, spec_from_json

CHECK_FILE = "onnx_check.json"
EXTERNAL_DATA_BYTES = 1 << 30
"""Weights above this go to DATA_FILE (a protobuf holds at most 2 GiB); below it they stay in the graph."""


def export_onnx(artifact: Path | str, output: Path | str, overwrite: bool = False,
                external_data: bool | None = None) -> Path:
    """Write the artifact as DIR/model.onnx and check it against Kiln's runtime (see the module docstring).
    `external_data`: weights in DIR/model.onnx.data (None: when they pass EXTERNAL_DATA_BYTES)."""
    artifact, output = Path(artifact), Path(output)
    manifest = read_manifest(artifact)
    fused = artifact_is_fused(manifest)
    spec = unfuse_spec(spec_from_json(manifest["architecture"]))
    check_lowerable(spec, manifest)
    check_output(output, overwrite, [artifact])
    engine = load(artifact)  # checks every tensor against the spec (shapes, dtypes, finite values, KV scales)
    weights = artifact_file(artifact, manifest, WEIGHTS)
    with open_tensors(weights) as tensors:
        if external_data is None:
            external_data = exported_bytes(tensors) > EXTERNAL_DATA_BYTES
        if fused:  # the fuse pass's qkv / gate_up linears go into the graph as their parts, as the HF exports write
            manifest, tensors = unfuse_artifact(manifest, {name: tensors[name] for name in tensors})
        with atomic_directory(output, overwrite, [artifact]) as tmp:
            taps = write_graph(tmp, spec, manifest["formats"], manifest.get("kv_cache"), tensors, external_data)
            onnx.checker.check_model(str(tmp / MODEL_FILE), full_check=True)
            check = check_export(tmp, engine, spec, manifest["formats"], tensors, taps, external_data)
            check["skipped_modules"] = [f"{m.kind} {m.name}" for m in spec.extra_modules]
            (tmp / CHECK_FILE).write_text(json.dumps(check, indent=2) + "\n")
            mark_export(tmp, artifact, "onnx")
    return output



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
        if weight_format(entry.get("format")).export_names.get("onnx") not in WEIGHT_LOWERINGS:
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
