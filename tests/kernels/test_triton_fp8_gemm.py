"""FP8 W8A8 GEMM against the fp32 reference (dequantize both operands, matmul).

Tolerance: 1e-4 of the output's largest magnitude (E4M3 products are exact in fp32; only the order of the sums
and where the scales are applied differ). bf16 outputs add their own rounding (triton_setup.py
`output_rounding`)."""

from __future__ import annotations

import pytest
import torch

# triton_setup first: it skips without Triton and sets TRITON_INTERPRET before any kernel is defined
# isort: off
from tests.kernels.triton_setup import DEVICE, output_rounding, relative_max_error
from kiln.kernels.fp8 import fp8_quantize_per_channel, fp8_quantize_per_tensor
from kiln.kernels.torch_refs import fp8_gemm_ref, fp8_linear_ref
from kiln.kernels.triton_fp8_gemm import fp8_gemm, fp8_linear
from kiln.kernels.triton_quant import quantize_fp8
# isort: on

torch.set_num_threads(1)
TOL = 1e-4


def _weight(n: int, k: int, per_channel: bool):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1)) * torch.logspace(-1, 0.5, n)[:, None]
    return fp8_quantize_per_channel(w) if per_channel else fp8_quantize_per_tensor(w)


def _x(m: int, k: int, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(m, k, generator=torch.Generator().manual_seed(2)) * 2).to(dtype)


@pytest.mark.parametrize("m,n,k", [(1, 64, 64), (20, 72, 160)])
@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("split_k", [1, 2])
def test_gemm_matches_dequantized_matmul(m, n, k, per_channel, split_k):
    qw, w_scale = _weight(n, k, per_channel)
    act = quantize_fp8(_x(m, k).to(DEVICE))
    config = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": split_k, "num_warps": 4,
              "num_stages": 1}
    out = fp8_gemm(act.data, act.scale, qw.to(DEVICE), w_scale.to(DEVICE), out_dtype=torch.float32,
                   config=config)
    ref = fp8_gemm_ref(act.data.cpu(), act.scale.cpu(), qw, w_scale)
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert relative_max_error(out.cpu(), ref) <= TOL


@pytest.mark.parametrize("static", [False, True])
def test_linear_quantizes_activations_as_the_runtime_does(static):
    qw, w_scale = _weight(48, 96, per_channel=True)
    x = _x(7, 96)
    input_scale = torch.tensor(0.011) if static else None
    out = fp8_linear(x.to(DEVICE), qw.to(DEVICE), w_scale.to(DEVICE),
                     None if input_scale is None else input_scale.to(DEVICE))
    ref = fp8_linear_ref(x, qw, w_scale, input_scale)
    assert relative_max_error(out.cpu(), ref) <= TOL


def test_bf16_activations_and_output():
    qw, w_scale = _weight(32, 64, per_channel=True)
    x = _x(3, 64, torch.bfloat16).reshape(3, 1, 64)  # leading dims are kept
    out = fp8_linear(x.to(DEVICE), qw.to(DEVICE), w_scale.to(DEVICE))
    ref = fp8_linear_ref(x, qw, w_scale)
    assert out.shape == (3, 1, 32) and out.dtype == torch.bfloat16
    assert relative_max_error(out.cpu(), ref) <= output_rounding(torch.bfloat16) + TOL


def test_bad_shapes_and_dtypes_are_refused():
    qw, w_scale = _weight(32, 64, per_channel=True)
    act = quantize_fp8(_x(2, 64).to(DEVICE))
    with pytest.raises(ValueError, match="K dimensions differ"):
        fp8_gemm(act.data, act.scale, qw[:, :32].contiguous().to(DEVICE), w_scale.to(DEVICE))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        fp8_gemm(act.data.float(), act.scale, qw.to(DEVICE), w_scale.to(DEVICE))
    with pytest.raises(ValueError, match="w_scale must have one value or 32"):
        fp8_gemm(act.data, act.scale, qw.to(DEVICE), torch.ones(5, device=DEVICE))
