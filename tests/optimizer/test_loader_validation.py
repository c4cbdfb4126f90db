"""Loader validation: every bad config, header, index or tensor is one line of KilnError before anything is
built, and tensors the model does not use are reported, not silently carried."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.kernels.errors import KilnError
from kiln.optimizer.loader import load_checkpoint
from tests.breakage import MESSAGES, broken_copy
from tests.conftest import STORIES, needs_stories


def _refused(path, **kwargs) -> str:
    with pytest.raises(KilnError) as err:
        load_checkpoint(path, **kwargs)
    text = str(err.value)
    assert "\n" not in text and len(text) < 400
    return text


def _with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _with_tensors(src, dst, edit):
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


@pytest.mark.parametrize("kind", sorted(MESSAGES))
def test_every_breakage_of_the_generated_checkpoint(generated_checkpoint, tmp_path, kind):
    # the CLI tests break this checkpoint (tied embeddings, 8 heads): each kind must fit it as well
    assert MESSAGES[kind] in _refused(broken_copy(generated_checkpoint, tmp_path / "ckpt", kind))


def test_a_huge_layer_count_is_refused_at_once(tiny_checkpoints, tmp_path):
    ckpt = broken_copy(tiny_checkpoints["qwen2"], tmp_path / "ckpt", "huge_layer_count")
    config = json.loads((ckpt / "config.json").read_text())
    del config["layer_types"]  # transformers would build one entry per layer
    (ckpt / "config.json").write_text(json.dumps(config))
    start = time.perf_counter()
    assert "declares 1000000000000 layers" in _refused(ckpt)
    assert time.perf_counter() - start < 10


@pytest.mark.parametrize("changes, message", [
    ({"num_hidden_layers": -1}, "config.json: num_hidden_layers must be a positive integer, got -1"),
    ({"num_hidden_layers": 1.5}, "num_hidden_layers must be a positive integer, got 1.5"),
    ({"num_hidden_layers": True}, "num_hidden_layers must be a positive integer, got true"),
    ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0"),
    ({"hidden_size": "abc"}, "config.json: hidden_size must be a positive integer, got 'abc'"),
    ({"vocab_size": None}, "config.json: vocab_size must be a positive integer, got null"),
    ({"intermediate_size": -96}, "intermediate_size must be a positive integer, got -96"),
    ({"head_dim": 0}, "head_dim must be a positive integer or null, got 0"),
    ({"rms_norm_eps": None}, "config.json: rms_norm_eps must be a positive number, got null"),
    ({"rms_norm_eps": "tiny"}, "rms_norm_eps must be a positive number, got 'tiny'"),
    ({"num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": None},
     "config.json: hidden_size 64 is not divisible by num_attention_heads 6 (and no head_dim is given)"),
    ({"num_key_value_heads": 3}, "config.json: num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ({"layer_types": ["full_attention"]}, "config.json: layer_types has 1 entries but num_hidden_layers is 2"),
    ({"layer_types": ["full_attention", "bogus"]},
     "config.json: layer_types entry 'bogus' is not one of full_attention, sliding_attention"),
    ({"layer_types": "full_attention"}, "config.json: layer_types must be a list, got 'full_attention'"),
    # fields Kiln does not check itself: transformers' strict validation, as one line
    ({"tie_word_embeddings": "yes"}, "invalid llama config.json: Validation error for field 'tie_word_embeddings'"),
    ({"quantization_config": "awq"}, "pre-quantized checkpoints (quantization_config quant_method unknown)"),
])
def test_bad_config_fields(tiny_checkpoints, tmp_path, changes, message):
    assert message in _refused(_with_config(tiny_checkpoints["llama"], tmp_path / "ckpt", **changes))


def test_the_head_split_is_not_checked_when_head_dim_is_given(tiny_checkpoints):
    assert load_checkpoint(tiny_checkpoints["qwen3"]).blocks[0].attention.head_dim == 32  # 64 / 4 != 32


@pytest.mark.parametrize("model_type, changes, message", [
    ("mixtral", {"num_experts_per_tok": 5}, "config.json: num_experts_per_tok 5 exceeds the 4 experts"),
    ("mixtral", {"num_local_experts": "4"}, "num_local_experts must be a positive integer, got '4'"),
    ("deepseek_v3", {"n_group": 3}, "4 routed experts do not split into n_group 3 groups"),
    ("deepseek_v3", {"kv_lora_rank": None}, "kv_lora_rank must be a positive integer, got null"),
])
def test_bad_moe_and_mla_fields(tiny_checkpoints, tmp_path, model_type, changes, message):
    assert message in _refused(_with_config(tiny_checkpoints[model_type], tmp_path / "ckpt", **changes))


@needs_stories
def test_a_config_declaring_fewer_layers_than_the_weights_hold(tmp_path):
    text = _refused(_with_config(STORIES, tmp_path / "ckpt", num_hidden_layers=3))
    assert text == ("the checkpoint holds tensors for layers 3-4, which config.json does not declare "
                    "(num_hidden_layers is 3)")


def test_deepseek_mtp_layers_are_extra_modules_of_the_spec(tiny_checkpoints, tmp_path):
    from kiln.optimizer.loader import _expected_tensors
    from kiln.optimizer.loader_config import build_spec

    src = tiny_checkpoints["deepseek_v3"]
    config = json.loads((src / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    # DeepSeek-V3 keeps its MTP layer after the decoder layers: a decoder layer plus enorm/hnorm, eh_proj and
    # a shared head, all under model.layers.3 here
    spec = build_spec(config, tensor_names={"model.layers.3.eh_proj.weight", "model.layers.3.shared_head.head.weight"})
    names = spec.tensor_names() - build_spec(config).tensor_names()
    expected = _expected_tensors(spec)
    gen = torch.Generator().manual_seed(0)
    extra = {n: torch.randn(expected[n].shape, generator=gen) * 0.02 + (1 if n.endswith("norm.weight") else 0)
             for n in names}
    ckpt = _with_tensors(src, tmp_path / "ckpt", lambda t: t.update(extra))
    messages = []
    graph = load_checkpoint(ckpt, log=messages.append)
    (mtp,) = graph.spec.extra_modules
    assert mtp.kind == "mtp" and mtp.name == "model.layers.3" and mtp.layer.attention.kind == "mla"
    assert set(mtp.linears) == {"eh_proj", "head"} and mtp.linears["eh_proj"].in_features == 2 * spec.hidden_size
    assert graph.metadata["loader"]["unused_tensors"] == [] and messages == []
    assert not any(name.startswith("model.layers.3.") for name in graph.linears)  # not quantized as decoder layers
    # a config that does not declare the MTP layer cannot hold its tensors
    (ckpt / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    assert "holds tensors for layer 3, which config.json does not declare" in _refused(ckpt)
    # an MTP layer with only some of its tensors is refused, naming what is missing
    partial = _with_tensors(src, tmp_path / "partial", lambda t: t.update(
        {"model.layers.3.eh_proj.weight": extra["model.layers.3.eh_proj.weight"]}))
    assert "lacks" in _refused(partial) and "model.layers.3." in _refused(partial)


@pytest.mark.parametrize("name, value, message", [
    ("model.norm.weight", torch.ones(64, dtype=torch.int32),
     "model.norm.weight has dtype I32; a norm weight must be floating point"),
    ("model.embed_tokens.weight", torch.ones(160, 64, dtype=torch.uint8),
     "model.embed_tokens.weight has dtype U8; the embedding must be floating point"),
    ("model.layers.1.mlp.up_proj.weight", torch.ones(96, 64, dtype=torch.int32),
     "model.layers.1.mlp.up_proj.weight has dtype I32; a linear weight must be floating point"),
    ("model.embed_tokens.weight", torch.ones(100, 64),
     "model.embed_tokens.weight has shape (100, 64), config implies (160, 64)"),
    ("model.layers.1.post_attention_layernorm.weight", torch.full((64,), -2e4),
     "norm weight model.layers.1.post_attention_layernorm.weight holds a value of magnitude 2e+04"),
    ("model.layers.0.mlp.gate_proj.weight", torch.full((96, 64), 1e300, dtype=torch.float64),
     "tensor model.layers.0.mlp.gate_proj.weight holds values beyond float32"),
    ("model.layers.0.mlp.gate_proj.weight", torch.full((96, 64), 3e36),  # finite, but its squares are not
     "tensor model.layers.0.mlp.gate_proj.weight holds a value of magnitude 3e+36 (more than 1e+15)"),
    ("model.layers.0.mlp.gate_proj.weight", torch.full((96, 64), float("-inf"), dtype=torch.bfloat16),
     "tensor model.layers.0.mlp.gate_proj.weight contains Inf values"),
    ("model.layers.0.mlp.gate_proj.weight",
     torch.full((96, 64), 0x7C, dtype=torch.uint8).view(torch.float8_e5m2),  # e5m2 +Inf
     "tensor model.layers.0.mlp.gate_proj.weight contains NaN/Inf values"),
    ("model.layers.0.mlp.gate_proj.weight",
     torch.full((96, 64), 0xFF, dtype=torch.uint8).view(torch.float8_e4m3fn),  # e4m3fn -NaN
     "tensor model.layers.0.mlp.gate_proj.weight contains NaN values"),
])
def test_bad_tensors(tiny_checkpoints, tmp_path, name, value, message):
    ckpt = _with_tensors(tiny_checkpoints["llama"], tmp_path / "ckpt", lambda t: t.update({name: value}))
    assert message in _refused(ckpt)


def test_finite_fp8_weights_load(tiny_checkpoints, tmp_path):
    name = "model.layers.0.mlp.down_proj.weight"
    ckpt = _with_tensors(tiny_checkpoints["llama"], tmp_path / "ckpt",
                         lambda t: t.update({name: t[name].to(torch.float8_e4m3fn)}))
    graph = load_checkpoint(ckpt)
    assert graph.tensors[name].dtype == torch.float8_e4m3fn


def _sharded(src, dst, edit_index):
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    save_file({k: tensors[k] for k in names[:5]}, dst / "a.safetensors")
    save_file({k: tensors[k] for k in names[4:]}, dst / "b.safetensors")  # names[4] is in both
    index = {"weight_map": {k: "a.safetensors" for k in names[:5]} | {k: "b.safetensors" for k in names[5:]}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(edit_index(index, names)))
    return dst


@pytest.mark.parametrize("edit, message", [
    (lambda index, names: {"weight_map": list(index["weight_map"])}, "is not a valid safetensors index"),
    (lambda index, names: {"weight_map": {**index["weight_map"], names[0]: 7}},
     "weight_map entry 'lm_head.weight' must name a shard file, got 7"),
    (lambda index, names: {"weight_map": {**index["weight_map"], names[0]: "/etc/a.safetensors"}},
     "weight_map entry 'lm_head.weight' points outside the checkpoint directory ('/etc/a.safetensors')"),
    (lambda index, names: {"weight_map": {**index["weight_map"], names[0]: "sub/../../a.safetensors"}},
     "points outside the checkpoint directory"),
    (lambda index, names: index, "is stored twice, in a.safetensors and b.safetensors"),
])
def test_bad_shard_index(tiny_checkpoints, tmp_path, edit, message):
    assert message in _refused(_sharded(tiny_checkpoints["llama"], tmp_path / "ckpt", edit))


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe",
                                        "deepseek_v3", "gemma3_text"])
def test_intact_checkpoints_report_no_unused_tensors(tiny_checkpoints, model_type):
    messages = []
    graph = load_checkpoint(tiny_checkpoints[model_type], log=messages.append)
    assert messages == [] and graph.metadata["loader"] == {"unused_tensors": []}


@needs_stories
def test_the_real_model_reports_no_unused_tensors():
    messages = []
    assert load_checkpoint(STORIES, log=messages.append).metadata["loader"]["unused_tensors"] == []
    assert messages == []


def test_unused_tensors_are_kept_and_reported(tiny_checkpoints, tmp_path):
    extra = {f"extra.{i}": torch.zeros(2) for i in range(7)}
    extra["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # a known buffer: kept, not reported
    ckpt = _with_tensors(tiny_checkpoints["llama"], tmp_path / "ckpt", lambda t: t.update(extra))
    messages = []
    graph = load_checkpoint(ckpt, log=messages.append)
    assert graph.metadata["loader"]["unused_tensors"] == sorted(k for k in extra if k.startswith("extra."))
    assert messages == [("7 checkpoint tensor(s) are not used by the llama model and are copied to the artifact "
                         "unchanged: extra.0, extra.1, extra.2, extra.3, extra.4, ...")]
    assert set(extra) <= set(graph.tensors)


def test_a_real_kiln_manifest_without_source_is_still_refused(tiny_checkpoints, tmp_path):
    ckpt = broken_copy(tiny_checkpoints["llama"], tmp_path / "ckpt", "intact")
    (ckpt / "manifest.json").write_text(json.dumps({"schema_version": 1}))
    assert "(manifest source: not recorded)" in _refused(ckpt)
    (ckpt / "manifest.json").write_text("not json: some other tool's file")
    load_checkpoint(ckpt)
