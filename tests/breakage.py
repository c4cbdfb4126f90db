"""Broken copies of a checkpoint, one way of breaking it per kind, for the bad-input tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

# kind -> what the one-line error must say about it
MESSAGES = {
    "no_config": "no config.json",
    "truncated": "corrupt or truncated",
    "nan": "contains NaN",
    "unknown_arch": "unsupported architecture 'gpt2'",
    "pickle_only": "only pickle weights",
    "missing_tensor": "lacks 1 tensor",
}
KINDS = tuple(MESSAGES)


def broken_copy(src: Path, dst: Path, kind: str) -> Path:
    """Copy checkpoint `src` to `dst` and break it as `kind` says ("intact" leaves it whole)."""
    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    if kind == "no_config":
        (dst / "config.json").unlink()
    elif kind == "truncated":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    elif kind == "nan":
        tensors = load_file(weights)
        tensors["model.layers.0.mlp.down_proj.weight"][0, 0] = float("nan")
        save_file(tensors, weights)
    elif kind == "unknown_arch":
        cfg = json.loads((dst / "config.json").read_text())
        cfg["model_type"] = "gpt2"
        (dst / "config.json").write_text(json.dumps(cfg))
    elif kind == "pickle_only":
        weights.unlink()
        (dst / "pytorch_model.bin").write_bytes(b"\x80\x04not-unpickled")
    elif kind == "missing_tensor":
        tensors = load_file(weights)
        del tensors["model.layers.0.self_attn.k_proj.weight"]
        save_file(tensors, weights)
    elif kind != "intact":
        raise ValueError(f"unknown breakage {kind!r}; known: {', '.join(KINDS)}, intact")
    return dst
