"""Loader: the IR structure of every supported architecture (Before -> Expected), and bad input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.kernels.errors import KilnError
from kiln.optimizer.loader import load_checkpoint
from tests.breakage import MESSAGES, broken_copy
from tests.conftest import STORIES, needs_stories

# Expected structure of the tiny configs in tests/tiny_models.py
EXPECTED = {
    # model_type: (layers, attention kind per layer, heads, kv heads, head_dim, mlp kind per layer, experts, top_k)
    "llama": (2, ["gqa"] * 2, 4, 2, 16, ["dense"] * 2, 0, 0),
    "mistral": (2, ["gqa"] * 2, 4, 2, 16, ["dense"] * 2, 0, 0),
    "qwen2": (2, ["gqa"] * 2, 4, 2, 16, ["dense"] * 2, 0, 0),
    "qwen3": (2, ["gqa"] * 2, 4, 2, 32, ["dense"] * 2, 0, 0),
    "mixtral": (2, ["gqa"] * 2, 4, 2, 16, ["moe"] * 2, 4, 2),
    "qwen2_moe": (2, ["gqa"] * 2, 4, 2, 16, ["moe"] * 2, 4, 2),
    "qwen3_moe": (2, ["gqa"] * 2, 4, 2, 16, ["moe"] * 2, 4, 2),
    "deepseek_v3": (3, ["mla"] * 3, 4, 4, 24, ["dense", "moe", "moe"], 4, 2),
    "gemma3_text": (2, ["gqa"] * 2, 4, 1, 32, ["dense"] * 2, 0, 0),
}


@pytest.mark.parametrize("model_type", sorted(EXPECTED))
def test_structure_of_every_architecture(tiny_checkpoints, model_type):
    graph = load_checkpoint(tiny_checkpoints[model_type])
    layers, attn_kinds, heads, kv_heads, head_dim, mlp_kinds, experts, top_k = EXPECTED[model_type]
    assert graph.model_type == model_type
    assert len(graph.blocks) == layers
    assert [b.attention.kind for b in graph.blocks] == attn_kinds
    assert {(b.attention.num_heads, b.attention.num_kv_heads, b.attention.head_dim) for b in graph.blocks} == {
        (heads, kv_heads, head_dim)}
    assert [b.mlp.kind for b in graph.blocks] == mlp_kinds
    for block in graph.blocks:
        if block.mlp.kind == "moe":
            assert block.mlp.num_experts == experts and block.mlp.top_k == top_k
            assert graph.linears[block.mlp.linears["router"].name].role == "router"
            for expert in block.mlp.experts:
                assert {graph.linears[ls.name].role for ls in expert.values()} == {"expert"}
                assert {graph.linears[ls.name].proj for ls in expert.values()} == {"gate", "up", "down"}
    # every linear weight exists with the shape its spec says, and roles are the known set
    for lin in graph.linears.values():
        assert tuple(graph.weight(lin).shape) == (lin.out_features, lin.in_features)
    roles = {lin.role for lin in graph.linears.values()}
    if model_type == "deepseek_v3":
        assert {"q_a", "q_b", "kv_a", "kv_b", "o", "gate", "up", "down", "expert", "router", "lm_head"} == roles
        assert graph.blocks[1].mlp.num_shared_experts == 1
        assert graph.blocks[0].attention.kv_lora_rank == 16 and graph.blocks[0].attention.qk_rope_head_dim == 8
    elif EXPECTED[model_type][6]:
        assert {"q", "k", "v", "o", "expert", "router", "lm_head"} <= roles
    else:
        assert roles == {"q", "k", "v", "o", "gate", "up", "down", "lm_head"}
    n_expert_linears = sum(3 * b.mlp.num_experts for b in graph.blocks)
    assert sum(1 for lin in graph.linears.values() if lin.role == "expert") == n_expert_linears


def test_qwen2_moe_has_shared_expert_and_gate(tiny_checkpoints):
    graph = load_checkpoint(tiny_checkpoints["qwen2_moe"])
    mlp = graph.blocks[0].mlp
    assert {"router", "shared_gate", "shared_up", "shared_down", "shared_gate_router"} == set(mlp.linears)
    assert graph.linears[mlp.linears["shared_gate_router"].name].out_features == 1


@needs_stories
def test_real_model_structure(stories_graph):
    g = stories_graph
    assert g.model_type == "llama" and g.tied_embeddings
    assert len(g.blocks) == 5
    a = g.blocks[0].attention
    assert (a.kind, a.num_heads, a.num_kv_heads, a.head_dim) == ("gqa", 8, 4, 8)
    assert g.linears["lm_head"].tied_to == "model.embed_tokens.weight"
    assert g.linears["model.layers.0.mlp.down_proj"].in_features == 172
    assert len(g.linears) == 5 * 7 + 1
    assert g.source.weight_bytes == sum(t.numel() * 4 for t in g.tensors.values())


def test_sharded_checkpoint_loads_the_same(tiny_checkpoints, tmp_path):
    src = tiny_checkpoints["llama"]
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, tmp_path / file)
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    shutil.copy(src / "config.json", tmp_path / "config.json")
    graph = load_checkpoint(tmp_path)
    assert set(graph.source.weight_files) == set(shards)
    for k, v in tensors.items():
        assert torch.equal(graph.tensors[k], v)


@pytest.mark.parametrize("breakage, message", MESSAGES.items())
def test_bad_checkpoints_raise_one_line_errors(tiny_checkpoints, tmp_path, breakage, message):
    ckpt = broken_copy(tiny_checkpoints["llama"], tmp_path / "ckpt", breakage)
    with pytest.raises(KilnError) as err:
        load_checkpoint(ckpt)
    text = str(err.value)
    assert message in text and "\n" not in text
    if breakage == "unknown_arch":
        assert "llama" in text and "deepseek_v3" in text  # names what is supported


def test_missing_directory_and_offline_hub_id(tmp_path, monkeypatch):
    with pytest.raises(KilnError, match="not found"):
        load_checkpoint(tmp_path / "nope")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(KilnError, match="cannot fetch 'someorg/somemodel'"):
        load_checkpoint("someorg/somemodel")


@needs_stories
def test_loader_never_unpickles(monkeypatch):
    import pickle

    def refuse(*args, **kwargs):
        raise AssertionError("unpickling attempted")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    load_checkpoint(STORIES)
