"""WeightQuantization (FP8 RTN): Before -> Expected structure, then numerics against the kernel reference."""

from __future__ import annotations

import torch

from kiln.kernels import fp8
from kiln.kernels.targets import get_target
from kiln.optimizer.loader import load_checkpoint
from kiln.passes.base import PassContext, Pipeline
from kiln.passes.weight_quant import WeightQuantization


def test_fp8_weights_structure_and_numerics(tiny_checkpoints):
    graph = load_checkpoint(tiny_checkpoints["mixtral"])
    before = {n: graph.weight(lin).clone() for n, lin in graph.linears.items()}
    assert all(lin.format == "dense" for lin in graph.linears.values())
    (record,) = Pipeline([WeightQuantization(format="fp8")]).run(graph, PassContext(get_target("hopper")))
    expected = {n: ("dense" if lin.role in ("router", "lm_head") else "fp8_e4m3") for n, lin in graph.linears.items()}
    assert {n: lin.format for n, lin in graph.linears.items()} == expected
    assert sum(1 for n in record.result.changed if ".experts." in n) == 2 * 4 * 3  # every expert linear
    assert all("router" in why for n, why in record.result.skipped.items() if n.endswith(".gate"))
    for name, lin in graph.linears.items():
        if lin.quant is None:
            continue
        q, scale = fp8.fp8_quantize_per_channel(before[name])
        assert torch.equal(lin.quant.tensors["weight"].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(lin.quant.tensors["weight_scale"], scale)
        assert torch.equal(graph.weight(lin), before[name])  # source kept for back-off / revert


def test_keep_list_and_w8a8_activation_annotation(tiny_checkpoints):
    graph = load_checkpoint(tiny_checkpoints["llama"])
    keep = ("model.layers.0.mlp.down_proj",)
    (record,) = Pipeline([WeightQuantization(format="fp8", activations="dynamic", keep=keep)]).run(
        graph, PassContext(get_target("hopper")))
    assert graph.linears[keep[0]].quant is None
    assert "keep list" in record.result.skipped[keep[0]]
    q = graph.linears["model.layers.1.self_attn.q_proj"].quant
    assert q.format == "fp8_e4m3" and q.activation == "fp8_dynamic_per_token"
