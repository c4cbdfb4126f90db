"""Which quantization a checkpoint's config names, refused in one line when Kiln cannot read it.

    method, q = resolve_quantization(root, config)    # ("fp8" | "modelopt" | "compressed-tensors", its config)
    check_quantization_config(root, config)           # the same, before any tensor is looked at

The methods read and how their weights decode are in `optimizer.prequantized` (its module docstring); this
module reads only config.json's `quantization_config` and ModelOpt's hf_quant_config.json.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from kiln.kernels.errors import KilnError

HF_QUANT_CONFIG = "hf_quant_config.json"
SUPPORTED = ("fp8 (float8_e4m3fn weights with weight_scale_inv per block or per tensor), modelopt (FP8, "
             "FP8_PER_CHANNEL_PER_TOKEN, NVFP4, W4A16_NVFP4, MXFP4, MIXED_PRECISION) and compressed-tensors "
             "(FP8 per tensor, channel or block; NVFP4; MXFP4)")
MODELOPT_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "NVFP4", "W4A16_NVFP4", "mxfp4")
MODELOPT_KV_ALGOS = (None, "FP8", "NVFP4")
FP8_BLOCK_DEFAULT = [128, 128]  # transformers' FineGrainedFP8Config default when weight_block_size is left out


def refuse(method: str, detail: str) -> KilnError:
    return KilnError(f"pre-quantized checkpoint ({method}): {detail}")


def unsupported(method: object, why: str = "") -> KilnError:
    return KilnError(f"pre-quantized checkpoints (quantization_config quant_method {method!s:.40}){why} are not "
                     f"supported; Kiln reads {SUPPORTED}; give the unquantized checkpoint")


def _modelopt_quantization(root: Path | None, quant: Mapping | None, hf_quant: Mapping | None) -> dict:
    """ModelOpt's "quantization" block: hf_quant_config.json's when present, else config.json's view of it."""
    if hf_quant is None and root is not None and (root / HF_QUANT_CONFIG).is_file():
        try:
            hf_quant = json.loads((root / HF_QUANT_CONFIG).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise refuse("modelopt", f"{root / HF_QUANT_CONFIG} is not valid JSON ({exc})") from None
    if hf_quant is not None:
        q = hf_quant.get("quantization") if isinstance(hf_quant, Mapping) else None
        if not isinstance(q, Mapping):
            raise refuse("modelopt", f"{HF_QUANT_CONFIG} has no \"quantization\" object")
        return {**q, "source": HF_QUANT_CONFIG}
    quant = quant or {}
    kv = quant.get("kv_cache_scheme")
    return {"quant_algo": quant.get("quant_algo"), "quantized_layers": quant.get("quantized_layers"),
            "exclude_modules": quant.get("ignore") or [], "source": "config.json",
            "kv_cache_quant_algo": "FP8" if isinstance(kv, Mapping) and kv.get("num_bits") == 8 else kv}


def _check_fp8(q: Mapping) -> None:
    if q.get("fmt", "e4m3") != "e4m3":
        raise unsupported("fp8", f" with fmt {q.get('fmt')!r:.20} (only e4m3 is read)")
    if q.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
        raise unsupported("fp8", f" with activation_scheme {q.get('activation_scheme')!r:.20}")
    block = q.get("weight_block_size", FP8_BLOCK_DEFAULT)
    if block is not None and not (isinstance(block, (list, tuple)) and len(block) == 2 and all(
            isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise refuse("fp8", f"quantization_config.weight_block_size must be two positive integers or null, "
                             f"got {block!r:.40}")
    skip = q.get("modules_to_not_convert") or q.get("ignored_layers")
    if skip is not None and not (isinstance(skip, list) and all(isinstance(s, str) for s in skip)):
        raise refuse("fp8", f"quantization_config.modules_to_not_convert must be a list of names, got {skip!r:.40}")


def _check_modelopt(q: Mapping) -> None:
    algo = q.get("quant_algo")
    layers = q.get("quantized_layers") or {}
    if algo == "MIXED_PRECISION":
        if not isinstance(layers, Mapping) or not layers:
            raise refuse("modelopt", "quant_algo MIXED_PRECISION needs its per-layer table (quantized_layers in "
                                      f"{HF_QUANT_CONFIG})")
        algos = {entry.get("quant_algo") if isinstance(entry, Mapping) else None for entry in layers.values()}
    else:
        algos = {algo} if algo else set()
    unknown = sorted(str(a) for a in algos - set(MODELOPT_ALGOS))
    if unknown:
        raise unsupported("modelopt", f" with quant_algo {unknown[0]:.30}")
    if q.get("kv_cache_quant_algo") not in MODELOPT_KV_ALGOS:
        raise unsupported("modelopt", f" with kv_cache_quant_algo {q.get('kv_cache_quant_algo')!s:.30}")
    if not algos and not q.get("kv_cache_quant_algo"):
        raise refuse("modelopt", "the quantization config names no quant_algo")


def ct_kind(group: Mapping) -> str | None:
    """The kind of weights a compressed-tensors config group stores (None: no weight quantization), or a
    one-line refusal naming what is not read."""
    weights = group.get("weights")
    if weights is None:
        return None
    if not isinstance(weights, Mapping):
        raise refuse("compressed-tensors", f"a config group's weights must be an object, got {weights!r:.40}")
    fmt = group.get("format")
    bits, kind, strategy = weights.get("num_bits"), weights.get("type"), weights.get("strategy")
    what = f"{bits}-bit {kind} {strategy} weights in format {fmt}"
    if kind != "float":
        raise unsupported("compressed-tensors", f" with {what} (integer weights are not read)")
    if weights.get("symmetric") is False or weights.get("zp_dtype"):
        raise unsupported("compressed-tensors", f" with asymmetric {what}")
    if bits == 8 and fmt in ("float-quantized", "naive-quantized"):
        if strategy in ("tensor", "channel"):
            return f"fp8-{strategy}"
        if strategy == "block":
            block = weights.get("block_structure")
            if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
                raise refuse("compressed-tensors", f"block_structure must be two positive integers, got {block!r:.40}")
            return "fp8-block"
    if bits == 4 and fmt == "nvfp4-pack-quantized" and strategy == "tensor_group" and weights.get("group_size") == 16:
        return "nvfp4"
    if bits == 4 and fmt == "mxfp4-pack-quantized" and strategy == "group" and weights.get("group_size") == 32:
        return "mxfp4"
    raise unsupported("compressed-tensors", f" with {what}")


def ct_groups(quant: Mapping) -> dict[str, dict]:
    """The config groups, each with its compression format (a group without one takes the global format)."""
    groups = quant.get("config_groups") or {}
    if not isinstance(groups, Mapping):
        raise refuse("compressed-tensors", "config_groups must be an object")
    return {name: {**g, "format": g.get("format") or quant.get("format")} for name, g in groups.items()
            if isinstance(g, Mapping)}


def _check_ct(quant: Mapping) -> None:
    status = quant.get("quantization_status")
    if status != "compressed":
        raise unsupported("compressed-tensors", f" with quantization_status {status!s:.20} (only compressed "
                                                 "checkpoints are read)")
    if quant.get("transform_config"):
        raise unsupported("compressed-tensors", " with a transform_config (online rotations, which dequantizing "
                                                 "the weights cannot fold away)")
    sparsity = quant.get("sparsity_config") or {}
    if sparsity and sparsity.get("format", "dense") != "dense":
        raise unsupported("compressed-tensors", f" with sparsity format {sparsity.get('format')!s:.30}")
    for group in ct_groups(quant).values():
        ct_kind(group)


def resolve_quantization(root: Path | None, config: Mapping, hf_quant: Mapping | None = None) -> tuple[str, dict] | None:
    """(quant_method, its normalized config), None for an unquantized checkpoint, or a one-line refusal."""
    quant = config.get("quantization_config")
    if quant is None:
        if hf_quant is not None or (root is not None and (root / HF_QUANT_CONFIG).is_file()):
            q = _modelopt_quantization(root, None, hf_quant)
            _check_modelopt(q)
            return "modelopt", q
        return None
    method = quant.get("quant_method", "unknown") if isinstance(quant, Mapping) else "unknown"
    if method == "fp8":
        _check_fp8(quant)
        return "fp8", dict(quant)
    if method == "modelopt":
        q = _modelopt_quantization(root, quant, hf_quant)
        _check_modelopt(q)
        return "modelopt", q
    if method == "compressed-tensors":
        _check_ct(quant)
        return "compressed-tensors", dict(quant)
    raise unsupported(method)


def check_quantization_config(root: Path | None, config: Mapping) -> None:
    """Refuse, in one line and before any tensor is looked at, a quantization_config Kiln cannot read."""
    resolve_quantization(root, config)
