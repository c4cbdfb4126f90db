"""What an export says about itself: which loaders read its layout (README.md, `optimize inspect DIR`), and the
transformers version that produced its config.json.

A layout read by the wrong loader does not always fail: plain transformers loads an hf-modelopt export's packed
FP8/FP4 weights as if they were plain weights and returns wrong logits with only a warning. So each export
writes a README.md naming the loaders that read its layout, and `optimize inspect` on an export directory says
the same. config.json's `transformers_version` is the installed transformers' (the library whose config
format Kiln writes), not the source checkpoint's: a checkpoint made under transformers 5.24 and exported here
says what wrote the export.
"""

from __future__ import annotations

import json
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from kiln.optimizer import __version__
from kiln.optimizer.output_dir import EXPORT_MARKER

README = "README.md"

LOADERS: dict[str, tuple[tuple[str, ...], str]] = {
    "compressed-tensors": (
        ("vLLM (quantization='compressed-tensors', read from config.json)", "SGLang",
         "transformers with the compressed-tensors package (dequantizes on load)", "llm-compressor"),
        ("llm-compressor's compressed-tensors layout: quantized weights with their scales, config.json's "
         "quantization_config says how")),
    "hf-modelopt": (
        ("vLLM (quantization='modelopt' / 'modelopt_fp4')", "SGLang (quantization modelopt)",
         "TensorRT-LLM (its HF checkpoint loader reads hf_quant_config.json)", "NVIDIA ModelOpt"),
        ("ModelOpt's unified HF checkpoint: packed FP8/FP4 weights, their scales, hf_quant_config.json. Plain "
         "transformers does NOT read it: it loads the packed weights as plain ones and gives wrong logits with "
         "only a warning")),
    "hf": (("transformers (DeepseekV3ForCausalLM; verified on every export)",
            ("vLLM and SGLang only for a theta-regular conversion (passes/mla.py layout: deepseek): their DeepSeek "
             "code derives the rotary frequencies from rope_theta")),
           "an unquantized checkpoint in DeepSeek-V3's layout (the MLA conversion's latent attention)"),
    "eagle3": (("vLLM (speculative method 'eagle3', beside its target)", "SGLang (speculative algorithm EAGLE3)"),
               "an EAGLE-3 draft head only: it is served beside its target model, never alone"),
    "onnx": (("onnxruntime (opset 23)",), "DIR/model.onnx with a KV cache, weights behind DequantizeLinear"),
}
"""Format -> (the loaders that read its layout, what the layout is)."""


def producer_version() -> str:
    """The installed transformers' version (read from its metadata, without importing it), else Kiln's."""
    try:
        return version("transformers")
    except PackageNotFoundError:
        return f"kiln-{__version__}"


def stamp(config: dict) -> dict:
    """`config` with transformers_version the version that wrote it (producer_version), not its source's."""
    return {**config, "transformers_version": producer_version()}


def readme_text(fmt: str, artifact: Path | str) -> str:
    loaders, layout = LOADERS[fmt]
    lines = [f"# Kiln export ({fmt})", "", f"Exported by Kiln from the artifact `{artifact}`: {layout}.", "",
             "Loaders that read this layout:", "", *[f"- {name}" for name in loaders], "",
             ("Anything else may load the files without error and still compute wrong outputs. `optimize inspect "
              "DIR` prints this list; kiln_export.json records the source artifact and the files."), ""]
    return "\n".join(lines)


def write_readme(directory: Path, fmt: str, artifact: Path | str) -> None:
    (Path(directory) / README).write_text(readme_text(fmt, artifact))


def describe_export(path: Path) -> dict | None:
    """An export directory's format, source artifact, Kiln version and loaders (from kiln_export.json); None when
    `path` is no Kiln export."""
    marker = Path(path) / EXPORT_MARKER
    if not marker.is_file():
        return None
    try:
        record = json.loads(marker.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(record, dict):
        return None
    fmt = record.get("format")
    loaders, layout = LOADERS.get(fmt, ((), "unknown format"))
    config = Path(path) / "config.json"
    written_by = None
    if config.is_file():
        try:
            written_by = json.loads(config.read_text()).get("transformers_version")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
            written_by = None
    return {"export": str(path), "format": fmt, "layout": layout, "loaders": list(loaders),
            "artifact": record.get("artifact"), "kiln_version": record.get("kiln_version"),
            "transformers_version": written_by, "files": sorted(record.get("files") or ())}
