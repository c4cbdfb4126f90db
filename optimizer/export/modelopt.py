"""Engine artifact -> NVIDIA ModelOpt's unified Hugging Face checkpoint ("hf-modelopt"), the one vLLM
(quantization="modelopt"), SGLang and TensorRT-LLM load. `optimizer.export` chooses between this layout and
compressed-tensors; the shared pieces (files copied, KV-cache refusal, NVFP4 group size) live here.

    DIR/model.safetensors     every artifact tensor under its Hugging Face name: quantized linears as
                              <module>.weight / .weight_scale / .weight_scale_2 / .input_scale (the artifact
                              already uses these names), everything else as stored (source dtype)
    DIR/hf_quant_config.json  {"producer": {"name": "kiln", ...}, "quantization": {"quant_algo", ...}}
    DIR/config.json           the source config plus "quantization_config" (quant_method "modelopt")
    DIR/tokenizer files, generation_config.json

Each linear's artifact format maps to one ModelOpt algorithm (the names its export writes, checked against
ModelOpt 0.47's own export in tests/optimizer/test_export.py):

    artifact format                                           quant_algo                  tensors
    fp8_e4m3, per-tensor scale, fp8_static_per_tensor         FP8                         weight, weight_scale (), input_scale ()
    fp8_e4m3, per-channel scale, fp8_dynamic_per_token        FP8_PER_CHANNEL_PER_TOKEN   weight, weight_scale [N]
    nvfp4, nvfp4 activations with a calibrated input_scale    NVFP4 (group_size 16)       weight, weight_scale, weight_scale_2, input_scale
    nvfp4, weight-only                                        W4A16_NVFP4 (group_size 16) weight, weight_scale, weight_scale_2
    mxfp4, weight-only or mxfp4 activations                   mxfp4                       weight, weight_scale (E8M0 uint8)

One algorithm for every quantized linear gives ModelOpt's single-algorithm config with `exclude_modules`
(unquantized linears and the embedding, summarized with prefix wildcards as ModelOpt does); several give
"MIXED_PRECISION" with a per-layer `quantized_layers` table. Anything else (FP8 weight-only, NVFP4
activations without a calibrated input scale, FP8 with static per-channel...) has no ModelOpt equivalent and
is a one-line error naming the module. `producer` names Kiln, not ModelOpt.
After writing, the export is read back and dequantized, and must reproduce the artifact's weights exactly.
An FP8 KV cache (every layer FP8 E4M3, one calibrated scale per tensor, no offset: `kv_algo`) is written as
kv_cache_quant_algo "FP8" with each layer's `self_attn.k_proj.k_scale` and `v_proj.v_scale`; other KV formats are
refused. Not handled: sharding into several safetensors files (one file is written).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kiln.kernels import fp8
from kiln.kernels.errors import KilnError
from kiln.kernels.mxfp4 import Mxfp4Weight, mxfp4_dequantize
from kiln.kernels.nvfp4 import Nvfp4Weight, nvfp4_dequantize
from kiln.kernels.registry import weight_format
from kiln.optimizer import __version__
from kiln.optimizer.export.notes import stamp, write_readme
from kiln.optimizer.export.unfuse import unfuse_artifact
from kiln.optimizer.loader_config import build_spec
from kiln.optimizer.output_dir import atomic_directory, check_output, mark_export
from kiln.runtime.artifact import MANIFEST, WEIGHTS, read_manifest
from kiln.runtime.spec import ModelSpec, spec_from_json
from kiln.runtime.weights import dequantize_weight

HF_QUANT_CONFIG = "hf_quant_config.json"
NVFP4_GROUP_SIZE = 16
COPIED_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
           "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja")


def modelopt_algo(module: str, entry: Mapping, tensors: Mapping[str, torch.Tensor]) -> str | None:
    """The ModelOpt quant_algo of one artifact format entry (its format object's "hf-modelopt" names); None for a
    dense linear."""
    fmt, act = entry.get("format"), entry.get("activation", "none")
    codec = weight_format(fmt)
    if not codec.dequantizes:
        return None
    if entry.get("input_rotation"):
        raise KilnError(f"{module}: its input is rotated online (Hadamard block {entry['input_rotation']}), "
                        "which the ModelOpt unified checkpoint cannot express; export a recipe without rotation")
    for key, algo in codec.export_names.get("hf-modelopt", {}).items():
        if _algo_applies(key, module, act, tensors):
            return algo
    refusal = codec.export_refusals.get(f"hf-modelopt {act}")
    if refusal:
        raise KilnError(f"{module}: {refusal}")
    raise KilnError(f"{module}: {fmt} weights with {act} activations have no ModelOpt unified-checkpoint "
                    "algorithm; try --format compressed-tensors (ModelOpt takes FP8 per-tensor + static, FP8 "
                    "per-channel + per-token, NVFP4 with calibrated input scale, NVFP4 weight-only, MXFP4)")


def _algo_applies(key: str, module: str, act: str, tensors: Mapping[str, torch.Tensor]) -> bool:
    """Whether a format object's "hf-modelopt" key ("activation" or "activation+condition") fits the linear:
    its activation format, and the scale granularity ("per_tensor", "per_channel") or a calibrated input_scale."""
    activation, _, condition = key.partition("+")
    if activation != act:
        return False
    if condition == "input_scale":
        return f"{module}.input_scale" in tensors
    if condition:
        per_tensor = tensors[f"{module}.weight_scale"].numel() == 1
        return condition == ("per_tensor" if per_tensor else "per_channel")
    return True


def _layer_config(algo: str) -> dict:
    if algo in ("NVFP4", "W4A16_NVFP4"):
        return {"quant_algo": algo, "group_size": NVFP4_GROUP_SIZE}
    return {"quant_algo": algo}


def summarize_excluded(unquantized: Iterable[str], quantized: Iterable[str]) -> list[str]:
    """Prefix-wildcard summary of the unquantized modules that matches no quantized module (ModelOpt's
    `exclude_modules` convention): e.g. a whole unquantized layer becomes "model.layers.7.*"."""
    negative: set[str] = set()
    for name in quantized:
        negative.add(name)
        negative.update(name[:i] + "*" for i in range(len(name) + 1))
    summary: set[str] = set()
    for name in unquantized:
        options = []
        for i, ch in enumerate(name):
            if ch == ".":
                options.append([name[:i] + "*"])
                options.append([name[:i], name[:i] + ".*"])
        options.append([name])
        chosen: list[str] = []
        for wildcards in options:
            if any(w in negative for w in wildcards):
                continue
            if all(w in summary for w in wildcards):
                chosen = []
                break
            chosen = wildcards
            break
        if len(chosen) == 2 and chosen[1] == chosen[0] + ".*":
            summary.add(chosen[1])  # deployment engines match "prefix.*"
        else:
            summary.update(chosen)
    return sorted(summary)


def kv_algo(kv_cache: Mapping, num_layers: int) -> str | None:
    """ModelOpt's kv_cache_quant_algo for the artifact's KV table: None (every layer BF16) or "FP8" (every layer
    FP8 E4M3 with one calibrated scale per tensor for K and for V, no offset). That is what the serving engines
    read: one KV dtype for the whole model (vLLM's kv_cache_dtype) and a k_scale and v_scale per layer
    (x = q * scale, as Kiln stores it). Anything else is refused in one line, naming what to build instead."""
    quantized = {int(layer): row for layer, row in kv_cache.items() if row.get("format") != "bf16"}
    if not quantized:
        return None
    fix = "build the kv-cache pass with format: fp8, scaling: per_tensor, center: false and no keep list"
    formats = sorted({str(row.get("format")) for row in quantized.values()})
    if formats != ["fp8_e4m3"]:
        raise KilnError(f"KV cache {', '.join(formats)}: the export layouts store FP8 E4M3 KV scales only; {fix}")
    bf16 = sorted(set(range(num_layers)) - set(quantized))
    if bf16:
        raise KilnError(f"layers {bf16[:4]} keep a BF16 KV cache, but a serving engine stores every layer's in one "
                        f"dtype; {fix}")
    for layer, row in sorted(quantized.items()):
        if row.get("scaling") != "per_tensor":
            raise KilnError(f"layer {layer}'s FP8 KV scales are {row.get('scaling')}, and the export layouts take one "
                            f"scale per tensor; {fix}")
        if row.get("offset_tensors"):
            raise KilnError(f"layer {layer}'s KV cache subtracts a calibrated offset (center), which no serving "
                            f"engine applies; {fix}")
        if sorted(row.get("streams") or ()) != ["k", "v"]:
            raise KilnError(f"layer {layer} caches streams {row.get('streams')} (MLA), which the export layouts do not "
                            "scale")
    return "FP8"


def kv_scale_names(kv_cache: Mapping, modelopt: bool) -> dict[str, str]:
    """Artifact KV scale tensor -> its name in the export: ModelOpt's `self_attn.k_proj.k_scale` /
    `v_proj.v_scale`, or llm-compressor's `self_attn.k_scale` / `v_scale` (the artifact's own names)."""
    out = {}
    for row in kv_cache.values():
        for stream, name in (row.get("scale_tensors") or {}).items():
            prefix = name.rsplit(".", 1)[0]
            out[name] = f"{prefix}.{stream}_proj.{stream}_scale" if modelopt else name
    return out


def hf_quant_config(manifest: Mapping, tensors: Mapping[str, torch.Tensor], embedding: str | None,
                    order: Iterable[str] = ()) -> dict:
    """hf_quant_config.json for an artifact (see the module docstring). Layers are listed in `order` (the
    model's module order, as ModelOpt lists them), then any others."""
    quantized: dict[str, dict] = {}
    unquantized: list[str] = []
    formats = manifest["formats"]
    modules = [m for m in order if m in formats] + [m for m in formats if m not in set(order)]
    for module in modules:
        entry = formats[module]
        algo = modelopt_algo(module, entry, tensors)
        if algo is None:
            unquantized.append(module)
        else:
            quantized[module] = _layer_config(algo)
    quantization: dict = {"quant_algo": None,
                          "kv_cache_quant_algo": kv_algo(manifest.get("kv_cache") or {},
                                                         len(manifest["architecture"]["layers"]))}
    distinct = {json.dumps(c, sort_keys=True) for c in quantized.values()}
    if len(distinct) > 1:
        quantization["quant_algo"] = "MIXED_PRECISION"
        quantization["quantized_layers"] = quantized
    elif distinct:
        quantization.update(next(iter(quantized.values())))
        if embedding:
            unquantized.append(embedding)
        quantization["exclude_modules"] = summarize_excluded(unquantized, quantized)
    return {"producer": {"name": "kiln", "version": __version__}, "quantization": quantization}


def _group_details(algo: str, group_size: int | None) -> dict:
    gs = group_size or NVFP4_GROUP_SIZE
    if algo == "FP8":
        return {"input_activations": {"dynamic": False, "num_bits": 8, "type": "float"},
                "weights": {"dynamic": False, "num_bits": 8, "type": "float"}}
    if algo == "FP8_PER_CHANNEL_PER_TOKEN":
        return {"input_activations": {"dynamic": False, "num_bits": 8, "type": "float"},
                "weights": {"dynamic": False, "num_bits": 8, "type": "float", "strategy": "channel"}}
    if algo == "NVFP4":
        return {"input_activations": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": gs},
                "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": gs}}
    if algo == "W4A16_NVFP4":
        return {"weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": gs}}
    return {"quant_algo": algo}  # ModelOpt writes no config group for mxfp4 either


def quantization_config(hf_quant: Mapping) -> dict:
    """config.json's "quantization_config": the compressed-tensors-style view ModelOpt derives from
    hf_quant_config (its `convert_hf_quant_config_format`)."""
    q = hf_quant["quantization"]
    algo = q.get("quant_algo")
    out: dict = {}
    if algo in ("FP8", "NVFP4", "W4A16_NVFP4"):
        out["config_groups"] = {"group_0": {**_group_details(algo, q.get("group_size")), "targets": ["Linear"]}}
    elif algo == "MIXED_PRECISION":
        by_config: dict[tuple, list[str]] = {}
        for layer, cfg in q["quantized_layers"].items():
            by_config.setdefault(tuple(sorted(cfg.items())), []).append(layer)
        out["config_groups"] = {
            f"group_{i}": {**_group_details(dict(key)["quant_algo"], dict(key).get("group_size")),
                           "targets": sorted(layers)}
            for i, (key, layers) in enumerate(by_config.items())}
        out["quantized_layers"] = q["quantized_layers"]
    out["ignore"] = list(q.get("exclude_modules") or [])
    if algo:
        out["quant_algo"] = algo
    kv = q.get("kv_cache_quant_algo")
    if kv:
        out["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"} if kv == "FP8" else kv
    out["producer"] = hf_quant["producer"]
    out["quant_method"] = "modelopt"
    return out


def check_kv_scales(manifest: Mapping, artifact_tensors: Mapping[str, torch.Tensor], path: Path,
                    modelopt: bool) -> None:
    """Each KV scale the export wrote (`path`'s model.safetensors) is the artifact's value under its export name."""
    names = kv_scale_names(manifest.get("kv_cache") or {}, modelopt)
    if not names:
        return
    with safe_open(str(path / "model.safetensors"), framework="pt") as written:  # the scales alone are read
        keys = set(written.keys())
        for name, exported in names.items():
            got = written.get_tensor(exported) if exported in keys else None
            if got is None or not torch.equal(got.float().reshape(()), artifact_tensors[name].float().reshape(())):
                raise KilnError(f"export check failed: KV scale {exported} is not the artifact's {name}")


def export_tensors(manifest: Mapping, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The artifact's tensors in ModelOpt's names and shapes (FP8 per-channel scales: [N, 1] -> [N]; KV scales
    under the k_proj / v_proj their stream comes from)."""
    out = dict(tensors)
    for name, exported in kv_scale_names(manifest.get("kv_cache") or {}, modelopt=True).items():
        out[exported] = out.pop(name).float().reshape(())
    for module, entry in manifest["formats"].items():
        codec = weight_format(entry.get("format"))
        if codec.dequantizes and not codec.blocked:  # a scale per tensor or per output channel
            scale = tensors[f"{module}.weight_scale"]
            if scale.numel() > 1:
                out[f"{module}.weight_scale"] = scale.reshape(-1).contiguous()
    return out


def copy_tokenizer_files(artifact: Path, export: Path) -> None:
    """The tokenizer and generation files a serving engine reads beside the weights."""
    for name in COPIED_FILES:
        if (artifact / name).is_file():
            shutil.copyfile(artifact / name, export / name)


class ExportSource(NamedTuple):
    """What both export layouts read from an artifact."""

    manifest: dict
    tensors: dict[str, torch.Tensor]
    config: dict  # the source's HF config: the export's config.json starts from it
    spec: ModelSpec
    embedding: str  # module name of the embedding (no ".weight")


def read_for_export(artifact: Path, output: Path, overwrite: bool) -> ExportSource:
    """The verified artifact, after refusing an output the export may not write (before reading weights). Fused
    linears (passes/fuse.py) come back as their parts: serving engines load q/k/v and gate/up by their own names
    and fuse them themselves (optimizer.export.unfuse)."""
    manifest = read_manifest(artifact)
    check_output(output, overwrite, [artifact])
    manifest, tensors = unfuse_artifact(manifest, load_file(str(artifact / WEIGHTS)))
    spec = spec_from_json(manifest["architecture"])
    return ExportSource(manifest, tensors, json.loads((artifact / "config.json").read_text()),
                        spec, spec.embedding.removesuffix(".weight"))


def export_hf_modelopt(artifact: Path | str, output: Path | str, overwrite: bool = False) -> Path:
    """Write `artifact` as a ModelOpt unified HF checkpoint in `output` (atomically), verify it, return it."""
    artifact, output = Path(artifact), Path(output)
    manifest, tensors, config, spec, embedding = read_for_export(artifact, output, overwrite)
    hf_quant = hf_quant_config(manifest, tensors, embedding, [lin.name for lin in spec.linears()])
    exported = export_tensors(manifest, tensors)
    with atomic_directory(output, overwrite, [artifact]) as tmp:
        write_modelopt_files(tmp, artifact, exported, hf_quant, config)
        verify_export(tmp, artifact)
    return output


def write_modelopt_files(directory: Path, artifact: Path, tensors: dict[str, torch.Tensor], hf_quant: dict,
                         config: dict) -> None:
    """An hf-modelopt export's files in `directory`: the marker, the weights, hf_quant_config.json (when anything
    is quantized), config.json with its quantization_config, the tokenizer."""
    mark_export(directory, artifact, "hf-modelopt")
    write_readme(directory, "hf-modelopt", artifact)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    if hf_quant["quantization"]["quant_algo"] or hf_quant["quantization"]["kv_cache_quant_algo"]:
        (directory / HF_QUANT_CONFIG).write_text(json.dumps(hf_quant, indent=4) + "\n")
        config = {**config, "quantization_config": quantization_config(hf_quant)}
    (directory / "config.json").write_text(json.dumps(stamp(config), indent=4) + "\n")
    copy_tokenizer_files(artifact, directory)


MODELOPT_TENSORS = {"FP8": ("weight", "weight_scale"), "FP8_PER_CHANNEL_PER_TOKEN": ("weight", "weight_scale"),
                    "NVFP4": ("weight", "weight_scale", "weight_scale_2"),
                    "W4A16_NVFP4": ("weight", "weight_scale", "weight_scale_2"), "mxfp4": ("weight", "weight_scale")}
"""The weight tensors (`<module>.<name>`) each quant_algo this reader decodes stores per linear."""


def modelopt_linear_algo(name: str, quantization: Mapping, tensors: Mapping) -> str | None:
    """The quant_algo of linear `name` under hf_quant_config.json's "quantization" (None: unquantized); `tensors`
    only needs `in` (a safetensors header does)."""
    algo = quantization.get("quant_algo")
    if algo == "MIXED_PRECISION":
        return (quantization.get("quantized_layers") or {}).get(name, {}).get("quant_algo")
    if algo and f"{name}.weight_scale" in tensors:
        return algo
    return None


def dequantize_modelopt_linear(name: str, algo: str, tensors: Mapping[str, torch.Tensor],
                               in_features: int) -> torch.Tensor:
    """fp32 weight of one linear stored with ModelOpt quant_algo `algo` (in_features: the true K; block formats
    pad it)."""
    if algo in ("FP8", "FP8_PER_CHANNEL_PER_TOKEN"):
        scale = tensors[f"{name}.weight_scale"].float()
        return fp8.fp8_dequantize(tensors[f"{name}.weight"], scale.reshape(-1, 1) if scale.numel() > 1 else scale)
    if algo in ("NVFP4", "W4A16_NVFP4"):
        return nvfp4_dequantize(Nvfp4Weight.from_tensors({k: tensors[f"{name}.{k}"] for k in MODELOPT_TENSORS[algo]},
                                                         in_features=in_features))
    if algo == "mxfp4":
        return mxfp4_dequantize(Mxfp4Weight.from_tensors({k: tensors[f"{name}.{k}"] for k in MODELOPT_TENSORS[algo]},
                                                         in_features=in_features))
    raise KilnError(f"{name} has quant_algo {algo!r}, which this reader does not know")


def dequantize_hf_modelopt(path: Path | str) -> dict[str, torch.Tensor]:
    """fp32 weight of every linear of an hf-modelopt checkpoint, read the way a serving engine reads it:
    the algorithm from hf_quant_config.json, the true in_features from config.json (block formats pad K)."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    spec = build_spec(config)
    tensors = load_file(str(path / "model.safetensors"))
    q = json.loads((path / HF_QUANT_CONFIG).read_text())["quantization"] if (path / HF_QUANT_CONFIG).is_file() \
        else {"quant_algo": None}
    out: dict[str, torch.Tensor] = {}
    for lin in spec.linears():
        name = lin.name
        algo = modelopt_linear_algo(name, q, tensors)
        if algo is None:
            weight = tensors.get(f"{name}.weight")
            if weight is None and name == "lm_head" and spec.lm_head_tied(tensors):
                weight = tensors[spec.embedding]
            out[name] = weight.float()
        else:
            try:
                out[name] = dequantize_modelopt_linear(name, algo, tensors, lin.in_features)
            except KilnError as exc:
                raise KilnError(f"{path}: {exc}") from None
    return out


def verify_export(path: Path, artifact: Path) -> None:
    """The export, dequantized as a serving engine would, must equal the artifact's weights bit for bit (a fused
    linear's parts: its rows, optimizer.export.unfuse)."""
    manifest, tensors = unfuse_artifact(json.loads((artifact / MANIFEST).read_text()),
                                        load_file(str(artifact / WEIGHTS)))
    spec = spec_from_json(manifest["architecture"])
    exported = dequantize_hf_modelopt(path)
    for lin in spec.linears():
        entry = manifest["formats"].get(lin.name, {"format": "dense"})
        if lin.name == "lm_head" and spec.lm_head_tied(tensors):
            expected = tensors[spec.embedding].float()
        else:
            expected = dequantize_weight(lin.name, entry, tensors)
        if not torch.equal(exported[lin.name], expected):
            raise KilnError(f"export check failed: {lin.name} dequantizes differently from the artifact")
    check_kv_scales(manifest, tensors, path, modelopt=True)
