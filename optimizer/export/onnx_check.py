"""The ONNX export's check, run on the graph before the export is kept (a failure is one line and leaves
nothing): the graph against Kiln's runtime over a prefill and decode steps, as optimizer/export/onnx.py's
docstring describes it (the tolerance, and why activation/KV quantizers are held to kernels/ bit for bit).

    record = check_export(directory, engine, spec, formats, tensors, taps, external)   onnx_check.json's figures
"""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from kiln.kernels.errors import KilnError
from kiln.kernels.formats import ActivationFormat
from kiln.optimizer.export.onnx_graph import MODEL_FILE, ArtifactTensors
from kiln.optimizer.export.onnx_lowering import write_graph
from kiln.optimizer.export.onnx_qdq import Tap
from kiln.runtime.artifact import clip
from kiln.runtime.engine import Engine
from kiln.runtime.spec import ModelSpec

TOLERANCE = 1e-3
"""Largest |logit difference| the check accepts between the graph and Kiln's runtime."""
CHECK_PREFILL, CHECK_DECODE, CHECK_BATCH = 5, 3, 2


def _runner(path: Path):
    """(name, run(feeds, outputs) -> arrays): onnxruntime's CPU provider, or onnx.reference for FP4 graphs
    (onnxruntime has no FP4 DequantizeLinear) and where onnxruntime is not installed."""
    model = onnx.load(str(path), load_external_data=False)
    fp4 = any(t.data_type == TensorProto.FLOAT4E2M1 for t in model.graph.initializer)
    if not fp4 and importlib.util.find_spec("onnxruntime") is not None:
        import onnxruntime  # lazy: an optional extra; FP4 graphs run without it

        try:
            session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        except Exception as exc:  # noqa: BLE001 -- an onnxruntime without these opset 23 kernels: the install's
            detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise KilnError(f"onnxruntime {onnxruntime.__version__} cannot load the graph ({clip(detail, 160)}); "
                            "the onnx extra needs onnxruntime>=1.32") from None
        return f"onnxruntime {onnxruntime.__version__}", session.run
    from onnx.reference import ReferenceEvaluator  # lazy: FP4 graphs and installs without onnxruntime

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


def _check_quantizers(path: Path, taps: list[Tap], feeds: dict[str, np.ndarray]) -> None:
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
                 tensors: ArtifactTensors, taps: list[Tap], external: bool, prefill: int = CHECK_PREFILL,
                 decode_steps: int = CHECK_DECODE, batch: int = CHECK_BATCH) -> dict:
    """Run the graph in `directory` against Kiln's runtime (see the module docstring); raise a KilnError where
    it disagrees. With activation or KV quantizers the graph's logits cannot be held to 1e-3: Kiln's own
    logits move by more when its input moves by one fp32 ulp (an activation within rounding of an FP8
    midpoint rounds the other way, and the KV cache carries that to every later position). So then each
    quantizer is held to Kiln's bit for bit, and the graph without them to the runtime without them."""
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
        write_graph(bypass, spec, formats, {}, tensors, external, fake_quantize=False)
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
