"""The runtime fuses an unfused artifact's sibling linears at load (q/k/v, gate/up), as vLLM does.

Before: an artifact built without the `fuse` pass, three attention projections and two MLP inputs per layer.
Expected: on the dequantized (CPU) path, one QuantLinear for each group whose inputs are one input (same width,
rotation, activation format and input scale, and bias on all or none), its weight the parts' dequantized
weights stacked in order; logits equal to the unfused model's up to the order of fp32 sums. Groups whose
inputs differ stay separate, and the packed path keeps what the artifact stores."""

from __future__ import annotations

import dataclasses

import torch

from kiln.kernels.targets import get_target
from kiln.optimizer.loader import load_checkpoint
from kiln.optimizer.lower import lower_tensors
from kiln.optimizer.measure.gate import kv_cache_table, roundtrip
from kiln.passes.base import PassContext, Pipeline
from kiln.passes.weight_quant import WeightQuantization
from kiln.runtime.engine import Engine
from kiln.runtime.linear import QuantLinear
from kiln.runtime.mlp import DenseMlp

TOLERANCE = 1e-5  # of the largest |logit|: fp32 summation order, nothing else


def _engines(graph, **kwargs) -> tuple[Engine, Engine]:
    tensors, formats = lower_tensors(graph)
    tensors = roundtrip(tensors)
    make = lambda fuse: Engine(graph.spec, tensors, formats, kv_cache=kv_cache_table(graph), fuse=fuse, **kwargs)
    return make(True), make(False)


def _difference(fused: Engine, unfused: Engine, vocab: int) -> float:
    tokens = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(12).expand(2, -1)
    with torch.no_grad():
        a, b = fused.model(tokens, positions), unfused.model(tokens, positions)
    return float((a - b).abs().max()) / float(b.abs().max())


def _quantize(graph, **kwargs) -> None:
    Pipeline([WeightQuantization(**kwargs)]).run(graph, PassContext(get_target("hopper")))


def test_qkv_and_gate_up_run_as_one_product_each(tiny_checkpoints):
    graph = load_checkpoint(tiny_checkpoints["qwen2"])  # Qwen2: q/k/v carry biases, concatenated too
    fused, unfused = _engines(graph)
    layers = len(graph.spec.layers)
    assert (fused.model.fused_groups, unfused.model.fused_groups) == (2 * layers, 0)
    for block, layer in zip(fused.model.blocks, graph.spec.layers, strict=True):
        a = block.attention
        q, k, v = (layer.attention.linears[r] for r in ("q", "k", "v"))
        assert isinstance(a.qkv_proj, QuantLinear) and not hasattr(a, "q_proj")
        assert a.qkv_split == (q.out_features, k.out_features, v.out_features)
        expected = torch.cat([graph.tensors[f"{p.name}.weight"].float() for p in (q, k, v)])
        assert torch.equal(a.qkv_proj.weight, expected)
        assert torch.equal(a.qkv_proj.bias, torch.cat([graph.tensors[f"{p.name}.bias"].float() for p in (q, k, v)]))
        assert block.mlp.gate_up_proj is not None and block.mlp.gate_up_split == (96, 96)
    assert unfused.model.blocks[0].attention.qkv_proj is None
    assert _difference(fused, unfused, graph.spec.vocab_size) <= TOLERANCE


def test_quantized_siblings_fuse_on_their_dequantized_values(tiny_checkpoints):
    # FP8 W8A8 with dynamic per-token activations: one quantizer for one input, so the group fuses; a kept (dense)
    # k_proj fuses too, since each part is dequantized to its own exact values first
    graph = load_checkpoint(tiny_checkpoints["llama"])
    _quantize(graph, format="fp8", activations="dynamic", keep=("model.layers.0.self_attn.k_proj",))
    assert graph.linears["model.layers.0.self_attn.k_proj"].format == "dense"
    fused, unfused = _engines(graph)
    a0, a1 = (b.attention for b in fused.model.blocks)
    assert a1.qkv_proj is not None and a1.qkv_proj.input_quantizer is not None
    # layer 0: k_proj kept dense reads an unquantized input, q/v quantize theirs: not one input, not fused
    assert a0.qkv_proj is None and a0.q_proj.input_quantizer is not None and a0.k_proj.input_quantizer is None
    assert fused.model.fused_groups == 3
    assert _difference(fused, unfused, graph.spec.vocab_size) <= TOLERANCE

    graph = load_checkpoint(tiny_checkpoints["llama"])
    _quantize(graph, format="nvfp4", keep=("model.layers.0.self_attn.k_proj",))  # weight-only: fuses everywhere
    fused, unfused = _engines(graph)
    assert fused.model.fused_groups == 4
    assert _difference(fused, unfused, graph.spec.vocab_size) <= TOLERANCE


def test_siblings_with_different_input_scales_stay_separate(tiny_checkpoints):
    from kiln.optimizer.measure.runner import RuntimeRunner

    graph = load_checkpoint(tiny_checkpoints["llama"])
    tokens = [torch.randint(0, graph.spec.vocab_size, (32,), generator=torch.Generator().manual_seed(i)).tolist()
              for i in range(4)]
    Pipeline([WeightQuantization(format="fp8", activations="static")]).run(
        graph, PassContext(get_target("hopper"), runner=RuntimeRunner(graph, tokens)))
    up = graph.linears["model.layers.0.mlp.up_proj"]
    up.quant = dataclasses.replace(up.quant, tensors={**up.quant.tensors, "input_scale": up.quant.tensors["input_scale"] * 2})
    fused, unfused = _engines(graph)
    mlp0, mlp1 = (b.mlp for b in fused.model.blocks)
    assert mlp0.gate_up_proj is None and isinstance(mlp0.up_proj, QuantLinear)  # two quantizers, two products
    assert mlp1.gate_up_proj is not None
    assert _difference(fused, unfused, graph.spec.vocab_size) <= TOLERANCE


def test_moe_experts_fuse_and_the_packed_path_keeps_the_stored_layout(tiny_checkpoints):
    graph = load_checkpoint(tiny_checkpoints["qwen2_moe"])  # routed experts and a shared expert: dense MLPs each
    fused, unfused = _engines(graph)
    mlps = [m for m in fused.model.modules() if isinstance(m, DenseMlp)]
    assert mlps and all(m.gate_up_proj is not None for m in mlps)
    assert fused.model.fused_groups == len(mlps) + len(graph.spec.layers)
    assert _difference(fused, unfused, graph.spec.vocab_size) <= TOLERANCE

    graph = load_checkpoint(tiny_checkpoints["llama"])
    _quantize(graph, format="fp8")
    packed, _ = _engines(graph, packed=True)
    assert packed.model.fused_groups == 0 and packed.model.blocks[0].attention.qkv_proj is None
