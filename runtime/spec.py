"""ModelSpec: the one structural description of a model, which passes rewrite and the runtime executes.

Per layer: attention (MHA/GQA/MLA, with its own rotary embedding and softmax scale), MLP (dense or MoE),
norms; plus extra modules (DeepSeek MTP layers, draft heads). A model whose layers mix GQA and MLA is a
legal spec. The artifact's manifest carries it as JSON (`ModelSpec.to_json`, `spec_from_json`), so what
the runtime builds is what the passes left, not what the source checkpoint's config said.
`optimizer.loader_config` builds the spec of a Hugging Face checkpoint, once, when it is loaded.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kiln.kernels.errors import KilnError


@dataclass(frozen=True)
class LinearSpec:
    """One linear layer: its module path (tensor `<name>.weight`), role and shape."""

    name: str
    role: str  # q, k, v, o, q_a, q_b, kv_a, kv_b, gate, up, down, expert, router, lm_head; fused: qkv, gate_up
    in_features: int
    out_features: int
    layer: int | None = None  # None for lm_head
    expert: int | None = None  # routed expert index
    proj: str | None = None  # for experts and shared experts: gate, up or down
    bias: bool = False
    # a fused linear (role "qkv" or "gate_up", passes/fuse.py): the linears it replaced, in the order of its
    # output rows; the runtime runs one GEMM and splits the output, exports write the parts back
    parts: tuple[LinearSpec, ...] = ()


@dataclass(frozen=True)
class RotarySpec:
    """A layer's rotary embedding, resolved: the inverse frequencies of its `dim` rotated dimensions (float32
    values, whatever RoPE scaling the checkpoint asked for) and the scale transformers applies to cos/sin."""

    dim: int
    inv_freq: tuple[float, ...]
    attention_scaling: float = 1.0
    interleaved: bool = False  # DeepSeek: rotate pairs (x0, x1), (x2, x3), ...


@dataclass(frozen=True)
class AttentionSpec:
    kind: str  # "mha", "gqa" or "mla"
    num_heads: int
    num_kv_heads: int
    head_dim: int  # q/k head dim (for MLA: nope + rope)
    v_head_dim: int
    linears: dict[str, LinearSpec]  # keyed by role
    rotary: RotarySpec
    softmax_scale: float
    qk_norm: bool = False  # Qwen3: RMSNorm on each q/k head
    sliding_window: int | None = None
    # MLA only
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0

    def kv_streams(self) -> tuple[tuple[str, int, int], ...]:
        """(name, heads, dim) of each stream a layer caches, in the order the model passes them."""
        if self.kind == "mla":
            return (("latent", 1, self.kv_lora_rank), ("k_rope", 1, self.qk_rope_head_dim))
        return (("k", self.num_kv_heads, self.head_dim), ("v", self.num_kv_heads, self.v_head_dim))


@dataclass(frozen=True)
class MlpSpec:
    kind: str  # "dense" or "moe"
    intermediate_size: int
    linears: dict[str, LinearSpec]  # dense: gate/up/down; moe: router (+ shared gate/up/down)
    experts: tuple[dict[str, LinearSpec], ...] = ()  # each: gate/up/down
    top_k: int = 0
    routing: str = ""  # "softmax_topk" (Mixtral/Qwen) or "sigmoid_group_topk" (DeepSeek-V3)
    norm_topk_prob: bool = False
    shared_expert_gate: str | None = None  # Qwen2-MoE: sigmoid gate on the shared expert
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    score_correction_bias: str | None = None  # DeepSeek-V3 e_score_correction_bias tensor
    num_shared_experts: int = 0

    @property
    def num_experts(self) -> int:
        return len(self.experts)


KERNEL_FUSIONS = ("rmsnorm_quant", "swiglu_quant", "rope_kv_write")


@dataclass(frozen=True)
class KernelFusion:
    """Operations of a layer that a GPU runtime launches as one kernel (recorded by passes/fuse.py). Weights do
    not change; the CPU reference runtime runs the operations one after another, which is equal by construction.

        rmsnorm_quant   ops (norm weight, linear): the norm's output quantized to the linear's activation format
        swiglu_quant    ops (gate/up linear(s)..., down linear): silu(gate) * up quantized to down's activation format
        rope_kv_write   ops (the linear(s) producing q, k, v): RoPE on q and k, then k and v written to the KV cache
                        in the layer's cache format
    """

    kind: str  # one of KERNEL_FUSIONS
    ops: tuple[str, ...]


@dataclass(frozen=True)
class LayerSpec:
    index: int
    prefix: str
    attention: AttentionSpec
    mlp: MlpSpec
    norms: tuple[str, ...]  # tensor names of the layer's norm weights: input, post-attention, then q/k/latent
    fusions: tuple[KernelFusion, ...] = ()  # kernel-level fusions a GPU runtime applies (passes/fuse.py)

    def linears(self) -> list[LinearSpec]:
        out = [*self.attention.linears.values(), *self.mlp.linears.values()]
        for expert in self.mlp.experts:
            out.extend(expert.values())
        return out


@dataclass(frozen=True)
class ExtraModuleSpec:
    """A module the spec carries beside the decoder stack, which plain next-token decoding does not run: a
    DeepSeek multi-token-prediction layer (`num_nextn_predict_layers`) or a draft head a pass attaches.
    Speculative decoding (not yet in the runtime) runs them; the artifact stores their tensors."""

    kind: str  # "mtp", "draft_head" (MTP-shaped) or "eagle3"
    name: str  # module prefix, e.g. "model.layers.61"
    layer: LayerSpec | None  # the decoder layer it holds
    linears: dict[str, LinearSpec]  # its own linears beyond the layer's (e.g. eh_proj, head)
    norms: tuple[str, ...]  # e.g. enorm, hnorm, the head's norm
    tensors: tuple[str, ...] = ()  # any other tensor it holds (DeepSeek MTP: its copy of the embedding)
    # EAGLE-3: the target layers whose outputs (before the final norm) it reads, concatenated, in this order
    aux_layers: tuple[int, ...] = ()


@dataclass(frozen=True)
class ModelSpec:
    """The one structural description of a model: the loader builds it from the HF config once, passes rewrite
    it, the artifact's manifest carries it ("architecture"), and the runtime executes what it says."""

    model_type: str
    vocab_size: int
    hidden_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    embedding: str
    final_norm: str
    lm_head: LinearSpec
    layers: tuple[LayerSpec, ...]
    max_position_embeddings: int
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    extra_modules: tuple[ExtraModuleSpec, ...] = ()

    def lm_head_tied(self, tensor_names) -> bool:
        """The lm_head reads the embedding: the config ties them and no separate lm_head weight is stored
        (`tensor_names`: the names of a checkpoint's or an artifact's tensors)."""
        return self.tie_word_embeddings and "lm_head.weight" not in tensor_names

    def linears(self) -> list[LinearSpec]:
        """The linears decoding runs, in model order: each layer's, then lm_head."""
        return [lin for layer in self.layers for lin in layer.linears()] + [self.lm_head]

    def extra_linears(self) -> list[LinearSpec]:
        """The extra modules' linears (MTP layers, draft heads)."""
        out: list[LinearSpec] = []
        for module in self.extra_modules:
            out.extend(module.layer.linears() if module.layer is not None else ())
            out.extend(module.linears.values())
        return out

    def norms(self) -> dict[str, int]:
        """Every RMSNorm weight the decoder stack uses -> its length: the hidden size; the head dim for Qwen3's
        per-head q/k norms; the latent ranks for MLA's q_a/kv_a norms."""
        sizes = {self.final_norm: self.hidden_size}
        for layer in self.layers:
            a = layer.attention
            per_name = {"q_norm": a.head_dim, "k_norm": a.head_dim, "kv_a_layernorm": a.kv_lora_rank,
                        "q_a_layernorm": a.q_lora_rank}
            for name in layer.norms:
                sizes[name] = per_name.get(name.split(".")[-2], self.hidden_size)
        return sizes

    def tensor_names(self) -> set[str]:
        """Every tensor name the spec refers to, extra modules included."""
        names = {self.embedding, *self.norms()}
        for lin in (*self.linears(), *self.extra_linears()):
            names.add(f"{lin.name}.weight")
            if lin.bias:
                names.add(f"{lin.name}.bias")
        for layer in (*self.layers, *(m.layer for m in self.extra_modules if m.layer is not None)):
            names.update(layer.norms)
            if layer.mlp.score_correction_bias:
                names.add(layer.mlp.score_correction_bias)
        for module in self.extra_modules:
            names.update((*module.norms, *module.tensors))
        return names

    def to_json(self) -> dict:
        """The spec as JSON data (the manifest's "architecture"); `spec_from_json` reads it back equal."""
        return asdict(self)


def _linear_from_json(d: dict) -> LinearSpec:
    return LinearSpec(**{**d, "parts": tuple(_linear_from_json(p) for p in d.get("parts", ()))})


def _fusion_from_json(d: dict) -> KernelFusion:
    if d["kind"] not in KERNEL_FUSIONS:
        raise KilnError(f"malformed architecture in the manifest: unknown kernel fusion {str(d['kind'])[:40]!r}; "
                        f"known: {', '.join(KERNEL_FUSIONS)}")
    return KernelFusion(d["kind"], tuple(d["ops"]))


def _linears_from_json(d: dict) -> dict[str, LinearSpec]:
    return {role: _linear_from_json(lin) for role, lin in d.items()}


def _layer_from_json(d: dict) -> LayerSpec:
    a, m = d["attention"], d["mlp"]
    rotary = RotarySpec(**{**a["rotary"], "inv_freq": tuple(a["rotary"]["inv_freq"])})
    attention = AttentionSpec(**{**a, "linears": _linears_from_json(a["linears"]), "rotary": rotary})
    mlp = MlpSpec(**{**m, "linears": _linears_from_json(m["linears"]),
                     "experts": tuple(_linears_from_json(e) for e in m["experts"])})
    return LayerSpec(d["index"], d["prefix"], attention, mlp, tuple(d["norms"]),
                     tuple(_fusion_from_json(f) for f in d.get("fusions", ())))


def spec_from_json(data: dict) -> ModelSpec:
    """A ModelSpec from `ModelSpec.to_json()` output; malformed data is a one-line KilnError."""
    try:
        extras = tuple(ExtraModuleSpec(e["kind"], e["name"],
                                       _layer_from_json(e["layer"]) if e["layer"] is not None else None,
                                       _linears_from_json(e["linears"]), tuple(e["norms"]), tuple(e["tensors"]),
                                       tuple(e.get("aux_layers", ())))
                       for e in data["extra_modules"])
        return ModelSpec(**{**data, "lm_head": _linear_from_json(data["lm_head"]),
                            "layers": tuple(_layer_from_json(layer) for layer in data["layers"]),
                            "eos_token_ids": tuple(data["eos_token_ids"]), "extra_modules": extras})
    except (KeyError, TypeError, AttributeError) as exc:
        raise KilnError(f"malformed architecture in the manifest: {type(exc).__name__}: {exc}"[:300]) from None
