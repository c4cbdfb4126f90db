"""Broken copies of a checkpoint, one way of breaking it per kind, for the bad-input tests.

Every kind works on any single-file Llama-style checkpoint (the tiny Llama and the generated one)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# kind -> what the one-line error must say about it
MESSAGES = {
    "no_config": "no config.json",
    "truncated": "corrupt or truncated",
    "nan": "contains NaN",
    "unknown_arch": "unsupported architecture 'gpt2'",
    "pickle_only": "only pickle weights",
    "missing_tensor": "lacks 1 tensor",
    "undeclared_layers": "holds tensors for layer 1, which config.json does not declare (num_hidden_layers is 1)",
    "huge_layer_count": "config.json declares 1000000000000 layers (num_hidden_layers) but the checkpoint holds "
                        "tensors for 2",
    "zero_layers": "config.json: num_hidden_layers must be a positive integer, got 0",
    "string_heads": "config.json: num_attention_heads must be a positive integer, got 'five'",
    "kv_heads_mismatch": "is not a multiple of num_key_value_heads 3",
    "norm_shape": "model.layers.0.input_layernorm.weight has shape (32,), config implies (64,)",
    "norm_overflow": "norm weight model.layers.0.input_layernorm.weight holds a value of magnitude 1e+30",
    "fp8_nan": "tensor model.layers.0.mlp.down_proj.weight contains NaN values",
    "int_weight": "model.layers.0.self_attn.q_proj.weight has dtype I8; a linear weight must be floating point",
    "index_not_object": "is not a valid safetensors index",
    "index_escapes": "points outside the checkpoint directory",
    "index_wrong_shard": "which does not hold it",
    "prequantized": "pre-quantized checkpoint (fp8): quantization_config says quant_method fp8 but no tensor has a "
                    "weight_scale_inv",
    "artifact": "is a Kiln engine artifact, not a checkpoint: give the source checkpoint it was built from "
                "(manifest source: org/source-model)",
}
KINDS = tuple(MESSAGES)

_CONFIG_EDITS = {
    "unknown_arch": {"model_type": "gpt2"},
    "undeclared_layers": {"num_hidden_layers": 1},
    "huge_layer_count": {"num_hidden_layers": 10**12},
    "zero_layers": {"num_hidden_layers": 0},
    "string_heads": {"num_attention_heads": "five"},
    "kv_heads_mismatch": {"num_key_value_heads": 3},
    "prequantized": {"quantization_config": {"quant_method": "fp8"}},
}
_NORM = "model.layers.0.input_layernorm.weight"
_DOWN, _Q = "model.layers.0.mlp.down_proj.weight", "model.layers.0.self_attn.q_proj.weight"


def _nan(t: dict) -> None:
    t[_DOWN][0, 0] = float("nan")


def _fp8_nan(t: dict) -> None:
    t[_DOWN] = t[_DOWN].to(torch.float8_e4m3fn)
    t[_DOWN].view(torch.uint8)[0, 0] = 0x7F  # e4m3fn has no Inf: S.1111.111 is its only NaN


def _norm_shape(t: dict) -> None:
    t[_NORM] = t[_NORM][: t[_NORM].numel() // 2].clone()


def _norm_overflow(t: dict) -> None:
    t[_NORM][0] = 1e30


def _int_weight(t: dict) -> None:
    t[_Q] = (t[_Q] * 100).to(torch.int8)


_TENSOR_EDITS = {"nan": _nan, "fp8_nan": _fp8_nan, "norm_shape": _norm_shape, "norm_overflow": _norm_overflow,
                 "int_weight": _int_weight, "missing_tensor": lambda t: t.pop("model.layers.0.self_attn.k_proj.weight")}


def _shard(dst: Path, edit_map) -> None:
    """Split model.safetensors into two shards with an index, then let `edit_map` break the index."""
    weights = dst / "model.safetensors"
    tensors = load_file(weights)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, dst / file)
    weights.unlink()
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(edit_map(index, names)))


def broken_copy(src: Path, dst: Path, kind: str) -> Path:
    """Copy checkpoint `src` to `dst` and break it as `kind` says ("intact" leaves it whole)."""
    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    if kind in _CONFIG_EDITS:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(_CONFIG_EDITS[kind])
        (dst / "config.json").write_text(json.dumps(cfg))
    elif kind == "no_config":
        (dst / "config.json").unlink()
    elif kind == "truncated":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    elif kind in _TENSOR_EDITS:
        tensors = load_file(weights)
        _TENSOR_EDITS[kind](tensors)
        save_file(tensors, weights)
    elif kind == "pickle_only":
        weights.unlink()
        (dst / "pytorch_model.bin").write_bytes(b"\x80\x04not-unpickled")
    elif kind == "index_not_object":
        _shard(dst, lambda index, names: [index])
    elif kind == "index_escapes":
        _shard(dst, lambda index, names: {**index, "weight_map": {**index["weight_map"],
                                                                   names[0]: "../model-00001-of-00002.safetensors"}})
    elif kind == "index_wrong_shard":
        _shard(dst, lambda index, names: {**index, "weight_map": {**index["weight_map"],
                                                                   names[0]: "model-00002-of-00002.safetensors"}})
    elif kind == "artifact":
        (dst / "manifest.json").write_text(json.dumps({"schema_version": 1,
                                                       "source": {"checkpoint": "org/source-model"}}))
    elif kind != "intact":
        raise ValueError(f"unknown breakage {kind!r}; known: {', '.join(KINDS)}, intact")
    return dst
