"""benchmarks/precision.py's count of an external checkpoint's bits: the bytes it stores per decoder linear."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from safetensors.torch import save_file

from tests.conftest import benchmark


def precision():
    return benchmark("precision")


def test_stored_bits_counts_packed_weights_scales_and_dense(tmp_path):
    q = SimpleNamespace(name="layers.0.q", role="q", out_features=8, in_features=32)  # NVFP4: 4 + 8/16 bits
    o = SimpleNamespace(name="layers.0.o", role="o", out_features=8, in_features=32)  # dense: counted as 16
    head = SimpleNamespace(name="lm_head", role="lm_head", out_features=100, in_features=32)  # left out
    save_file({"layers.0.q.weight_packed": torch.zeros(8, 16, dtype=torch.uint8),
               "layers.0.q.weight_scale": torch.zeros(8, 2, dtype=torch.float8_e4m3fn),
               "layers.0.q.weight_global_scale": torch.ones(1),
               "layers.0.o.weight": torch.zeros(8, 32), "layers.0.o.bias": torch.zeros(8),
               "lm_head.weight": torch.zeros(100, 32)}, tmp_path / "model.safetensors")
    graph = SimpleNamespace(iter_linears=lambda: iter([q, o, head]))
    bits = precision().stored_bits(graph, tmp_path)
    assert bits == 8 * ((8 * 16 + 8 * 2 + 4) + 2 * 256) / 512
