"""KvCacheQuantization: Before -> Expected annotations, calibrated scales, NVFP4 -> FP8 back-off on head_dim,
MLA latent streams, gate back-off to BF16 for the most sensitive layers, ordering after MLA, validation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from kiln.kernels.errors import KilnError
from kiln.kernels.targets import get_target
from kiln.optimizer.loader import load_checkpoint
from kiln.optimizer.measure.gate import engine_from_graph
from kiln.optimizer.measure.kv_capture import KvCapture
from kiln.optimizer.measure.runner import RuntimeRunner
from kiln.passes.base import Pass, PassContext, PassResult, Pipeline
from kiln.passes.gate_result import GateResult
from kiln.passes.kv_cache import KvCacheQuantization

torch.set_num_threads(1)

CALIBRATION = [[1, *range(3 + i, 40 + i)] for i in range(0, 60, 3)]  # token ids < 160 (the tiny vocab)


def _ctx(graph, gate=None) -> PassContext:
    return PassContext(get_target("hopper"), gate=gate, runner=RuntimeRunner(graph, CALIBRATION))


def test_fp8_per_head_annotates_every_layer_with_calibrated_scales(tiny_checkpoints):
    graph = load_checkpoint(tiny_checkpoints["llama"])  # 2 layers, 2 KV heads of 16
    assert graph.kv_cache == {}
    acts = KvCapture(CALIBRATION)(graph)
    result = KvCacheQuantization(format="fp8", scaling="per_head").apply(graph, _ctx(graph))
    assert sorted(result.changed) == ["model.layers.0.kv_cache", "model.layers.1.kv_cache"]
    assert result.changed["model.layers.0.kv_cache"] == "fp8_e4m3 (per_head, centered)"
    for layer in (0, 1):
        entry = graph.kv_cache[layer]
        assert (entry["format"], entry["scaling"], entry["streams"]) == ("fp8_e4m3", "per_head", ["k", "v"])
        for s, stream in enumerate(("k", "v")):
            x = acts[layer][s]  # [tokens, 2, 16], post-RoPE, padding dropped
            assert x.shape[1:] == (2, 16) and x.shape[0] == sum(len(t) for t in CALIBRATION)
            offset = x.mean(0)
            torch.testing.assert_close(entry["offsets"][stream], offset)
            torch.testing.assert_close(entry["scales"][stream], (x - offset).abs().amax(dim=(0, 2)) / 448)
        assert 0 < result.metrics[f"model.layers.{layer}.kv_cache"] < 2e-3
    # what ships: the engine built from the graph stores those layers as FP8 bytes with those scales
    engine = engine_from_graph(graph)
    pool = engine.kv_pool.pools[1][0]
    assert pool.data.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(pool.scale, graph.kv_cache[1]["scales"]["k"].reshape(2, 1))


def test_nvfp4_where_head_dim_allows_and_fp8_with_a_reason_where_not(tiny_checkpoints, tmp_path):
    graph = load_checkpoint(tiny_checkpoints["qwen3"])  # head_dim 32
    result = KvCacheQuantization(format="nvfp4").apply(graph, _ctx(graph))
    assert all(e["format"] == "nvfp4" and e["scaling"] == "e4m3_block16" for e in graph.kv_cache.values())
    assert all(s.format == "nvfp4" for layer in engine_from_graph(graph).kv_streams for s in layer)
    assert all(n.startswith("sensitivity: logit KL") for n in result.notes)  # no back-off note

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                                 num_key_value_heads=4, vocab_size=160)).save_pretrained(tmp_path / "hd8")
    graph = load_checkpoint(tmp_path / "hd8")  # head_dim 8, like stories260K
    result = KvCacheQuantization(format="nvfp4", scaling="per_tensor").apply(graph, _ctx(graph))
    assert all(e["format"] == "fp8_e4m3" and "multiples of 16" in e["note"] for e in graph.kv_cache.values())
    assert "NVFP4 needs head_dim in multiples of 16 (k dim 8, v dim 8): FP8 E4M3 instead" in \
        result.changed["model.layers.0.kv_cache"]
    assert any("layers [0, 1]" in n for n in result.notes)


def test_mla_caches_latent_and_rope_part(tiny_checkpoints):
    graph = load_checkpoint(tiny_checkpoints["deepseek_v3"])  # kv_lora_rank 16, rope dim 8
    result = KvCacheQuantization(format="nvfp4").apply(graph, _ctx(graph))
    entry = graph.kv_cache[0]
    assert entry["streams"] == ["latent", "k_rope"] and entry["format"] == "fp8_e4m3"  # rope dim 8: no NVFP4
    assert "k_rope dim 8" in result.changed["model.layers.0.kv_cache"]
    assert entry["offsets"]["latent"].shape == (1, 16) and entry["scales"]["k_rope"].shape == ()
    engine = engine_from_graph(graph)
    prompts = [[1, 5, 9, 4], [1, 7, 3]]
    assert [len(ids) for ids, _ in engine.generate_ids(prompts, max_new_tokens=6)] == [6, 6]
    assert engine.kv_pool.num_used_blocks == 0


def _gate_passing_with_bf16_layers(needed: int):
    def gate(graph, floor):
        kept = sum(1 for b in graph.blocks if b.index not in graph.kv_cache)
        recovery = 1.0 if kept >= needed else 0.9
        return GateResult(perplexity=1 / recovery, baseline_perplexity=1.0, kl=0.0, top1=1.0, tokens=1, floor=floor)
    return gate


def test_failed_gate_keeps_the_most_sensitive_layers_in_bf16(tiny_checkpoints):
    graph = load_checkpoint(tiny_checkpoints["qwen2_moe"])  # 2 layers
    (record,) = Pipeline([KvCacheQuantization()]).run(graph, _ctx(graph, _gate_passing_with_bf16_layers(1)))
    assert record.decision == "backed-off"
    assert not record.attempts[0]["gate"].passed and record.attempts[1]["gate"].passed
    metrics = _first_metrics(tiny_checkpoints["qwen2_moe"])  # the sensitivities the first attempt measured
    layers = {k: v for k, v in metrics.items() if k.endswith(".kv_cache")}
    most_sensitive = int(max(layers, key=layers.get).split(".")[2])
    assert record.config["keep"] == [most_sensitive]
    assert most_sensitive not in graph.kv_cache and len(graph.kv_cache) == 1
    assert record.result.skipped == {f"model.layers.{most_sensitive}.kv_cache": "kept in BF16 (keep list / back-off)"}

    graph = load_checkpoint(tiny_checkpoints["qwen2_moe"])
    (record,) = Pipeline([KvCacheQuantization()]).run(graph, _ctx(graph, _gate_passing_with_bf16_layers(5)))
    assert record.decision == "reverted" and graph.kv_cache == {}


def _first_metrics(checkpoint) -> dict[str, float]:
    graph = load_checkpoint(checkpoint)
    return KvCacheQuantization().apply(graph, _ctx(graph)).metrics


def test_sensitivity_is_logit_kl_with_one_layer_quantized_when_the_driver_provides_it(tiny_checkpoints):
    graph = load_checkpoint(tiny_checkpoints["llama"])
    ctx = _ctx(graph)
    probe = []
    inner = ctx.runner.logit_kl
    ctx.runner.logit_kl = lambda g, n: probe.append(sorted(g.kv_cache)) or inner(g, n)
    result = KvCacheQuantization(sensitivity_paragraphs=8).apply(graph, ctx)
    assert probe == [[0], [1]]  # one layer at a time
    assert sorted(graph.kv_cache) == [0, 1]  # the full annotation is back afterwards
    for layer in (0, 1):
        key = f"model.layers.{layer}.kv_cache"
        assert result.metrics[key] > 0 and result.metrics[f"{key}.relative_error"] > 0
        assert result.metrics[key] != result.metrics[f"{key}.relative_error"]
    assert "logit KL on 8 calibration paragraphs" in result.notes[-1]
    layers = [p.keep for p in KvCacheQuantization().back_offs(graph, result)]
    assert layers == [(max((0, 1), key=lambda i: result.metrics[f"model.layers.{i}.kv_cache"]),)]


@dataclass(frozen=True)
class FakeMla(Pass):
    name: ClassVar[str] = "mla"

    def apply(self, graph, ctx):
        return PassResult(self.name, changed={"x": "y"})


def test_runs_after_mla_and_validates_its_config(tiny_checkpoints):
    Pipeline([FakeMla(), KvCacheQuantization()])
    with pytest.raises(KilnError, match="'kv-cache' must run after 'mla'"):
        Pipeline([KvCacheQuantization(), FakeMla()])
    for kwargs, message in [({"format": "int4"}, "format='int4' is not allowed; choose one of fp8, nvfp4"),
                            ({"scaling": "per_block"}, ("scaling='per_block' is not allowed; choose one of "
                                                        "per_tensor, per_head, dynamic")),
                            ({"keep": ("layer0",)}, r"keep entry \(a layer index\) must be an integer >= 0"),
                            ({"max_back_offs": -1}, r"max_back_offs must be an integer in \[0, 64\]")]:
        with pytest.raises(KilnError, match=message):
            KvCacheQuantization(**kwargs)
    graph = load_checkpoint(tiny_checkpoints["llama"])
    with pytest.raises(KilnError, match=r"keep names layers this model does not have: \[7\]"):
        KvCacheQuantization(keep=(7,)).check(graph, get_target("hopper"))
    with pytest.raises(KilnError, match="static KV scales need K/V activations"):
        KvCacheQuantization().apply(graph, PassContext(get_target("hopper")))
    result = KvCacheQuantization(scaling="dynamic", center=False).apply(graph, PassContext(get_target("hopper")))
    assert graph.kv_cache[0]["scales"] == {} and "no back-off" in result.notes[0]
