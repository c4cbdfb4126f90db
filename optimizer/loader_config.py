"""The loader's map from a Hugging Face config.json to a `runtime.spec.ModelSpec`: the one place that knows
each supported architecture's layout and tensor names. Called once per checkpoint by `optimizer.loader`;
after loading, everything works from the spec.

Defaults come from transformers' own config classes (`AutoConfig.for_model`), so a config.json that leaves
a field out means what it means to transformers.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection

from kiln.kernels.errors import KilnError
from kiln.runtime.spec import (
    AttentionSpec,
    ExtraModuleSpec,
    LayerSpec,
    LinearSpec,
    MlpSpec,
    ModelSpec,
    RotarySpec,
)

SUPPORTED_ARCHITECTURES = (
    "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gemma3_text",
)
GELU_TANH_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_new")
"""Gemma's hidden_activation values that are the tanh-approximated GELU the runtime runs."""


# Integer config.json fields that size tensors or loops: name -> (smallest valid value, null allowed).
# Checked before transformers sees them: its strict dataclasses raise multi-line errors, and a huge or
# negative count would make it (or the spec) loop or allocate without end.
INT_FIELDS = {
    "num_hidden_layers": (1, False), "hidden_size": (1, False), "intermediate_size": (1, False),
    "vocab_size": (1, False), "num_attention_heads": (1, False), "num_key_value_heads": (1, True),
    "head_dim": (1, True), "max_position_embeddings": (1, False), "sliding_window": (0, True),  # 0: no window
    "num_local_experts": (1, False), "num_experts": (0, False), "n_routed_experts": (1, True),
    "num_experts_per_tok": (1, False), "moe_intermediate_size": (1, False),
    "shared_expert_intermediate_size": (0, True), "n_shared_experts": (0, True), "decoder_sparse_step": (1, False),
    "first_k_dense_replace": (0, False), "moe_layer_freq": (1, False), "n_group": (1, True),
    "topk_group": (1, True), "q_lora_rank": (1, True), "kv_lora_rank": (1, False), "qk_rope_head_dim": (1, False),
    "qk_nope_head_dim": (1, False), "v_head_dim": (1, False), "num_nextn_predict_layers": (0, True),
}
POSITIVE_FLOAT_FIELDS = ("rms_norm_eps", "rope_theta", "routed_scaling_factor", "query_pre_attn_scalar")
LAYER_TYPES = ("full_attention", "sliding_attention")


def _show(value: object) -> str:
    """A config value as the user wrote it, briefly: 'five', 1.5, null, true."""
    text = json.dumps(value) if value is None or isinstance(value, bool) else repr(value)
    return text if len(text) <= 40 else text[:39] + "…"


def check_config(config_dict: dict) -> None:
    """Refuse a config.json whose architecture is unsupported or whose fields are of the wrong type, out of
    range or inconsistent, with a one-line KilnError; fields left out keep transformers' defaults."""
    model_type = config_dict.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise KilnError(
            f"unsupported architecture {_show(model_type)}; Kiln supports {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    c = config_dict
    for name, (low, nullable) in INT_FIELDS.items():
        if name not in c or (nullable and c[name] is None):
            continue
        value = c[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            kind = "a positive integer" if low else "a non-negative integer"
            raise KilnError(f"config.json: {name} must be {kind}{' or null' if nullable else ''}, got {_show(value)}")
    for name in POSITIVE_FLOAT_FIELDS:
        value = c.get(name, 1.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
            raise KilnError(f"config.json: {name} must be a positive number, got {_show(value)}")
    if model_type == "gemma3_text":
        _check_gemma3(c)
    heads, kv_heads, hidden = c.get("num_attention_heads"), c.get("num_key_value_heads"), c.get("hidden_size")
    if model_type != "deepseek_v3":  # MLA sizes heads by its own qk/v dims
        if heads and hidden and c.get("head_dim") is None and hidden % heads:
            raise KilnError(f"config.json: hidden_size {hidden} is not divisible by num_attention_heads {heads} "
                            "(and no head_dim is given)")
        if heads and kv_heads and heads % kv_heads:
            raise KilnError(f"config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads "
                            f"{kv_heads}")
    experts = c.get({"mixtral": "num_local_experts", "deepseek_v3": "n_routed_experts"}.get(model_type, "num_experts"))
    top_k = c.get("num_experts_per_tok")
    if experts and top_k and top_k > experts:
        raise KilnError(f"config.json: num_experts_per_tok {top_k} exceeds the {experts} experts")
    if model_type == "deepseek_v3" and experts and c.get("n_group"):
        groups, topk_group = c["n_group"], c.get("topk_group") or 1
        if experts % groups or topk_group > groups:
            raise KilnError(f"config.json: {experts} routed experts do not split into n_group {groups} groups of "
                            f"which topk_group {topk_group} are chosen")
    layer_types = c.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list):
            raise KilnError(f"config.json: layer_types must be a list, got {_show(layer_types)}")
        unknown = [t for t in layer_types if t not in LAYER_TYPES]
        if unknown:
            raise KilnError(f"config.json: layer_types entry {_show(unknown[0])} is not one of "
                            f"{', '.join(LAYER_TYPES)}")
        layers = c.get("num_hidden_layers")
        if layers is not None and len(layer_types) != layers:
            raise KilnError(f"config.json: layer_types has {len(layer_types)} entries but num_hidden_layers is "
                            f"{layers}")


def _check_gemma3(c: dict) -> None:
    """What of Gemma 3's config the runtime does not run, refused by name."""
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if c.get(name) is not None:
            raise KilnError(f"config.json: {name} {_show(c[name])} is not supported (Gemma 3 sets it null; "
                            "logit soft-capping is Gemma 2's)")
    if c.get("use_bidirectional_attention"):
        raise KilnError("config.json: use_bidirectional_attention is true (an embedding model); Kiln runs causal "
                        "language models")
    act = c.get("hidden_activation", GELU_TANH_ACTIVATIONS[0])
    if act not in GELU_TANH_ACTIVATIONS:
        raise KilnError(f"config.json: hidden_activation {_show(act)} is not supported; Gemma 3's is "
                        f"{' or '.join(GELU_TANH_ACTIVATIONS)}")


def load_hf_config(config_dict: dict, trust_remote_code: bool = False):
    """A transformers config object for a supported model type, or a one-line KilnError."""
    check_config(config_dict)
    # lazy: transformers takes seconds to import; a config-only reader (optimize report) never gets here
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    model_type = config_dict["model_type"]
    kwargs = {k: v for k, v in config_dict.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(model_type, **kwargs)
    except (ValueError, TypeError, KeyError, StrictDataclassError) as exc:
        # strict-dataclass messages span lines ("Validation error for field 'x':\n    TypeError: ...")
        raise KilnError(" ".join(f"invalid {model_type} config.json: {exc}".split())) from None


def _lin(name, role, fin, fout, layer=None, expert=None, proj=None, bias=False) -> LinearSpec:
    return LinearSpec(name, role, int(fin), int(fout), layer, expert, proj, bias)


def _dense_mlp(prefix: str, i: int, hidden: int, inter: int, names=("gate_proj", "up_proj", "down_proj"),
               bias: bool = False) -> dict[str, LinearSpec]:
    g, u, d = names
    return {
        "gate": _lin(f"{prefix}.{g}", "gate", hidden, inter, i, proj="gate", bias=bias),
        "up": _lin(f"{prefix}.{u}", "up", hidden, inter, i, proj="up", bias=bias),
        "down": _lin(f"{prefix}.{d}", "down", inter, hidden, i, proj="down", bias=bias),
    }


def _experts(prefix: str, i: int, n: int, hidden: int, inter: int, names) -> tuple[dict[str, LinearSpec], ...]:
    g, u, d = names
    return tuple(
        {
            "gate": _lin(f"{prefix}.{e}.{g}", "expert", hidden, inter, i, e, "gate"),
            "up": _lin(f"{prefix}.{e}.{u}", "expert", hidden, inter, i, e, "up"),
            "down": _lin(f"{prefix}.{e}.{d}", "expert", inter, hidden, i, e, "down"),
        }
        for e in range(n)
    )


def _rotary(cfg, dim: int, interleaved: bool = False, layer_type: str | None = None) -> RotarySpec:
    """The rotary embedding a transformers config asks for, resolved to inverse frequencies (non-default RoPE
    types through transformers' own init functions, so scaled RoPE means what it means there). Gemma 3 gives
    each layer type its own parameters (`rope_parameters[layer_type]`: 10K local, 1M global)."""
    import torch  # lazy: this module checks config.json without torch (optimize report on a config)

    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    per_type = layer_type is not None and isinstance(rope.get(layer_type), dict)
    if per_type:
        rope = dict(rope[layer_type])
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":
        base = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        scaling = 1.0
    else:
        from transformers.modeling_rope_utils import (
            ROPE_INIT_FUNCTIONS,  # lazy: transformers is slow to import
        )

        if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
            raise KilnError(f"RoPE type {rope_type!r} is not supported (its frequencies depend on the sequence "
                            "length)" if rope_type == "dynamic" else f"unknown RoPE type {rope_type!r}")
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, None, **({"layer_type": layer_type} if per_type
                                                                          else {}))
    if inv_freq.numel() * 2 != dim:
        raise KilnError(f"RoPE: {inv_freq.numel()} frequencies for {dim} rotated dimensions")
    return RotarySpec(dim, tuple(float(f) for f in inv_freq.float()), float(scaling), interleaved)


def _mla_softmax_scale(cfg, qk_head_dim: int) -> float:
    # DeepSeek-V3 with YaRN scales the softmax by mscale^2 (transformers' DeepseekV3Attention)
    scale = qk_head_dim**-0.5
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        factor = float(rope["factor"])
        mscale = 0.1 * float(rope["mscale_all_dim"]) * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return scale


def _gqa_attention(cfg, prefix: str, i: int, qk_norm: bool) -> AttentionSpec:
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    bias = bool(getattr(cfg, "attention_bias", False)) or cfg.model_type in ("qwen2", "qwen2_moe")
    hidden = cfg.hidden_size
    window = None
    layer_types = getattr(cfg, "layer_types", None)
    if getattr(cfg, "sliding_window", None) and (layer_types is None or layer_types[i] == "sliding_attention"):
        window = int(cfg.sliding_window)
    # Gemma scales scores by query_pre_attn_scalar^-0.5 (its head_dim in every released size but 27B: 168 of 128)
    scalar = getattr(cfg, "query_pre_attn_scalar", None) if cfg.model_type == "gemma3_text" else None
    return AttentionSpec(
        kind="mha" if kv_heads == heads else "gqa",
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        v_head_dim=head_dim,
        linears={
            "q": _lin(f"{prefix}.q_proj", "q", hidden, heads * head_dim, i, bias=bias),
            "k": _lin(f"{prefix}.k_proj", "k", hidden, kv_heads * head_dim, i, bias=bias),
            "v": _lin(f"{prefix}.v_proj", "v", hidden, kv_heads * head_dim, i, bias=bias),
            "o": _lin(f"{prefix}.o_proj", "o", heads * head_dim, hidden, i,
                      bias=bool(getattr(cfg, "attention_bias", False)) and cfg.model_type not in ("qwen2", "qwen2_moe")),
        },
        rotary=_rotary(cfg, head_dim, layer_type=layer_types[i] if layer_types is not None else None),
        softmax_scale=float(scalar) ** -0.5 if scalar else head_dim**-0.5,
        qk_norm=qk_norm,
        sliding_window=window,
    )


def _mla_attention(cfg, prefix: str, i: int) -> AttentionSpec:
    heads = cfg.num_attention_heads
    hidden = cfg.hidden_size
    nope, rope, v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    qk_dim = nope + rope
    linears = {}
    if cfg.q_lora_rank is None:
        linears["q"] = _lin(f"{prefix}.q_proj", "q", hidden, heads * qk_dim, i)
    else:
        linears["q_a"] = _lin(f"{prefix}.q_a_proj", "q_a", hidden, cfg.q_lora_rank, i, bias=cfg.attention_bias)
        linears["q_b"] = _lin(f"{prefix}.q_b_proj", "q_b", cfg.q_lora_rank, heads * qk_dim, i)
    linears["kv_a"] = _lin(f"{prefix}.kv_a_proj_with_mqa", "kv_a", hidden, cfg.kv_lora_rank + rope, i,
                           bias=cfg.attention_bias)
    linears["kv_b"] = _lin(f"{prefix}.kv_b_proj", "kv_b", cfg.kv_lora_rank, heads * (nope + v_dim), i)
    linears["o"] = _lin(f"{prefix}.o_proj", "o", heads * v_dim, hidden, i, bias=cfg.attention_bias)
    return AttentionSpec(
        kind="mla",
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=qk_dim,
        v_head_dim=v_dim,
        linears=linears,
        rotary=_rotary(cfg, rope, bool(getattr(cfg, "rope_interleave", True))),
        softmax_scale=_mla_softmax_scale(cfg, qk_dim),
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_rope_head_dim=rope,
        qk_nope_head_dim=nope,
    )


def _mlp(cfg, prefix: str, i: int) -> MlpSpec:
    mt = cfg.model_type
    hidden = cfg.hidden_size
    if mt in ("llama", "mistral", "qwen2", "qwen3"):
        bias = bool(getattr(cfg, "mlp_bias", False))
        return MlpSpec("dense", cfg.intermediate_size, _dense_mlp(f"{prefix}.mlp", i, hidden, cfg.intermediate_size,
                                                                  bias=bias))
    if mt == "gemma3_text":  # GeGLU (hidden_activation checked by _check_gemma3)
        return MlpSpec("dense", cfg.intermediate_size, _dense_mlp(f"{prefix}.mlp", i, hidden, cfg.intermediate_size),
                       activation="gelu_tanh")
    if mt == "mixtral":
        p = f"{prefix}.block_sparse_moe"
        n = cfg.num_local_experts
        return MlpSpec(
            "moe", cfg.intermediate_size,
            {"router": _lin(f"{p}.gate", "router", hidden, n, i)},
            _experts(f"{p}.experts", i, n, hidden, cfg.intermediate_size, ("w1", "w3", "w2")),
            top_k=cfg.num_experts_per_tok, routing="softmax_topk", norm_topk_prob=True,
        )
    if mt in ("qwen2_moe", "qwen3_moe"):
        sparse = (
            i not in (getattr(cfg, "mlp_only_layers", None) or [])
            and cfg.num_experts > 0
            and (i + 1) % getattr(cfg, "decoder_sparse_step", 1) == 0
        )
        if not sparse:
            return MlpSpec("dense", cfg.intermediate_size,
                           _dense_mlp(f"{prefix}.mlp", i, hidden, cfg.intermediate_size))
        p = f"{prefix}.mlp"
        linears = {"router": _lin(f"{p}.gate", "router", hidden, cfg.num_experts, i)}
        shared_gate = None
        if mt == "qwen2_moe" and cfg.shared_expert_intermediate_size:
            linears.update({f"shared_{k}": v for k, v in _dense_mlp(
                f"{p}.shared_expert", i, hidden, cfg.shared_expert_intermediate_size).items()})
            shared_gate = f"{p}.shared_expert_gate"
            linears["shared_gate_router"] = _lin(shared_gate, "router", hidden, 1, i)
        return MlpSpec(
            "moe", cfg.moe_intermediate_size, linears,
            _experts(f"{p}.experts", i, cfg.num_experts, hidden, cfg.moe_intermediate_size,
                     ("gate_proj", "up_proj", "down_proj")),
            top_k=cfg.num_experts_per_tok, routing="softmax_topk", norm_topk_prob=bool(cfg.norm_topk_prob),
            shared_expert_gate=shared_gate, num_shared_experts=1 if shared_gate else 0,
        )
    if mt == "deepseek_v3":
        moe = (cfg.n_routed_experts is not None and i >= cfg.first_k_dense_replace
               and i % getattr(cfg, "moe_layer_freq", 1) == 0)
        if not moe:
            return MlpSpec("dense", cfg.intermediate_size,
                           _dense_mlp(f"{prefix}.mlp", i, hidden, cfg.intermediate_size))
        p = f"{prefix}.mlp"
        linears = {"router": _lin(f"{p}.gate", "router", hidden, cfg.n_routed_experts, i)}
        if cfg.n_shared_experts:
            linears.update({f"shared_{k}": v for k, v in _dense_mlp(
                f"{p}.shared_experts", i, hidden, cfg.moe_intermediate_size * cfg.n_shared_experts).items()})
        return MlpSpec(
            "moe", cfg.moe_intermediate_size, linears,
            _experts(f"{p}.experts", i, cfg.n_routed_experts, hidden, cfg.moe_intermediate_size,
                     ("gate_proj", "up_proj", "down_proj")),
            top_k=cfg.num_experts_per_tok, routing="sigmoid_group_topk", norm_topk_prob=bool(cfg.norm_topk_prob),
            routed_scaling_factor=float(cfg.routed_scaling_factor), n_group=cfg.n_group or 1,
            topk_group=cfg.topk_group or 1, score_correction_bias=f"{p}.gate.e_score_correction_bias",
            num_shared_experts=int(cfg.n_shared_experts or 0),
        )
    raise KilnError(f"unsupported architecture {mt!r}")  # unreachable: load_hf_config checked


def _decoder_layer(cfg, i: int) -> LayerSpec:
    prefix = f"model.layers.{i}"
    attn_prefix = f"{prefix}.self_attn"
    if cfg.model_type == "deepseek_v3":
        attention = _mla_attention(cfg, attn_prefix, i)
        norms = [f"{attn_prefix}.kv_a_layernorm.weight"]
        if cfg.q_lora_rank is not None:
            norms.append(f"{attn_prefix}.q_a_layernorm.weight")
    else:
        qk_norm = cfg.model_type in ("qwen3", "qwen3_moe", "gemma3_text")
        attention = _gqa_attention(cfg, attn_prefix, i, qk_norm)
        norms = [f"{attn_prefix}.q_norm.weight", f"{attn_prefix}.k_norm.weight"] if qk_norm else []
    if cfg.model_type == "gemma3_text":  # sandwich norms: the MLP's input norm is pre_feedforward_layernorm
        mlp_norm = f"{prefix}.pre_feedforward_layernorm.weight"
        output_norms = (f"{prefix}.post_attention_layernorm.weight", f"{prefix}.post_feedforward_layernorm.weight")
    else:
        mlp_norm, output_norms = f"{prefix}.post_attention_layernorm.weight", ()
    norms = [f"{prefix}.input_layernorm.weight", mlp_norm, *norms]
    return LayerSpec(i, prefix, attention, _mlp(cfg, prefix, i), tuple(norms), output_norms=output_norms)


def _mtp_modules(cfg, tensor_names: Collection[str]) -> tuple[ExtraModuleSpec, ...]:
    """DeepSeek-V3's multi-token-prediction layers, as its official checkpoint stores them after the decoder
    stack: a decoder layer plus enorm/hnorm, eh_proj [hidden, 2 hidden] and a shared head (norm + lm_head)."""
    modules = []
    for j in range(int(getattr(cfg, "num_nextn_predict_layers", 0) or 0)):
        i = cfg.num_hidden_layers + j
        p = f"model.layers.{i}"
        if f"{p}.eh_proj.weight" not in tensor_names:
            continue  # a checkpoint saved without its MTP weights (e.g. by transformers)
        linears = {"eh_proj": _lin(f"{p}.eh_proj", "mtp_proj", 2 * cfg.hidden_size, cfg.hidden_size, i)}
        if f"{p}.shared_head.head.weight" in tensor_names:
            linears["head"] = _lin(f"{p}.shared_head.head", "mtp_head", cfg.hidden_size, cfg.vocab_size, i)
        others = tuple(n for n in (f"{p}.embed_tokens.weight",) if n in tensor_names)
        modules.append(ExtraModuleSpec("mtp", p, _decoder_layer(cfg, i), linears,
                                       (f"{p}.enorm.weight", f"{p}.hnorm.weight", f"{p}.shared_head.norm.weight"),
                                       others))
    return tuple(modules)


def build_spec(config_dict: dict, trust_remote_code: bool = False,
               tensor_names: Collection[str] = ()) -> ModelSpec:
    """The spec of a Hugging Face config (`tensor_names`: the checkpoint's, to find optional modules)."""
    cfg = load_hf_config(config_dict, trust_remote_code)
    eos = cfg.eos_token_id if hasattr(cfg, "eos_token_id") else None
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    gemma = cfg.model_type == "gemma3_text"  # (1 + w) norms, embeddings scaled by sqrt(hidden)
    return ModelSpec(
        model_type=cfg.model_type,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        rms_norm_eps=float(cfg.rms_norm_eps),
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        embedding="model.embed_tokens.weight",
        final_norm="model.norm.weight",
        lm_head=_lin("lm_head", "lm_head", cfg.hidden_size, cfg.vocab_size),
        layers=tuple(_decoder_layer(cfg, i) for i in range(cfg.num_hidden_layers)),
        max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 2048)),
        bos_token_id=getattr(cfg, "bos_token_id", None),
        eos_token_ids=eos_ids,
        extra_modules=_mtp_modules(cfg, set(tensor_names)) if cfg.model_type == "deepseek_v3" else (),
        norm_offset=1.0 if gemma else 0.0,
        embedding_scale=float(cfg.hidden_size) ** 0.5 if gemma else 1.0,
    )
