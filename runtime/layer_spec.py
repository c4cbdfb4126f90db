"""What a decoder layer of a ModelSpec is made of: its linears, rotary embedding, attention, MLP, kernel
fusions, and the extra modules (MTP layers, draft heads) a spec carries beside the stack.

    from kiln.runtime.spec import AttentionSpec, LayerSpec, LinearSpec   # runtime.spec exports them all
    layer.attention.kv_streams()            # (("k", 8, 64), ("v", 8, 64)) or MLA's latent and k_rope
    [lin.name for lin in layer.linears()]   # attention's, the MLP's, then every expert's

The classes are plain frozen dataclasses; runtime.spec puts them together (ModelSpec), reads them from JSON
and checks them.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    activation: str = "silu"  # of the gate: "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU, tanh-approximated GELU)

    @property
    def num_experts(self) -> int:
        return len(self.experts)


ACTIVATIONS = ("silu", "gelu_tanh")
"""The gate activations of a gated MLP the runtime runs (MlpSpec.activation)."""

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
    # Gemma's "sandwich" norms: on the attention's and the MLP's outputs, before each residual add (then norms[1]
    # is the pre-feedforward norm, the MLP's input norm as in every other family)
    output_norms: tuple[str, ...] = ()

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
    # EAGLE-3 with a draft vocabulary: the int64 tensor of d2t offsets (draft id i drafts target id i + d2t[i]),
    # which its own lm_head [draft vocab, hidden] scores; None: its head scores the whole vocabulary
    draft_vocab: str | None = None
    # a draft module's tokens verified per depth when it drafts greedily (1: a chain; the draft-head pass records
    # the width its gate measured); None: not recorded (artifacts built before the spec carried it)
    tree_width: int | None = None


def norm_size(name: str, attention: AttentionSpec | None, hidden: int) -> int:
    """The length of RMSNorm weight `name` (its module name decides) in a layer with `attention`: the head dim for
    Qwen3's and Gemma's per-head q/k norms, the latent ranks for MLA's q_a/kv_a norms, else the hidden size."""
    if attention is None:
        return hidden
    size = {"q_norm": attention.head_dim, "k_norm": attention.head_dim, "kv_a_layernorm": attention.kv_lora_rank,
            "q_a_layernorm": attention.q_lora_rank}.get(name.split(".")[-2])
    return hidden if size is None else size
