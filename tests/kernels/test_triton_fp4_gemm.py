"""FP4 GEMMs on NVFP4/MXFP4 bytes against the fp32 reference (dequantize with kernels/nvfp4.py or mxfp4.py,
then matmul).

Tolerance: 1e-4 of the output's largest magnitude (every operand product is exact; the order of the sums and
where NVFP4's global scale is rounded in differ), plus the output dtype's own rounding for bf16/fp16
outputs."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.fp4_cases import spread_weight

# triton_setup first: it skips without Triton and sets TRITON_INTERPRET before any kernel is defined
# isort: off
from tests.kernels.triton_setup import DEVICE, INTERPRET, output_rounding, relative_max_error
from kiln.kernels.mxfp4 import Mxfp4Weight, mxfp4_quantize
from kiln.kernels.nvfp4 import Nvfp4Weight, nvfp4_quantize
from kiln.kernels.torch_refs import fp4_w4a4_ref, fp4_w4a16_ref
from kiln.kernels.triton_fp4_gemm import fp4_w4a4_gemm, fp4_w4a4_linear, fp4_w4a16_gemm
from kiln.kernels.triton_quant import quantize_nvfp4
# isort: on

torch.set_num_threads(1)
TOL = 1e-4
QUANTIZE = {"nvfp4": nvfp4_quantize, "mxfp4": mxfp4_quantize}


def _on_device(weight):
    if isinstance(weight, Nvfp4Weight):
        return Nvfp4Weight(weight.packed.to(DEVICE), weight.block_scale.to(DEVICE),
                           weight.global_scale.to(DEVICE), weight.in_features)
    return Mxfp4Weight(weight.packed.to(DEVICE), weight.scale_e8m0.to(DEVICE), weight.in_features)


def _weight(fmt: str, n: int, k: int):
    return QUANTIZE[fmt](spread_weight(n, k, seed=4) * 50)


def _x(m: int, k: int, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(m, k, generator=torch.Generator().manual_seed(5)) * 2).to(dtype)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("m,n,k", [(1, 64, 64), (20, 40, 168)])  # 168: padded to 176 (NVFP4) / 192 (MXFP4)
@pytest.mark.parametrize("split_k", [1, 2])
def test_w4a16_matches_dequantized_matmul(fmt, m, n, k, split_k):
    weight = _weight(fmt, n, k)
    x = _x(m, k)
    config = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": split_k, "num_warps": 4,
              "num_stages": 1}
    out = fp4_w4a16_gemm(x.to(DEVICE), _on_device(weight), config=config)
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert relative_max_error(out.cpu(), fp4_w4a16_ref(x, weight)) <= TOL


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w4a16_half_precision_activations(fmt, dtype):
    weight = _weight(fmt, 48, 96)
    x = _x(4, 96, dtype).reshape(2, 2, 96)
    out = fp4_w4a16_gemm(x.to(DEVICE), _on_device(weight))
    assert out.shape == (2, 2, 48) and out.dtype == dtype
    assert relative_max_error(out.cpu(), fp4_w4a16_ref(x, weight)) <= output_rounding(dtype) + TOL


@pytest.mark.parametrize("fmt,static", [("nvfp4", False), ("nvfp4", True), ("mxfp4", False)])
def test_w4a4_dequantize_then_dot_path(fmt, static):
    weight = _weight(fmt, 40, 168)
    x = _x(20, 168)
    input_scale = torch.tensor(0.004) if static else None
    scale_arg = None if input_scale is None else input_scale.to(DEVICE)
    out = fp4_w4a4_linear(x.to(DEVICE), _on_device(weight), scale_arg, dot_scaled=False)
    assert relative_max_error(out.cpu(), fp4_w4a4_ref(x, weight, input_scale)) <= TOL


def test_w4a4_mxfp4_dot_scaled():
    # Triton's interpreter runs tl.dot_scaled for E8M0 scales; on Hopper Triton emulates it, on Blackwell it
    # is the native block-scaled MMA.
    weight = _weight("mxfp4", 40, 168)
    x = _x(20, 168)
    out = fp4_w4a4_linear(x.to(DEVICE), _on_device(weight), dot_scaled=True)
    assert relative_max_error(out.cpu(), fp4_w4a4_ref(x, weight)) <= TOL


@pytest.mark.skipif(INTERPRET, reason="Triton 3.9's interpreter decodes every tl.dot_scaled scale as E8M0, "
                    "so NVFP4's E4M3 scales are misread; this runs on a CUDA GPU (compute capability 10)")
def test_w4a4_nvfp4_dot_scaled_on_gpu():
    if torch.cuda.get_device_capability()[0] < 10:
        pytest.skip("tl.dot_scaled with E4M3 (NVFP4) scales needs Blackwell (compute capability 10)")
    weight = _weight("nvfp4", 256, 512)
    x = _x(128, 512)
    out = fp4_w4a4_linear(x.to(DEVICE), _on_device(weight), dot_scaled=True)
    assert relative_max_error(out.cpu(), fp4_w4a4_ref(x, weight)) <= TOL


def test_mismatched_formats_and_shapes_are_refused():
    nv, mx = _on_device(_weight("nvfp4", 32, 64)), _on_device(_weight("mxfp4", 32, 64))
    act = quantize_nvfp4(_x(2, 64).to(DEVICE))
    with pytest.raises(ValueError, match="same FP4 format"):
        fp4_w4a4_gemm(act, mx, torch.float32)
    with pytest.raises(ValueError, match="in_features is 64"):
        fp4_w4a16_gemm(_x(2, 32).to(DEVICE), nv)
    with pytest.raises(TypeError, match="Nvfp4Weight or an Mxfp4Weight"):
        fp4_w4a16_gemm(_x(2, 64).to(DEVICE), torch.zeros(32, 32))
    with pytest.raises(ValueError, match="no per-tensor scale"):
        fp4_w4a4_linear(_x(2, 64).to(DEVICE), mx, torch.tensor(1.0, device=DEVICE))
