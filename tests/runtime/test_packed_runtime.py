"""The packed runtime (`runtime.load(path, packed=True)`): FP8 and FP4 linears keep the bytes the artifact
stores and multiply through kiln.kernels.gpu (runtime.linear.PackedLinear), and give the logits and greedy
tokens of the dequantize-once fp32 reference. Here the kernels' torch references run; the Triton kernels
(interpreted on CPU) run in test_packed_linears_through_the_triton_interpreter."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from safetensors.torch import load_file

from kiln import runtime
from kiln.optimizer.build import build
from kiln.optimizer.recipes import Recipe
from kiln.passes.mla import MlaConversion
from kiln.passes.weight_quant import WeightQuantization
from kiln.runtime.linear import PackedLinear, QuantLinear
from tests.conftest import STORIES

torch.set_num_threads(1)
if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
    # before anything here imports Triton (the builds do): its kernels are interpreted only if set by then
    os.environ.setdefault("TRITON_INTERPRET", "1")

FORMATS = {  # recipe -> (weight format, activation format) of its linears
    "fp8-w8a16": ({"format": "fp8"}, "none"),
    "fp8-w8a8": ({"format": "fp8", "activations": "dynamic"}, "fp8_dynamic_per_token"),
    "nvfp4-w4a16": ({"format": "nvfp4"}, "none"),
    "nvfp4-w4a4": ({"format": "nvfp4", "activations": "dynamic"}, "nvfp4"),
    "mxfp4-w4a16": ({"format": "mxfp4"}, "none"),
    "mxfp4-w4a4": ({"format": "mxfp4", "activations": "dynamic", "rotation_block": 16}, "mxfp4"),
    "mxfp6-w6a16": ({"format": "mxfp6"}, "none"),
}
TOKENS = [[1, 403, 261, 348, 416, 401, 263, 260, 443, 344], [1, 285, 388, 262, 289]]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    if not (STORIES / "config.json").is_file():
        pytest.skip("../shared/models absent")
    root = tmp_path_factory.mktemp("packed")
    return {name: build(STORIES, "blackwell", Recipe(name, (WeightQuantization(method="rtn", **kw),)), root / name,
                        gate=False).path for name, (kw, _) in FORMATS.items()}


@pytest.fixture(scope="module")
def mla_artifact(tmp_path_factory):
    """stories260K converted to MLA (half its KV, no healing), its linears FP8 W8A8."""
    if not (STORIES / "config.json").is_file():
        pytest.skip("../shared/models absent")
    passes = (MlaConversion(kv_fraction=0.5, heal_steps=0),
              WeightQuantization(method="rtn", format="fp8", activations="dynamic"))
    return build(STORIES, "hopper", Recipe("mla-fp8", passes), tmp_path_factory.mktemp("mla") / "mla",
                 gate=False).path


@pytest.fixture
def no_triton(monkeypatch):
    from kiln.kernels import gpu

    monkeypatch.setattr(gpu, "use_triton", lambda x: False)


def _linears(engine):
    return [m for m in engine.model.modules() if isinstance(m, (PackedLinear, QuantLinear))]


@pytest.mark.parametrize("name", list(FORMATS))
def test_packed_engine_keeps_the_stored_bytes_and_gives_the_reference_logits(artifacts, name, no_triton):
    reference, packed = runtime.load(artifacts[name]), runtime.load(artifacts[name], packed=True)
    linears = _linears(packed)
    packed_linears = [m for m in linears if isinstance(m, PackedLinear)]
    # every block's linear is packed; the lm_head (tied to the embedding, stored dense) is not
    assert len(packed_linears) == len(linears) - 1 == 7 * len(packed.spec.layers)
    assert {m.activation for m in packed_linears} == {FORMATS[name][1]}
    stored = load_file(artifacts[name] / "model.safetensors")
    for module in packed_linears:  # codes and scales only: no fp32 matrix
        assert all(b.dtype in (torch.float8_e4m3fn, torch.uint8, torch.float32) for b in module.buffers())
        assert not any(b.dtype == torch.float32 and b.ndim == 2 and b.shape[1] > 1 for b in module.buffers())
    packed_bytes = sum(m.stored_bytes for m in packed_linears)
    weight_keys = [k for k in stored if any(k.endswith(s) for s in (".weight", ".weight_scale", ".weight_scale_2",
                                                                     ".input_scale"))
                   and "norm" not in k and "embed" not in k]
    assert packed_bytes == sum(stored[k].numel() * stored[k].element_size() for k in weight_keys)

    for expected, got in zip(reference.logits(TOKENS), packed.logits(TOKENS), strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=2e-4 * float(expected.abs().max()))
    assert packed.generate_ids([TOKENS[0]], 16) == reference.generate_ids([TOKENS[0]], 16)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
@pytest.mark.parametrize("name", ["fp8-w8a8", "nvfp4-w4a16", "mxfp4-w4a16", "mxfp4-w4a4", "mxfp6-w6a16"])
def test_packed_linears_through_the_triton_interpreter(artifacts, name):
    from kiln.kernels import gpu
    from tests.kernels.triton_setup import INTERPRET  # sets TRITON_INTERPRET=1 without a GPU

    assert INTERPRET
    reference, packed = runtime.load(artifacts[name]), runtime.load(artifacts[name], packed=True)
    x = torch.randn(3, packed.spec.hidden_size)
    assert gpu.use_triton(x)
    [expected], [got] = reference.logits(TOKENS[1:]), packed.logits(TOKENS[1:])
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-4 * float(expected.abs().max()))


def test_packed_mla_engine_keeps_kv_b_dequantized_and_decodes_as_the_reference(mla_artifact, no_triton):
    from kiln.runtime.attention import MlaAttention

    reference, packed = runtime.load(mla_artifact), runtime.load(mla_artifact, packed=True)
    mla = [m for m in packed.model.modules() if isinstance(m, MlaAttention)]
    assert mla
    for attention in mla:  # absorbed decode reads kv_b's weight per head; every other linear is packed
        assert isinstance(attention.kv_b_proj, QuantLinear)
        assert isinstance(attention.kv_a_proj, PackedLinear) and isinstance(attention.o_proj, PackedLinear)
    for expected, got in zip(reference.logits(TOKENS), packed.logits(TOKENS), strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=2e-4 * float(expected.abs().max()))
    assert packed.generate_ids(TOKENS, 12) == reference.generate_ids(TOKENS, 12)


def test_a_packed_mxfp6_linear_compiles_to_one_graph_through_its_custom_op(no_triton):
    # under torch.compile the W6A16 GEMM is the opaque kiln::fp6_linear (a launch's Python code would break the
    # graph), as kiln::fp4_linear is for FP4 (tests/runtime/test_device_runtime.py)
    from torch._dynamo.utils import counters

    from kiln.kernels.mxfp6 import mxfp6_quantize

    w = torch.randn(24, 72, generator=torch.Generator().manual_seed(0))
    linear = PackedLinear("mxfp6", mxfp6_quantize(w).tensors(), 72, "none", None, None, None)
    x = torch.randn(3, 72, generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    counters.clear()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    got = torch.compile(linear, fullgraph=True, backend=backend)(x)
    assert len(graphs) == 1 and "torch.ops.kiln.fp6_linear" in graphs[0]
    from kiln.kernels.mxfp6 import mxfp6_dequantize

    torch.testing.assert_close(got, x @ mxfp6_dequantize(mxfp6_quantize(w)).T, rtol=0, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
