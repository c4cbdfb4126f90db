"""ModelGraph: the typed IR that passes read and rewrite.

It is a view over the checkpoint's tensors (Hugging Face names, source dtype) plus annotations:
    blocks      attention kind (MHA/GQA/MLA) and head shapes; MLP kind (dense/MoE) with experts, top-k,
                shared experts and router; norms
    linears     every linear by module name, with its role (q, k, v, o, q_a, q_b, kv_a, kv_b, gate, up, down,
                expert, router, lm_head) and its precision: `quant` is None while it stays in source precision
                and a `QuantizedWeight` (packed tensors + format) once a pass quantized it
Passes never mutate a tensor in place; they replace entries, so `snapshot()`/`restore()` are shallow copies
and reverting a pass costs nothing.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROLES = ("q", "k", "v", "o", "q_a", "q_b", "kv_a", "kv_b", "gate", "up", "down", "expert", "router", "lm_head")


@dataclass(frozen=True)
class QuantizedWeight:
    """A linear's weight as it will be stored: packed tensors (ModelOpt names, no module prefix) + format."""

    format: str  # "fp8_e4m3", "nvfp4", "mxfp4"
    tensors: Mapping[str, torch.Tensor]  # "weight", "weight_scale", "weight_scale_2", "input_scale"
    activation: str = "none"  # "none", "fp8_dynamic_per_token", "fp8_static_per_tensor", "nvfp4", "mxfp4"
    in_features: int | None = None  # block formats: K before padding
    method: str = "rtn"  # how the values were chosen (rtn, mse, gptq, awq, ...)
    rotation_block: int = 0  # > 0: `tensors` hold W R and the input is rotated by R (kernels.rotation) first

    def stored_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass
class Linear:
    name: str  # module path; the weight tensor is f"{name}.weight"
    role: str
    in_features: int
    out_features: int
    layer: int | None = None
    expert: int | None = None
    proj: str | None = None  # gate/up/down for experts and shared experts
    bias: bool = False
    quant: QuantizedWeight | None = None
    tied_to: str | None = None  # lm_head tied to the embedding: its weight is that tensor

    @property
    def weight_name(self) -> str:
        return self.tied_to or f"{self.name}.weight"

    @property
    def format(self) -> str:
        return self.quant.format if self.quant else "dense"

    @property
    def group(self) -> str:
        """Precision group: q/k/v share a format, gate/up share one, and all of a layer's experts share one."""
        if self.role == "lm_head":
            return "lm_head"
        if self.role == "expert":
            return f"layers.{self.layer}.experts"
        if self.role in ("q", "k", "v", "q_a", "q_b", "kv_a", "kv_b"):
            return f"layers.{self.layer}.qkv"
        if self.role in ("gate", "up"):
            return f"layers.{self.layer}.{'shared_' if 'shared' in self.name else ''}gate_up"
        return f"layers.{self.layer}.{'shared_' if 'shared' in self.name else ''}{self.role}"


@dataclass(frozen=True)
class Attention:
    kind: str  # "mha", "gqa", "mla"
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    linears: Mapping[str, str]  # role -> linear name
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0


@dataclass(frozen=True)
class Mlp:
    kind: str  # "dense", "moe"
    intermediate_size: int
    linears: Mapping[str, str]  # dense: gate/up/down; moe: router and shared_* -> linear name
    experts: tuple[Mapping[str, str], ...] = ()
    top_k: int = 0
    num_shared_experts: int = 0

    @property
    def num_experts(self) -> int:
        return len(self.experts)


@dataclass(frozen=True)
class Block:
    index: int
    attention: Attention
    mlp: Mlp
    norms: tuple[str, ...]


@dataclass(frozen=True)
class Source:
    """Where the graph came from: directory, weight files with their sha256, byte size, tokenizer files."""

    path: Path
    name: str
    weight_files: Mapping[str, str]
    weight_bytes: int
    tokenizer_files: tuple[Path, ...] = ()


@dataclass
class ModelGraph:
    model_type: str
    config: dict  # the checkpoint's config.json, unchanged
    source: Source
    tensors: dict[str, torch.Tensor]
    embedding: str
    final_norm: str
    blocks: list[Block]
    linears: dict[str, Linear]
    tied_embeddings: bool
    kv_cache: dict[int, dict] = field(default_factory=dict)  # layer -> KV format annotation
    metadata: dict = field(default_factory=dict)  # what passes record for the artifact (e.g. sensitivity)

    # --- views ----------------------------------------------------------------------------------------------
    def weight(self, linear: Linear | str) -> torch.Tensor:
        lin = self.linears[linear] if isinstance(linear, str) else linear
        return self.tensors[lin.weight_name]

    def iter_linears(self, roles: tuple[str, ...] | None = None) -> Iterator[Linear]:
        for lin in self.linears.values():
            if roles is None or lin.role in roles:
                yield lin

    def groups(self) -> dict[str, list[Linear]]:
        out: dict[str, list[Linear]] = {}
        for lin in self.linears.values():
            out.setdefault(lin.group, []).append(lin)
        return out

    def source_weight_bytes(self) -> int:
        return self.source.weight_bytes

    # --- rewriting --------------------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        return {
            "tensors": dict(self.tensors),
            "quant": {name: lin.quant for name, lin in self.linears.items()},
            "kv_cache": copy.deepcopy(self.kv_cache),
            "metadata": copy.copy(self.metadata),
        }

    def restore(self, state: dict) -> None:
        self.tensors = dict(state["tensors"])
        for name, quant in state["quant"].items():
            self.linears[name].quant = quant
        self.kv_cache = copy.deepcopy(state["kv_cache"])
        self.metadata = copy.copy(state["metadata"])
