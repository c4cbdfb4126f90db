"""ModelGraph: the typed IR that passes read and rewrite.

    spec        the runtime's `ModelSpec`: the model's structure, per layer (attention MHA/GQA/MLA with its
                rotary and softmax scale, dense or MoE MLP, norms) plus extra modules. A structural pass
                (MLA conversion, draft heads, fusion) rewrites it with `set_spec`; the artifact's manifest
                carries it and the runtime executes it
    tensors     the checkpoint's tensors (Hugging Face names, source dtype), as the passes left them: a
                `TensorStore` (passes.tensor_store) that reads the checkpoint's from disk on access and keeps
                replaced entries in an overlay, large ones spilled to a temporary file when the loader gave it one
    linears     every linear of the spec by module name, with its role and its precision annotation: `quant`
                is None while it stays in source precision and a `QuantizedWeight` (packed tensors + format)
                once a pass quantized it
    kv_cache    per-layer KV-cache format annotations;  metadata: what passes record for the artifact
Passes never mutate a tensor or a spec in place; they replace entries, so `snapshot()`/`restore()` are
shallow copies that cover everything a pass may change, and reverting a pass costs nothing.

Memory: a graph loaded from disk holds no tensor data itself. What a pass replaces goes to the overlay, and
with a spill file (the loader's) every large replaced tensor and every large packed tensor of a `quant`
annotation is written there as it is assigned, so a build holds what it is working on, never the model.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kiln.kernels.dequantize import dequantize
from kiln.passes.tensor_store import SpilledTensors, SpillFile, TensorStore, tensor_info
from kiln.runtime.spec import LayerSpec, ModelSpec

ROLES = ("q", "k", "v", "o", "q_a", "q_b", "kv_a", "kv_b", "k_down", "k_up", "v_down", "v_up", "gate", "up", "down",
         "expert", "router", "lm_head", "qkv", "gate_up")  # qkv, gate_up: fused (passes/fuse.py)


@dataclass(frozen=True)
class QuantizedWeight:
    """A linear's weight as it will be stored: packed tensors (ModelOpt names, no module prefix) + format."""

    format: str  # "fp8_e4m3", "nvfp4", "mxfp4", "mxfp6"
    tensors: Mapping[str, torch.Tensor]  # "weight", "weight_scale", "weight_scale_2", "input_scale"
    activation: str = "none"  # "none", "fp8_dynamic_per_token", "fp8_static_per_tensor", "nvfp4", "mxfp4"
    in_features: int | None = None  # block formats: K before padding
    method: str = "rtn"  # how the values were chosen (rtn, mse, gptq, awq, ...)
    rotation_block: int = 0  # > 0: `tensors` hold W R and the input is rotated by R (kernels.rotation) first
    # a fused FP8 linear whose parts had different per-tensor scales stores one per row: each part's original
    # granularity ("per_tensor" / "per_channel", in part order), so an export writes the parts back as they were
    part_scales: tuple[str, ...] = ()

    def stored_bytes(self) -> int:
        return sum(tensor_info(self.tensors, name).nbytes for name in self.tensors)

    def dequantize(self) -> torch.Tensor:
        """fp32 values (the runtime's arithmetic: kernels.dequantize)."""
        return dequantize(self.format, self.tensors, self.in_features)


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
    spill: SpillFile | None = field(default=None, repr=False, compare=False)  # the graph's, for `quant`

    def __setattr__(self, name, value):
        # a quant annotation's large packed tensors leave memory as soon as a pass assigns it (same values)
        if name == "quant" and value is not None and self.spill is not None:
            tensors = SpilledTensors.keep(value.tensors, self.spill)
            if tensors is not value.tensors:
                value = dataclasses.replace(value, tensors=tensors)
        object.__setattr__(self, name, value)

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
        if self.role in ("q", "k", "v", "q_a", "q_b", "kv_a", "kv_b", "k_down", "k_up", "v_down", "v_up"):
            return f"layers.{self.layer}.qkv"
        if self.role in ("gate", "up"):
            return f"layers.{self.layer}.{'shared_' if 'shared' in self.name else ''}gate_up"
        return f"layers.{self.layer}.{'shared_' if 'shared' in self.name else ''}{self.role}"


@dataclass(frozen=True)
class Source:
    """Where the graph came from: directory, weight files with their sha256, byte size, tokenizer files, the
    sha256 of its config.json's content, and its spec as loaded, before any pass (None: not known, e.g. a graph
    built in memory). An artifact's manifest records that spec (runtime/manifest.py)."""

    path: Path
    name: str
    weight_files: Mapping[str, str]
    weight_bytes: int
    tokenizer_files: tuple[Path, ...] = ()
    config_sha256: str | None = None
    spec: ModelSpec | None = None


@dataclass
class ModelGraph:
    spec: ModelSpec
    hf_config: dict  # the source checkpoint's HF config: provenance and export only, never read for structure
    source: Source
    tensors: TensorStore  # a plain dict is wrapped (as the overlay of an empty base)
    linears: dict[str, Linear] = field(default_factory=dict)
    kv_cache: dict[int, dict] = field(default_factory=dict)  # layer -> KV format annotation
    metadata: dict = field(default_factory=dict)  # what passes record for the artifact (e.g. sensitivity)
    # the embedding table as it will be stored when a pass quantized it (passes/embedding_quant.py); its
    # dequantized values are `tensors[embedding]`, which a tied lm_head reads
    embedding_quant: QuantizedWeight | None = None

    def __post_init__(self):
        if not isinstance(self.tensors, TensorStore):
            self.tensors = TensorStore(overlay=self.tensors)
        if not self.linears:
            self.linears = {ls.name: _linear(ls, self.tensors.spill) for ls in self.spec.linears()}

    # --- views ----------------------------------------------------------------------------------------------
    @property
    def model_type(self) -> str:
        return self.spec.model_type

    @property
    def blocks(self) -> tuple[LayerSpec, ...]:
        return self.spec.layers

    @property
    def embedding(self) -> str:
        return self.spec.embedding

    @property
    def final_norm(self) -> str:
        return self.spec.final_norm

    @property
    def tied_embeddings(self) -> bool:
        return self.spec.tie_word_embeddings

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
    def set_spec(self, spec: ModelSpec) -> None:
        """Adopt a rewritten structure. Linears the new spec keeps (same name and shape) keep their
        annotations; new ones start in source precision; removed ones go. The caller has put the new
        linears' tensors in `tensors` (and may drop the removed ones'): every tensor the spec names must be
        there, or this raises ValueError naming the first missing one."""
        linears = {}
        for ls in spec.linears():
            old = self.linears.get(ls.name)
            same = old is not None and (old.role, old.in_features, old.out_features) == (ls.role, ls.in_features,
                                                                                           ls.out_features)
            linears[ls.name] = old if same else _linear(ls, self.tensors.spill)
        missing = sorted(n for n in spec.tensor_names() if n not in self.tensors and not (
            n == "lm_head.weight" and linears["lm_head"].tied_to))
        if missing:
            raise ValueError(f"the rewritten spec names tensor {missing[0]} ({len(missing)} missing), which the "
                             "graph does not hold")
        self.spec = spec
        self.linears = linears

    def replace_layer(self, layer: LayerSpec) -> None:
        """`set_spec` with one layer replaced (by its index)."""
        layers = list(self.spec.layers)
        layers[layer.index] = layer
        self.set_spec(dataclasses.replace(self.spec, layers=tuple(layers)))

    def snapshot(self) -> dict:
        """Everything a pass may change, by reference (specs and tensors are never mutated in place)."""
        return {
            "spec": self.spec,
            "linears": {name: copy.copy(lin) for name, lin in self.linears.items()},
            "tensors": self.tensors.copy(),
            "kv_cache": copy.deepcopy(self.kv_cache),
            "metadata": copy.copy(self.metadata),
            "embedding_quant": self.embedding_quant,
        }

    def copy_of(self, state: dict) -> ModelGraph:
        """A separate graph holding `state` (a snapshot): e.g. the graph as a pass found it, to compare with."""
        other = copy.copy(self)
        other.restore(state)
        return other

    def restore(self, state: dict) -> None:
        self.spec = state["spec"]
        self.linears = {name: copy.copy(lin) for name, lin in state["linears"].items()}
        self.tensors = state["tensors"].copy()
        self.kv_cache = copy.deepcopy(state["kv_cache"])
        self.metadata = copy.copy(state["metadata"])
        self.embedding_quant = state["embedding_quant"]


def _linear(ls, spill: SpillFile | None) -> Linear:
    return Linear(ls.name, ls.role, ls.in_features, ls.out_features, ls.layer, ls.expert, ls.proj, ls.bias,
                  spill=spill)
