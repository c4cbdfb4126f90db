"""The MXFP6 W6A16 GEMM on the packed bytes against the fp32 reference (kernels/mxfp6.py's dequantize, then
matmul). Tolerance: 1e-4 of the output's largest magnitude (every operand product is exact; only the order of the
sums differs), plus the output dtype's own rounding for bf16/fp16 outputs."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.fp4_cases import spread_weight

# triton_setup first: it skips without Triton and sets TRITON_INTERPRET before any kernel is defined
# isort: off
from tests.kernels.triton_setup import DEVICE, output_rounding, relative_max_error
from kiln.kernels.mxfp6 import Mxfp6Weight, mxfp6_quantize
from kiln.kernels.torch_refs import fp6_w6a16_ref
from kiln.kernels.triton_fp6_gemm import fp6_w6a16_gemm
# isort: on

torch.set_num_threads(1)
TOL = 1e-4


def _weight(n: int, k: int) -> Mxfp6Weight:
    q = mxfp6_quantize(spread_weight(n, k, seed=4) * 50)
    return Mxfp6Weight(q.packed.to(DEVICE), q.scale_e8m0.to(DEVICE), q.in_features)


@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 64), (5, 33, 172), (17, 64, 256), (2, 8, 40)])
def test_w6a16_matches_the_reference(m, n, k):
    # K = 172 and 40: a padded last block; K = 256: several K tiles, split in two under the interpreter
    weight = _weight(n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k)).to(DEVICE)
    expected = fp6_w6a16_ref(x, weight)
    assert relative_max_error(fp6_w6a16_gemm(x, weight), expected) <= TOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w6a16_in_narrow_dtypes(dtype):
    weight = _weight(24, 128)
    x = torch.randn(3, 2, 128, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    got = fp6_w6a16_gemm(x, weight)
    assert got.dtype == dtype and got.shape == (3, 2, 24)
    expected = fp6_w6a16_ref(x.reshape(-1, 128), weight).reshape(3, 2, 24)
    assert relative_max_error(got, expected) <= TOL + output_rounding(dtype)


def test_w6a16_refuses_a_wrong_width_and_a_small_tile():
    weight = _weight(8, 64)
    with pytest.raises(ValueError, match="in_features is 64"):
        fp6_w6a16_gemm(torch.randn(2, 65).to(DEVICE), weight)
    for block_k in (32, 96):
        with pytest.raises(ValueError, match="power of two of at least 64"):
            fp6_w6a16_gemm(torch.randn(2, 64).to(DEVICE), weight, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": block_k,
                                                                   "SPLIT_K": 1, "num_warps": 4, "num_stages": 1})
