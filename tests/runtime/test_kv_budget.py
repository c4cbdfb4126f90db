"""KV bytes per token and concurrency against known figures, on configs built on the meta device (no weights)."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels.targets import B200, H100, H200
from kiln.optimizer.loader_config import build_spec
from kiln.runtime.kv_budget import ACTIVATION_RESERVE_FRACTION, kv_budget, max_concurrent_sequences
from kiln.runtime.kv_format import kv_bytes_per_token

torch.set_num_threads(1)

LLAMA_3_1_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                "max_position_embeddings": 131072, "tie_word_embeddings": False}
LLAMA_70B = {**LLAMA_3_1_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
             "num_attention_heads": 64}
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
               "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
               "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
               "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3, "q_lora_rank": 1536, "kv_lora_rank": 512,
               "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "vocab_size": 129280,
               "max_position_embeddings": 163840}


def _meta_weight_bytes(config: dict) -> int:
    """BF16 weight bytes of the model the config describes, counted on the meta device (nothing allocated)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    return 2 * sum(p.numel() for p in model.parameters())


def _all_fp8(spec) -> dict:
    return {str(layer.index): {"format": "fp8_e4m3", "scaling": "per_tensor"} for layer in spec.layers}


@pytest.mark.parametrize("config, expected, params", [
    (LLAMA_3_1_8B, 131_072, 8_030_261_248),  # 32 layers x 8 KV heads x 128 x (K + V) x 2 bytes
    (LLAMA_70B, 327_680, 70_553_706_496),  # 80 layers x 8 KV heads x 128 x 2 x 2 bytes
    (DEEPSEEK_V3, 70_272, 671_026_404_352),  # 61 layers x (512 latent + 64 rope) x 2 bytes: MLA caches the latent
], ids=["llama-3.1-8b", "llama-70b", "deepseek-v3"])
def test_known_bf16_kv_bytes_per_token(config, expected, params):
    spec = build_spec(config)
    assert sum(kv_bytes_per_token(spec).values()) == expected
    assert sum(kv_bytes_per_token(spec, _all_fp8(spec)).values()) == expected // 2
    assert _meta_weight_bytes(config) == 2 * params


def test_concurrency_formula_on_llama_8b():
    spec = build_spec(LLAMA_3_1_8B)
    weights = 2 * 8_030_261_248
    budget = kv_budget(spec, None, weights, weights)
    table = {(r["device"], r["context"]): r["source"] for r in budget["max_concurrent_sequences"]}
    # (80e9 - 16.06e9 weights - 8e9 reserve) / (131072 B x 4096) = 104.2
    assert ACTIVATION_RESERVE_FRACTION == 0.10
    assert table[("H100-80GB", 4096)] == 104 and table[("H100-80GB", 32768)] == 13
    assert table[("H200-141GB", 4096)] == 206 and table[("B200-192GB", 32768)] == 36
    fp8 = kv_budget(spec, _all_fp8(spec), weights, weights)
    assert fp8["kv_bytes_per_token"] == 65_536 and fp8["source_kv_bytes_per_token"] == 131_072
    assert [r["artifact"] for r in fp8["max_concurrent_sequences"]] == [208, 26, 412, 51, 583, 72]
    # a 70B in BF16 does not fit an 80 GB card at all; DeepSeek-V3 (671B, 1.34 TB in BF16) fits none
    assert max_concurrent_sequences(H100, _meta_weight_bytes(LLAMA_70B), 327_680, 4096) == 0
    assert max_concurrent_sequences(B200, 2 * 671_026_404_352, 70_272, 4096) == 0
    assert max_concurrent_sequences(H200, 0, 70_272, 4096) == int(141e9 * 0.9) // (70_272 * 4096)


def test_nvfp4_and_dynamic_fp8_bytes_include_their_scales():
    spec = build_spec(LLAMA_3_1_8B)
    nvfp4 = {str(i): {"format": "nvfp4", "scaling": "e4m3_block16"} for i in range(32)}
    dynamic = {str(i): {"format": "fp8_e4m3", "scaling": "dynamic"} for i in range(32)}
    # per layer and stream: 8 x 128 values -> 512 bytes of E2M1 + 64 E4M3 block scales
    assert sum(kv_bytes_per_token(spec, nvfp4).values()) == 32 * 2 * (512 + 64)
    assert sum(kv_bytes_per_token(spec, dynamic).values()) == 32 * 2 * (1024 + 4)  # + one fp32 scale per token
