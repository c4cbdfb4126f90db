"""Tiny random checkpoints of every supported architecture, built offline from transformers configs."""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 160, "max_position_embeddings": 256}

TINY_CONFIGS: dict[str, dict] = {
    "llama": dict(COMMON),
    "mistral": dict(COMMON),
    "qwen2": dict(COMMON),
    "qwen3": dict(COMMON, head_dim=32),
    "mixtral": dict(COMMON, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(COMMON, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4,
                      num_experts_per_tok=2),
    "qwen3_moe": dict(COMMON, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, head_dim=16),
    "deepseek_v3": dict(COMMON, num_hidden_layers=3, num_key_value_heads=4, moe_intermediate_size=32,
                        first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                        n_group=2, topk_group=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                        qk_nope_head_dim=16, v_head_dim=16),
    # one KV head, as Gemma 3 270M; a window of 8 so that 12-token tests reach past it; a score scalar that is
    # not the head dim
    "gemma3_text": dict(COMMON, num_key_value_heads=1, head_dim=32, sliding_window=8, query_pre_attn_scalar=24,
                        layer_types=["sliding_attention", "full_attention"]),
}


def make_tiny_checkpoint(model_type: str, path: Path, seed: int = 0, overrides: dict | None = None) -> Path:
    """Save a random tiny model of `model_type` (safetensors) to `path` and return it; `overrides` replace
    config entries (e.g. vocab_size to match a tokenizer)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **{**TINY_CONFIGS[model_type], **(overrides or {})})
    model = AutoModelForCausalLM.from_config(config)
    if model_type == "deepseek_v3":
        # random router biases so group-limited routing is exercised
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.1)
    if model_type == "gemma3_text":
        # Gemma initialises its (1 + w) norm weights to 0: random ones so the offset is exercised
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.data.copy_(torch.randn_like(param) * 0.2)
    model.save_pretrained(path)
    return path
