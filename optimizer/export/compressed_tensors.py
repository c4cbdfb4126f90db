"""Engine artifact -> a Hugging Face checkpoint in the compressed-tensors layout ("compressed-tensors"): the
on-disk format of llm-compressor, which vLLM (quantization="compressed-tensors", picked up from config.json),
SGLang and Hugging Face transformers load.

    DIR/model.safetensors   every artifact tensor under its Hugging Face name, quantized linears renamed and
                            reshaped to compressed-tensors' parameters (below), everything else as stored
    DIR/config.json         the source config plus "quantization_config" (quant_method "compressed-tensors",
                            quantization_status "compressed", one config group per scheme)
    DIR/tokenizer files, generation_config.json

Each linear's artifact format maps to one scheme (weights / input_activations QuantizationArgs and a
compression format); the names in brackets are compressed-tensors' presets that write the same JSON:

    artifact format + activation          weights              input_activations        format
    fp8_e4m3 per-tensor, none             8 float tensor       -                        naive-quantized  (W8A16)
    fp8_e4m3 per-channel, none            8 float channel      -                        naive-quantized  (W8A16)
    fp8_e4m3 per-tensor, static           8 float tensor       8 float tensor static    float-quantized  [FP8]
    fp8_e4m3 per-channel, dynamic/token   8 float channel      8 float token dynamic    float-quantized  [FP8_DYNAMIC]
    fp8_e4m3 per-channel, static          8 float channel      8 float tensor static    float-quantized
    fp8_e4m3 per-tensor, dynamic/token    8 float tensor       8 float token dynamic    float-quantized
    nvfp4, none                           4 float tensor_group 16                        nvfp4-pack-quantized [NVFP4A16]
    nvfp4, nvfp4 + calibrated input_scale 4 float tensor_group 16, dynamic "local"      nvfp4-pack-quantized [NVFP4]
    mxfp4, none                           4 float group 32 (E8M0 uint8 scales)          mxfp4-pack-quantized [MXFP4A16]
    mxfp4, mxfp4                          4 float group 32, dynamic group 32 activations mxfp4-pack-quantized [MXFP4]

Tensors per quantized linear (compressed-tensors' parameter names; scales float32):
    FP8     weight (float8_e4m3fn [N, K]), weight_scale ([1] per tensor, [N, 1] per channel), input_scale ([1],
            static activations only)
    NVFP4   weight_packed (uint8 [N, K/2], the artifact's bytes), weight_scale (float8_e4m3fn [N, K/16], the
            artifact's bytes), weight_global_scale ([1]) = 1 / weight_scale_2, input_global_scale ([1]) =
            1 / input_scale (W4A4). compressed-tensors stores the global scales as divisors: it decodes
            e2m1 * (weight_scale / weight_global_scale) and quantizes activations with x * input_global_scale,
            where ModelOpt (and the artifact) multiply by weight_scale_2 and divide by input_scale. The
            reciprocals are float32's correctly rounded 1/x, as compressed-tensors' own ModelOpt converter and
            vLLM's loaders take them.
    MXFP4   weight_packed (uint8 [N, K/2]), weight_scale (uint8 E8M0 [N, K/32], scale = 2^(e - 127))
Both FP4 layouts put element 2i in the low nibble with the same E2M1 codes as Kiln (kernels/fp4.py).

One scheme for every quantized linear: a single config group targeting "Linear", as llm-compressor writes it.
Several (e.g. the auto or production recipes): one group per scheme whose `targets` list its module names,
global format "mixed-precision" when the groups' formats differ. Either way `ignore` lists every unquantized
linear (lm_head, routers, layers kept in BF16) by name, which vLLM requires for any linear no group targets.

Refused with one line naming the module: online input rotations (Kiln's block Hadamard is not written as a
compressed-tensors transform_config), NVFP4 activations without a calibrated input scale (the format needs a
static input_global_scale), FP4 layers whose in_features is not a multiple of the group (compressed-tensors
and vLLM store whole groups only; Kiln pads), other weight/activation pairs, and KV caches other than FP8 with
a scale per tensor (export_modelopt.kv_algo). An FP8 KV cache is written as kv_cache_scheme (float, 8 bits,
strategy tensor, static) with each layer's `self_attn.k_scale` and `v_scale`, as llm-compressor writes them.

After writing, the export is read back and decoded with compressed-tensors' arithmetic
(`dequantize_compressed_tensors`). FP8, MXFP4 and unquantized weights must equal the artifact's bit for bit.
NVFP4 codes and block scales must be the artifact's bytes and the global scales its exact reciprocals; the
decoded weights can then differ from the artifact's e2m1 * (s * g) by the rounding of 1/g (at most 2^-21
relative): a float32 g is, in general, not the reciprocal of any float32, so no stored global scale
reproduces it exactly in every block.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kiln.kernels import fp8
from kiln.kernels.errors import KilnError
from kiln.kernels.formats import ActivationFormat
from kiln.kernels.fp4 import e2m1_decode, unpack_fp4
from kiln.kernels.mxfp4 import e8m0_to_float32
from kiln.kernels.registry import weight_format
from kiln.kernels.weight_codec import WeightCodec
from kiln.optimizer import __version__
from kiln.optimizer.export.modelopt import (
    NVFP4_GROUP_SIZE,
    check_kv_scales,
    copy_tokenizer_files,
    kv_algo,
    kv_scale_names,
    read_for_export,
)
from kiln.optimizer.export.notes import stamp, write_readme
from kiln.optimizer.export.unfuse import unfuse_artifact
from kiln.optimizer.loader_config import build_spec
from kiln.optimizer.output_dir import atomic_directory, mark_export
from kiln.runtime.artifact import MANIFEST, WEIGHTS
from kiln.runtime.spec import spec_from_json
from kiln.runtime.weights import dequantize_weight

QUANT_METHOD = "compressed-tensors"
MXFP4_GROUP_SIZE = 32
MIXED_PRECISION = "mixed-precision"
NVFP4_DECODE_RTOL = 2.0**-21
"""How far compressed-tensors' NVFP4 decode e2m1 * fp32(s / fp32(1 / g)) may lie from the artifact's
e2m1 * fp32(s * g): the reciprocal, both scale products and the e2m1 product each round once (< 5 * 2^-24)."""

_EXPORTABLE = ("exportable: FP8 weight-only per-tensor or per-channel, FP8 with static per-tensor or dynamic "
               "per-token activations, NVFP4 weight-only, NVFP4 with a calibrated input scale, MXFP4 weight-only "
               "or with MXFP4 activations")


def _float_args(num_bits: int, strategy: str, dynamic: bool | str = False, group_size: int | None = None,
                **extra) -> dict:
    """One QuantizationArgs as compressed-tensors serializes it (its field order; symmetric float)."""
    return {"num_bits": num_bits, "type": "float", "symmetric": True, "group_size": group_size,
            "strategy": strategy, "dynamic": dynamic, **extra}


# scale_dtype is written for MXFP4 only: compressed-tensors < 0.13 (the version older vLLM releases pin)
# rejects the field, and its NVFP4 readers default to E4M3 scales anyway; MXFP4 exists from 0.13 on, which
# needs "torch.uint8" there to read the scales as E8M0 exponents.
_WEIGHTS = {
    "fp8_tensor": _float_args(8, "tensor"),
    "fp8_channel": _float_args(8, "channel"),
    "nvfp4": _float_args(4, "tensor_group", group_size=NVFP4_GROUP_SIZE),
    "mxfp4": _float_args(4, "group", group_size=MXFP4_GROUP_SIZE, scale_dtype="torch.uint8"),
}
_INPUTS = {
    "none": None,
    "fp8_dynamic_per_token": _float_args(8, "token", dynamic=True),
    "fp8_static_per_tensor": _float_args(8, "tensor"),
    "nvfp4": _float_args(4, "tensor_group", dynamic="local", group_size=NVFP4_GROUP_SIZE),
    "mxfp4": _float_args(4, "group", dynamic=True, group_size=MXFP4_GROUP_SIZE, scale_dtype="torch.uint8"),
}
_STATIC_INPUTS = {
    ActivationFormat.FP8_STATIC_PER_TENSOR: ("static FP8 activations", "input_scale"),
    ActivationFormat.NVFP4: ("NVFP4 activations", "input_global_scale"),
}
"""Artifact activation formats whose compressed-tensors scheme reads a calibrated scale: (what, its name there)."""
# (weight kind, artifact activation) -> (scheme label, compression format). Labels are compressed-tensors'
# preset names where one writes the same JSON.
SCHEMES = {
    ("fp8_tensor", "none"): ("FP8 weight-only (per-tensor)", "naive-quantized"),
    ("fp8_channel", "none"): ("FP8 weight-only (per-channel)", "naive-quantized"),
    ("fp8_tensor", "fp8_static_per_tensor"): ("FP8", "float-quantized"),
    ("fp8_channel", "fp8_dynamic_per_token"): ("FP8_DYNAMIC", "float-quantized"),
    ("fp8_channel", "fp8_static_per_tensor"): ("FP8 (per-channel weights, static activations)", "float-quantized"),
    ("fp8_tensor", "fp8_dynamic_per_token"): ("FP8 (per-tensor weights, per-token activations)", "float-quantized"),
    ("nvfp4", "none"): ("NVFP4A16", "nvfp4-pack-quantized"),
    ("nvfp4", "nvfp4"): ("NVFP4", "nvfp4-pack-quantized"),
    ("mxfp4", "none"): ("MXFP4A16", "mxfp4-pack-quantized"),
    ("mxfp4", "mxfp4"): ("MXFP4", "mxfp4-pack-quantized"),
}


@dataclass(frozen=True)
class Scheme:
    """The compressed-tensors scheme of one quantized linear."""

    label: str
    format: str
    weight_kind: str  # a key of _WEIGHTS
    activation: str  # the artifact's activation format

    @property
    def weights(self) -> dict:
        return dict(_WEIGHTS[self.weight_kind])

    @property
    def input_activations(self) -> dict | None:
        args = _INPUTS[self.activation]
        return None if args is None else dict(args)

    @property
    def packed(self) -> bool:
        """Whether the weight is stored as packed codes (weight_packed), as the FP4 formats are."""
        return self.format.endswith("pack-quantized")

    def group(self, targets: list[str]) -> dict:
        return {"targets": targets, "weights": self.weights, "input_activations": self.input_activations,
                "output_activations": None, "format": self.format}


def ct_scheme(module: str, entry: Mapping, tensors: Mapping[str, torch.Tensor]) -> Scheme | None:
    """The compressed-tensors scheme of one artifact format entry; None for an unquantized linear."""
    fmt, act = entry.get("format"), entry.get("activation", "none")
    codec = weight_format(fmt)
    if not codec.dequantizes:
        return None
    rotation = entry.get("input_rotation")
    if rotation:
        block = rotation.get("block_size") if isinstance(rotation, Mapping) else rotation
        raise KilnError(f"{module}: its input is rotated online (Hadamard block {block}), which this export does "
                        "not write as a compressed-tensors transform_config; export a recipe without rotation")
    kind = _weight_kind(module, entry, codec, tensors)
    if (kind, act) not in SCHEMES:
        raise KilnError(f"{module}: {fmt} weights with {act} activations have no compressed-tensors scheme "
                        f"({_EXPORTABLE})")
    static_input = _STATIC_INPUTS.get(act)
    if static_input and f"{module}.input_scale" not in tensors:
        what, stored_as = static_input
        raise KilnError(f"{module}: {what} without a calibrated input_scale have no compressed-tensors scheme "
                        f"(its {stored_as} is static; {_EXPORTABLE})")
    label, compression = SCHEMES[(kind, act)]
    return Scheme(label, compression, kind, act)


def _weight_kind(module: str, entry: Mapping, codec: WeightCodec,
                 tensors: Mapping[str, torch.Tensor]) -> str | None:
    """compressed-tensors' weight kind (a key of _WEIGHTS) of a quantized linear, from its format object's
    "compressed-tensors" name; None: the layout has none."""
    names = codec.export_names.get("compressed-tensors")
    if isinstance(names, Mapping):  # named by scale granularity: one scale per tensor, or per output channel
        scale, weight = tensors.get(f"{module}.weight_scale"), tensors.get(f"{module}.weight")
        if scale is None or weight is None:
            return None
        if scale.numel() == 1:
            return names["per_tensor"]
        return names["per_channel"] if scale.numel() == weight.shape[0] else None
    if names is not None:  # a block format
        group = codec.grid_block_size(0)
        in_features = int(entry.get("in_features", 0))
        if in_features % group:
            raise KilnError(f"{module}: in_features {in_features} is not a multiple of the "
                            f"{entry['format'].upper()} group size {group}; compressed-tensors and vLLM store whole "
                            "groups only (Kiln pads K), so this layer has no compressed-tensors layout; use --format "
                            "hf-modelopt or keep it unquantized")
    return names


def ordered_modules(formats: Mapping[str, Mapping], order: Iterable[str]) -> list[str]:
    order = list(order)
    known = set(order)
    return [m for m in order if m in formats] + [m for m in formats if m not in known]


def ct_schemes(manifest: Mapping, tensors: Mapping[str, torch.Tensor],
               order: Iterable[str] = ()) -> tuple[dict[str, Scheme], list[str]]:
    """({quantized module: scheme}, [unquantized modules]) in model order. Refuses what has no scheme."""
    formats = manifest["formats"]
    schemes: dict[str, Scheme] = {}
    unquantized: list[str] = []
    for module in ordered_modules(formats, order):
        scheme = ct_scheme(module, formats[module], tensors)
        if scheme is None:
            unquantized.append(module)
        else:
            schemes[module] = scheme
    return schemes, unquantized


def _ignored(unquantized: list[str], schemes: Mapping[str, Scheme], tensors: Mapping[str, torch.Tensor],
             embedding: str | None) -> list[str]:
    """Every linear no group targets: the unquantized modules of the format table, plus any other module with a
    2-D weight (a router the table leaves out, say). Naming a module that is no Linear is harmless."""
    out = list(unquantized)
    seen = set(out) | set(schemes)
    for name, value in tensors.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and value.ndim == 2 and module not in seen and module != embedding:
            out.append(module)
            seen.add(module)
    return out


KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True,
                   "group_size": None, "block_structure": None, "actorder": None, "observer": None,
                   "observer_kwargs": {}}
"""compressed-tensors' kv_cache_scheme for an FP8 E4M3 cache with a static scale per tensor (k_scale, v_scale)."""


def quantization_config(schemes: Mapping[str, Scheme], ignore: list[str], kv: str | None = None) -> dict | None:
    """config.json's "quantization_config" for `schemes` and the KV cache (`kv`: export_modelopt.kv_algo's "FP8"
    or None); None when nothing is quantized."""
    if not schemes and kv is None:
        return None
    groups: dict[Scheme, list[str]] = {}
    for module, scheme in schemes.items():
        groups.setdefault(scheme, []).append(module)
    single = len(groups) == 1
    config_groups = {f"group_{i}": scheme.group(["Linear"] if single else modules)
                     for i, (scheme, modules) in enumerate(groups.items())}
    formats = {scheme.format for scheme in groups}
    return {
        "config_groups": config_groups,
        "format": next(iter(formats)) if len(formats) == 1 else MIXED_PRECISION if formats else "dense",
        "global_compression_ratio": None,
        "ignore": ignore,
        "kv_cache_scheme": dict(KV_CACHE_SCHEME) if kv == "FP8" else None,
        "producer": {"name": "kiln", "version": __version__},
        "quant_method": QUANT_METHOD,
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
    }


def _reciprocal(x: torch.Tensor) -> torch.Tensor:
    """float32's correctly rounded 1 / x, as a [1] tensor (compressed-tensors' global-scale shape)."""
    x = x.detach().float().reshape(1)
    return torch.ones_like(x) / x


def export_tensors(schemes: Mapping[str, Scheme], tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The artifact's tensors under compressed-tensors' names and shapes (see the module docstring)."""
    out = dict(tensors)
    for module, scheme in schemes.items():
        p = f"{module}."
        if scheme.activation == ActivationFormat.NONE:
            out.pop(p + "input_scale", None)  # a weight-only layer has no activation scale to load
        if not scheme.packed:  # FP8: the weight as stored, its scale in compressed-tensors' shape
            scale = tensors[p + "weight_scale"].float()
            out[p + "weight_scale"] = (scale.reshape(1) if scheme.weights["strategy"] == "tensor"
                                       else scale.reshape(-1, 1)).contiguous()
            if scheme.activation == ActivationFormat.FP8_STATIC_PER_TENSOR:
                out[p + "input_scale"] = tensors[p + "input_scale"].float().reshape(1).contiguous()
            elif scheme.activation != "none":
                out.pop(p + "input_scale", None)
        else:  # nvfp4, mxfp4: the packed codes and block scales are the artifact's bytes
            out[p + "weight_packed"] = out.pop(p + "weight")
            if p + "weight_scale_2" in out:  # NVFP4's global scales, stored as their reciprocals
                out[p + "weight_global_scale"] = _reciprocal(out.pop(p + "weight_scale_2"))
                if p + "input_scale" in out:  # a weight-only layer's was dropped above
                    out[p + "input_global_scale"] = _reciprocal(out.pop(p + "input_scale"))
            else:
                out.pop(p + "input_scale", None)
    return out


def export_compressed_tensors(artifact: Path | str, output: Path | str, overwrite: bool = False) -> Path:
    """Write `artifact` as a compressed-tensors HF checkpoint in `output` (atomically), verify it, return it."""
    artifact, output = Path(artifact), Path(output)
    manifest, tensors, config, spec, embedding = read_for_export(artifact, output, overwrite)
    kv = kv_algo(manifest.get("kv_cache") or {}, len(spec.layers))
    schemes, unquantized = ct_schemes(manifest, tensors, [lin.name for lin in spec.linears()])
    quant = quantization_config(schemes, _ignored(unquantized, schemes, tensors, embedding), kv)
    exported = export_tensors(schemes, tensors)
    for name in kv_scale_names(manifest.get("kv_cache") or {}, modelopt=False):
        exported[name] = exported[name].float().reshape(1)  # compressed-tensors' per-tensor scale shape
    with atomic_directory(output, overwrite, [artifact]) as tmp:
        mark_export(tmp, artifact, "compressed-tensors")
        write_readme(tmp, "compressed-tensors", artifact)
        save_file(exported, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config.pop("quantization_config", None)
        if quant is not None:
            config["quantization_config"] = quant
        (tmp / "config.json").write_text(json.dumps(stamp(config), indent=4) + "\n")
        copy_tokenizer_files(artifact, tmp)
        verify_compressed_tensors(tmp, artifact)
    return output


# --- reading an export back --------------------------------------------------------------------------------------


def _matches(name: str, target: str) -> bool:
    """compressed-tensors' (and vLLM's) target matching for a linear: "Linear", an exact name or "re:" + regex."""
    if target == "Linear":
        return True
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


def scheme_of(name: str, quant: Mapping) -> Mapping | None:
    """The config group that quantizes linear `name`, or None when it is ignored; a linear neither ignored nor
    targeted is an error, as it is for vLLM. An exact-name target wins over a regex, a regex over "Linear"."""
    if any(_matches(name, t) for t in quant.get("ignore") or [] if t != "Linear"):
        return None
    best, rank = None, 3
    for group in (quant.get("config_groups") or {}).values():
        for target in group.get("targets", []):
            r = 0 if target == name else 1 if target.startswith("re:") else 2 if target == "Linear" else 3
            if r < rank and _matches(name, target):
                best, rank = group, r
    if best is None:
        raise KilnError(f"{name}: no config group targets it and it is not in `ignore`")
    return best


def _decode_fp4(packed: torch.Tensor, block_scale: torch.Tensor, group_size: int) -> torch.Tensor:
    values = e2m1_decode(unpack_fp4(packed))  # [N, K]
    blocks = values.reshape(values.shape[0], -1, group_size)
    return (blocks * block_scale.unsqueeze(-1)).reshape(values.shape)


def dequantize_linear(name: str, group: Mapping | None, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """fp32 weight of one linear, decoded as compressed-tensors decodes its format."""
    def need(key: str) -> torch.Tensor:
        if f"{name}.{key}" not in tensors:
            raise KilnError(f"{name}: the export is missing {name}.{key}")
        return tensors[f"{name}.{key}"]

    if group is None:
        return need("weight").float()
    weights, fmt = group["weights"], group.get("format")
    if weights["num_bits"] == 8 and weights["type"] == "float" and weights["strategy"] in ("tensor", "channel"):
        return fp8.fp8_dequantize(need("weight"), need("weight_scale").float())
    if weights["num_bits"] == 4 and weights["type"] == "float" and fmt == "nvfp4-pack-quantized":
        scale = need("weight_scale").float() / need("weight_global_scale").float()  # a divisor, not a factor
        return _decode_fp4(need("weight_packed"), scale, int(weights["group_size"]))
    if weights["num_bits"] == 4 and weights["type"] == "float" and fmt == "mxfp4-pack-quantized":
        scale = e8m0_to_float32(need("weight_scale"))  # 2^(e - 127), exactly
        return _decode_fp4(need("weight_packed"), scale, int(weights["group_size"]))
    raise KilnError(f"{name}: weights {weights} in format {fmt!r} are not something this reader decodes")


def dequantize_compressed_tensors(path: Path | str) -> dict[str, torch.Tensor]:
    """fp32 weight of every linear of a compressed-tensors checkpoint, decoded with compressed-tensors'
    arithmetic: the scheme from config.json's quantization_config (ignore, then targets), FP8 as q * scale,
    NVFP4 as e2m1 * (weight_scale / weight_global_scale), MXFP4 as e2m1 * 2^(e - 127)."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    quant = config.get("quantization_config")
    if quant is not None and (quant.get("quant_method") != QUANT_METHOD
                              or quant.get("quantization_status") != "compressed"):
        raise KilnError(f"{path}: quantization_config is not a compressed compressed-tensors config")
    spec = build_spec(config)
    tensors = load_file(str(path / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for lin in spec.linears():
        group = scheme_of(lin.name, quant) if quant is not None else None
        if group is None and lin.name == "lm_head" and spec.lm_head_tied(tensors):
            out[lin.name] = tensors[spec.embedding].float()
        else:
            out[lin.name] = dequantize_linear(lin.name, group, tensors)
    return out


def verify_compressed_tensors(path: Path, artifact: Path) -> None:
    """The export must decode to the artifact's weights (see the module docstring for NVFP4's global scale; a
    fused linear's parts: its rows, optimizer.export.unfuse)."""
    manifest, tensors = unfuse_artifact(json.loads((artifact / MANIFEST).read_text()),
                                        load_file(str(artifact / WEIGHTS)))
    spec = spec_from_json(manifest["architecture"])
    written = load_file(str(path / "model.safetensors"))
    exported = dequantize_compressed_tensors(path)
    for lin in spec.linears():
        name = lin.name
        entry = manifest["formats"].get(name, {"format": "dense"})
        if name == "lm_head" and spec.lm_head_tied(tensors):
            expected = tensors[spec.embedding].float()
        else:
            expected = dequantize_weight(name, entry, tensors)
        got = exported[name]
        if weight_format(entry.get("format")).takes_global_scale:  # NVFP4: stored as its reciprocal
            _check_nvfp4_storage(name, entry, tensors, written)
            same = got.shape == expected.shape and bool(
                ((got - expected).abs() <= NVFP4_DECODE_RTOL * expected.abs()).all())
        else:
            same = torch.equal(got, expected)
        if not same:
            raise KilnError(f"export check failed: {name} dequantizes differently from the artifact")
    check_kv_scales(manifest, tensors, path, modelopt=False)


def _check_nvfp4_storage(name: str, entry: Mapping, artifact: Mapping[str, torch.Tensor],
                         written: Mapping[str, torch.Tensor]) -> None:
    """NVFP4: the codes and block scales are the artifact's bytes, the global scales its exact reciprocals."""
    pairs = [("weight", "weight_packed"), ("weight_scale", "weight_scale")]
    ok = all(torch.equal(artifact[f"{name}.{a}"].view(torch.uint8), written[f"{name}.{b}"].view(torch.uint8))
             for a, b in pairs)
    ok = ok and torch.equal(written[f"{name}.weight_global_scale"], _reciprocal(artifact[f"{name}.weight_scale_2"]))
    if entry.get("activation") == ActivationFormat.NVFP4:
        ok = ok and torch.equal(written[f"{name}.input_global_scale"], _reciprocal(artifact[f"{name}.input_scale"]))
    if not ok:
        raise KilnError(f"export check failed: {name}'s NVFP4 tensors are not the artifact's")


def describe(path: Path | str) -> str:
    """One line for the CLI: the export's compression format and its schemes."""
    quant = json.loads((Path(path) / "config.json").read_text()).get("quantization_config")
    if not quant:
        return "no quantized linears"
    labels = []
    for group in quant["config_groups"].values():
        scheme = next((Scheme(label, fmt, kind, act) for (kind, act), (label, fmt) in SCHEMES.items()
                       if Scheme(label, fmt, kind, act).group(group["targets"]) == group), None)
        labels.append(scheme.label if scheme else group.get("format", "?"))
    return f"format {quant['format']}: {', '.join(labels)}"
