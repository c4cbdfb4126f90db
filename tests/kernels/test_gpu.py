"""kernels/gpu.py: the torch reference without Triton (or off CUDA), the Triton kernel where it can run."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kiln.kernels import gpu, torch_refs
from kiln.kernels.fp8 import fp8_quantize_per_channel
from kiln.kernels.kv_fp8 import fp8_kv_quantize_per_token
from kiln.kernels.mxfp4 import mxfp4_quantize
from kiln.kernels.nvfp4 import nvfp4_quantize

torch.set_num_threads(1)


def _x(m=5, k=64, dtype=torch.float32):
    return (torch.randn(m, k, generator=torch.Generator().manual_seed(0)) * 2).to(dtype)


def _w(n=32, k=64):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(1))


def _attention_case():
    g = torch.Generator().manual_seed(2)
    kv = torch.randn(2, 5 * 4, 2, 32, generator=g)
    pools = [torch_refs.KvPool("fp8_e4m3", *fp8_kv_quantize_per_token(s)) for s in kv]
    q = torch.randn(2, 4, 32, generator=g)
    table = torch.tensor([[0, 1], [2, 4]], dtype=torch.int32)
    return q, pools, table, torch.tensor([7, 3], dtype=torch.int32)


@pytest.fixture
def no_triton(monkeypatch):
    monkeypatch.setattr(gpu, "triton_installed", lambda: False)


def test_reference_path_returns_the_reference_in_the_input_dtype(no_triton):
    x = _x(dtype=torch.bfloat16)
    qw, w_scale = fp8_quantize_per_channel(_w())
    out = gpu.fp8_linear(x, qw, w_scale)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, torch_refs.fp8_linear_ref(x, qw, w_scale).bfloat16())
    nv, mx = nvfp4_quantize(_w()), mxfp4_quantize(_w())
    assert torch.equal(gpu.fp4_linear(_x(), nv), torch_refs.fp4_w4a16_ref(_x(), nv))
    assert torch.equal(gpu.fp4_linear(_x(), nv, "nvfp4", torch.tensor(0.01)),
                       torch_refs.fp4_w4a4_ref(_x(), nv, torch.tensor(0.01)))
    assert torch.equal(gpu.fp4_linear(_x(), mx, "mxfp4"), torch_refs.fp4_w4a4_ref(_x(), mx))
    act = gpu.rmsnorm_quantize(_x(), torch.ones(64), 1e-6, "nvfp4")
    ref = torch_refs.quantize_nvfp4_ref(torch_refs.rmsnorm_ref(_x(), torch.ones(64), 1e-6))
    assert torch.equal(act.data, ref.data) and torch.equal(act.global_scale, ref.global_scale)
    q, (k_pool, v_pool), table, lens = _attention_case()
    assert torch.equal(gpu.paged_decode_attention(q, k_pool, v_pool, table, lens, 4),
                       torch_refs.paged_decode_attention_ref(q, k_pool, v_pool, table, lens, 4))


def test_mismatched_formats_are_refused(no_triton):
    nv = nvfp4_quantize(_w())
    with pytest.raises(ValueError, match="takes activation 'none' or 'nvfp4'"):
        gpu.fp4_linear(_x(), nv, "mxfp4")
    with pytest.raises(ValueError, match="activation 'none' takes none"):
        gpu.fp4_linear(_x(), nv, "none", torch.tensor(1.0))
    with pytest.raises(ValueError, match="needs the calibrated input_scale"):
        gpu.rmsnorm_quantize(_x(), None, 1e-6, "fp8_static_per_tensor")
    with pytest.raises(ValueError, match="unknown activation format 'int8'"):
        gpu.rmsnorm_quantize(_x(), None, 1e-6, "int8")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_triton_path_agrees_with_the_reference():
    from tests.kernels.triton_setup import DEVICE  # sets TRITON_INTERPRET=1 without a GPU

    x = _x()
    assert gpu.use_triton(x.to(DEVICE))
    qw, w_scale = fp8_quantize_per_channel(_w())
    out = gpu.fp8_linear(x.to(DEVICE), qw.to(DEVICE), w_scale.to(DEVICE))
    torch.testing.assert_close(out.cpu(), torch_refs.fp8_linear_ref(x, qw, w_scale), rtol=1e-4, atol=1e-4)
    act = gpu.rmsnorm_quantize(x.to(DEVICE), None, 1e-6, "mxfp4")
    assert torch.equal(act.data.cpu(), torch_refs.quantize_mxfp4_ref(x).data)
