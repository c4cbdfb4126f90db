"""Checkpoint -> ModelGraph.

Accepts a local Hugging Face directory (config.json + model.safetensors, or a sharded
model.safetensors.index.json) or a hub id when the network allows. Safetensors only: pickle weights
(*.bin, *.pt, *.pth) are refused, never unpickled. Tensors are read one at a time, so the model is held once.
Every floating tensor is checked for NaN/Inf.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kernels.errors import KilnError
from passes.graph import Attention, Block, Linear, Mlp, ModelGraph, Source
from runtime.artifact import read_json, sha256_file
from runtime.spec import ModelSpec, build_spec

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja")


def resolve_checkpoint(ref: str | Path) -> Path:
    """A local directory for `ref`: the path itself, or a hub snapshot (safetensors and JSON files only)."""
    path = Path(ref).expanduser()
    if path.exists():
        if not path.is_dir():
            raise KilnError(f"checkpoint {path} is a file; pass the directory that holds config.json")
        return path
    text = str(ref)
    if text.count("/") == 1 and not text.startswith((".", "/", "~")):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(text, allow_patterns=["*.json", "*.safetensors", "tokenizer*",
                                                                "*.model", "*.txt", "*.jinja"]))
        except Exception as exc:  # noqa: BLE001 - any hub failure is one user-facing line
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise KilnError(f"cannot fetch {text!r} from the Hugging Face hub (offline or unknown id): {first}") from None
    raise KilnError(f"checkpoint {text} not found (neither a local directory nor a hub id like org/name)")


def _weight_files(root: Path) -> list[Path]:
    single = root / "model.safetensors"
    index = root / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise KilnError(f"{index} is not a valid safetensors index: {exc}") from None
        files = sorted({root / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise KilnError(f"{index} lists missing shard(s): {', '.join(missing)}")
        return files
    pickles = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise KilnError(f"{root} has only pickle weights ({', '.join(pickles[:3])}); Kiln never unpickles "
                        "checkpoints: convert them to safetensors first")
    raise KilnError(f"{root} has no model.safetensors or model.safetensors.index.json")


def _read_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    tensors[key] = f.get_tensor(key)
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise KilnError(f"{file} is corrupt or truncated: {str(exc).splitlines()[0]}") from None
    for key, t in tensors.items():
        if t.is_floating_point() and t.dtype.itemsize > 1 and not torch.isfinite(t).all():
            bad = "NaN" if torch.isnan(t).any() else "Inf"
            raise KilnError(f"tensor {key} contains {bad} values; refusing to optimize a broken checkpoint")
    return tensors


def read_config(root: Path) -> dict:
    config_path = root / "config.json"
    if not config_path.is_file():
        raise KilnError(f"{root} has no config.json; is it a Hugging Face checkpoint directory?")
    config = read_json(config_path)
    if not isinstance(config, dict):
        raise KilnError(f"{config_path} must hold a JSON object")
    return config


def graph_from_spec(spec: ModelSpec, config: dict, source: Source, tensors: dict[str, torch.Tensor]) -> ModelGraph:
    linears: dict[str, Linear] = {}
    for ls in spec.linears():
        tied = None
        if ls.role == "lm_head" and "lm_head.weight" not in tensors and spec.tie_word_embeddings:
            tied = spec.embedding
        linears[ls.name] = Linear(ls.name, ls.role, ls.in_features, ls.out_features, ls.layer, ls.expert, ls.proj,
                                  ls.bias, tied_to=tied)
    expected = [lin.weight_name for lin in linears.values()] + [spec.embedding, spec.final_norm]
    expected += [n for layer in spec.layers for n in layer.norms]
    expected += [f"{lin.name}.bias" for lin in linears.values() if lin.bias]
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise KilnError(f"checkpoint lacks {len(missing)} tensor(s) its {spec.model_type} config needs, e.g. "
                        f"{', '.join(missing[:3])}")
    for lin in linears.values():
        shape = tuple(tensors[lin.weight_name].shape)
        if shape != (lin.out_features, lin.in_features):
            raise KilnError(f"{lin.weight_name} has shape {shape}, config implies "
                            f"{(lin.out_features, lin.in_features)}")
    blocks = []
    for layer in spec.layers:
        a, m = layer.attention, layer.mlp
        attention = Attention(a.kind, a.num_heads, a.num_kv_heads, a.head_dim, a.v_head_dim,
                              {role: ls.name for role, ls in a.linears.items()}, a.kv_lora_rank, a.qk_rope_head_dim)
        shared = sum(1 for k in m.linears if k == "shared_gate")
        mlp = Mlp(m.kind, m.intermediate_size, {role: ls.name for role, ls in m.linears.items()},
                  tuple({p: ls.name for p, ls in e.items()} for e in m.experts), m.top_k,
                  int(getattr(spec.hf_config, "n_shared_experts", 0) or shared))
        blocks.append(Block(layer.index, attention, mlp, layer.norms))
    return ModelGraph(
        model_type=spec.model_type, config=config, source=source, tensors=tensors, embedding=spec.embedding,
        final_norm=spec.final_norm, blocks=blocks, linears=linears, tied_embeddings=spec.tie_word_embeddings,
    )


def load_checkpoint(ref: str | Path, trust_remote_code: bool = False) -> ModelGraph:
    """Read a checkpoint into a ModelGraph, refusing anything broken with a one-line KilnError."""
    root = resolve_checkpoint(ref)
    config = read_config(root)
    spec = build_spec(config, trust_remote_code)  # unsupported architectures fail here, before weights load
    files = _weight_files(root)
    tensors = _read_tensors(files)
    source = Source(
        path=root.resolve(),
        name=str(ref),
        weight_files={f.name: sha256_file(f) for f in files},
        weight_bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
        tokenizer_files=tuple(root / n for n in TOKENIZER_FILES if (root / n).is_file()),
    )
    return graph_from_spec(spec, config, source, tensors)
