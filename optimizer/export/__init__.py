"""Engine artifact -> a quantized Hugging Face checkpoint for the big serving engines, in one of these layouts:

    compressed-tensors   llm-compressor's layout (optimizer/export/compressed_tensors.py; vLLM, SGLang,
                         transformers), which also carries what ModelOpt's cannot: FP8 weight-only, FP8 with
                         mixed scale granularities, NVFP4 / FP8 / MXFP4 mixed per layer
    hf-modelopt          NVIDIA ModelOpt's unified checkpoint (optimizer/export/modelopt.py; vLLM
                         quantization="modelopt", SGLang, TensorRT-LLM); an MLA-converted model in DeepSeek-V3's
                         layout (optimizer/export/deepseek_modelopt.py)
    hf                   an MLA-converted model, unquantized, in DeepSeek-V3's layout (optimizer/export/deepseek.py;
                         transformers' DeepseekV3ForCausalLM)
    eagle3               the artifact's EAGLE-3 draft head, as vLLM / SGLang load it beside the target
                         (optimizer/export/eagle3.py; ModelOpt's speculative export layout)
    onnx                 the decoder as one ONNX graph (opset 23) with a KV cache, weights behind DequantizeLinear
                         in their stored formats (optimizer/export/onnx.py; needs the `onnx` extra)

All write atomically, mark the directory as a Kiln export, and read the export back to check it: the quantized
layouts dequantize to the artifact's weights, the DeepSeek-V3 one gives the runtime's logits in transformers, the
ONNX graph gives them in onnxruntime (onnx.reference for FP4) over a prefill and decode steps.
Fused linears (the `fuse` pass: qkv_proj, gate_up_proj) are written back as q_proj/k_proj/v_proj and
gate_proj/up_proj (optimizer/export/unfuse.py): vLLM, SGLang and TensorRT-LLM load the separate names and fuse them
themselves; the ONNX graph takes the parts too.

    export(artifact, fmt, output, overwrite=False)   write the export (fmt: one of FORMATS), checked
    export_summary(output, fmt)                      the CLI's one line about it
Each format object (kiln.kernels.registry.weight_format) names itself per layout (`export_names`) or says why a
layout cannot take it (`export_refusals`); the writers ask it rather than its name.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from kiln.kernels.errors import KilnError, clip
from kiln.kernels.registry import weight_format
from kiln.optimizer.export.compressed_tensors import describe, export_compressed_tensors
from kiln.optimizer.export.deepseek import export_deepseek
from kiln.optimizer.export.deepseek_modelopt import export_deepseek_modelopt
from kiln.optimizer.export.eagle3 import export_eagle3
from kiln.optimizer.export.modelopt import HF_QUANT_CONFIG, export_hf_modelopt
from kiln.optimizer.output_dir import check_output
from kiln.runtime.artifact import read_manifest
from kiln.runtime.manifest import known_source_spec
from kiln.runtime.spec import spec_from_json

FORMATS = ("compressed-tensors", "hf-modelopt", "hf", "eagle3", "onnx")


def refuse_runtime_only_formats(manifest: dict, fmt: str) -> None:
    """One line, before anything is written, for an artifact with weights that only Kiln's runtime runs (MXFP6,
    which `auto` may choose): no layout of `fmt` can carry them (the format object's `export_refusals`)."""
    refusals = {name: weight_format(e.get("format")).export_refusals.get(fmt)
                for name, e in manifest["formats"].items()}
    found = sorted(name for name, refusal in refusals.items() if refusal)
    if found:
        raise KilnError(f"--format {fmt}: {len(found)} linears (e.g. {found[0]}) are stored as {refusals[found[0]]}")


def refuse_quantized_embedding(manifest: dict, fmt: str) -> None:
    """One line, before anything is written, for an artifact whose embedding table is stored quantized (the
    embedding-quant pass): the serving layouts store the embedding (and a tied head) in the model's dtype."""
    for name, e in manifest["formats"].items():
        if e.get("role") == "embedding" and weight_format(e.get("format")).dequantizes:
            raise KilnError(f"--format {fmt}: the embedding {name} is stored {e['format']} (embedding-quant), which "
                            "Kiln's runtime reads but no export layout has; for an export, rebuild without "
                            "embedding-quant")


def export(artifact: Path | str, fmt: str, output: Path | str, overwrite: bool = False) -> Path:
    if fmt not in FORMATS:
        raise KilnError(f"unknown export format {fmt!r}; supported: {', '.join(FORMATS)}")
    check_output(output, overwrite, [artifact])  # before reading anything
    if fmt == "onnx" and importlib.util.find_spec("onnx") is None:
        raise KilnError("--format onnx needs the onnx package: pip install -e '.[onnx]'")
    artifact = Path(artifact)
    manifest = read_manifest(artifact)  # verified once here: every refusal below reads this one
    refuse_quantized_embedding(manifest, fmt)
    if fmt == "hf":
        return export_deepseek(artifact, output, overwrite)
    if fmt == "eagle3":
        return export_eagle3(artifact, output, overwrite)
    if fmt == "onnx":
        refuse_runtime_only_formats(manifest, fmt)
        from kiln.optimizer.export.onnx import export_onnx  # lazy: onnx is an optional extra

        return export_onnx(artifact, output, overwrite)
    refuse_runtime_only_formats(manifest, fmt)
    converted = converted_layers(artifact, manifest)
    if converted and fmt == "hf-modelopt":
        return export_deepseek_modelopt(artifact, output, overwrite)
    if converted:
        raise KilnError(f"--format {fmt} keeps the source's layout, but layers {converted[:4]} were converted to MLA: "
                        "export with --format hf-modelopt (DeepSeek-V3 layout, quantized) or --format hf "
                        "(unquantized)")
    writer = export_compressed_tensors if fmt == "compressed-tensors" else export_hf_modelopt
    return writer(artifact, output, overwrite)


def converted_layers(artifact: Path, manifest: dict) -> list[int]:
    """Layers a structural pass converted to MLA (a native MLA source such as DeepSeek has its own), as the
    manifest's record of the source's spec says: the quantized layouts that keep the source's config.json
    cannot hold them."""
    spec = spec_from_json(manifest["architecture"])
    source = known_source_spec(manifest, spec, f"exporting {clip(artifact)}")
    return [new.index for new, old in zip(spec.layers, source.layers, strict=True)
            if new.attention.kind == "mla" and old.attention.kind != "mla"]


def export_summary(path: Path | str, fmt: str) -> str:
    """One line for the CLI about a finished export at `path` in format `fmt`."""
    path = Path(path)
    if fmt == "hf":
        return (f"wrote {path} (hf: DeepSeek-V3 layout, unquantized); transformers' logits on it match the "
                "artifact's")
    if fmt == "eagle3":
        return (f"wrote {path} (eagle3: the draft head only, LlamaForCausalLMEagle3; serve it beside the target "
                "with vLLM's speculative method eagle3)")
    if fmt == "onnx":
        from kiln.optimizer.export.onnx import describe as describe_onnx  # lazy: onnx is an optional extra

        return f"wrote {path / 'model.onnx'} {describe_onnx(path)}"
    if fmt == "compressed-tensors":
        summary = describe(path)
        note = (" (NVFP4: its codes and block scales, global scales stored as their reciprocals)"
                if "NVFP4" in summary else "")
        return f"wrote {path} ({fmt}, {summary}); dequantized export matches the artifact{note}"
    algo = "none"
    if (path / HF_QUANT_CONFIG).is_file():
        algo = json.loads((path / HF_QUANT_CONFIG).read_text())["quantization"]["quant_algo"]
    config = json.loads((path / "config.json").read_text())
    layout = ", DeepSeek-V3 layout" if config.get("model_type") == "deepseek_v3" else ""
    return f"wrote {path} ({fmt}{layout}, quant_algo {algo}); dequantized export matches the artifact"
