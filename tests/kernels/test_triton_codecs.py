"""The in-kernel format codecs equal the torch references bit for bit (kernels/triton_codecs.py)."""

from __future__ import annotations

import pytest
import torch

# triton_setup first: it skips without Triton and sets TRITON_INTERPRET before any kernel is defined
# isort: off
from tests.kernels.triton_setup import DEVICE, INTERPRET
import triton
import triton.language as tl
from kiln.kernels.fp4 import e2m1_decode as e2m1_decode_ref
from kiln.kernels.fp4 import e2m1_encode as e2m1_encode_ref
from kiln.kernels.mxfp4 import e8m0_to_float32
from kiln.kernels.triton_codecs import e2m1_decode, e2m1_encode, e4m3_decode, e4m3_encode, e8m0_decode
# isort: on

torch.set_num_threads(1)


@triton.jit
def _codec_kernel(x_ptr, code_ptr, e4m3_ptr, back_ptr, e2m1_ptr, e2m1_back_ptr, e8m0_ptr, n,
                  HW_CAST: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    byte = e4m3_encode(tl.minimum(tl.maximum(x, -448.0), 448.0), HW_CAST)
    tl.store(e4m3_ptr + offs, byte, mask=mask)
    tl.store(back_ptr + offs, e4m3_decode(byte), mask=mask)
    tl.store(e2m1_ptr + offs, e2m1_encode(x).to(tl.uint8), mask=mask)
    code = tl.load(code_ptr + offs, mask=mask, other=0).to(tl.int32)
    tl.store(e2m1_back_ptr + offs, e2m1_decode(code & 15), mask=mask)
    tl.store(e8m0_ptr + offs, e8m0_decode(code % 255), mask=mask)


def _inputs() -> torch.Tensor:
    """Every E4M3 value, every midpoint between neighbours (the ties), E2M1's grid and midpoints, random
    values over E4M3's whole range and below it, signed zeros, and values past 448."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = values[torch.isfinite(values)].unique()
    mids = (values[1:] + values[:-1]) / 2
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    e2m1_mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0])
    g = torch.Generator().manual_seed(0)
    rand = torch.randn(20000, generator=g) * torch.exp2(torch.randint(-14, 10, (20000,), generator=g).float())
    edges = torch.tensor([0.0, -0.0, 448.0, 500.0, 1e30, 2.0**-10])
    x = torch.cat([values, mids, grid, e2m1_mids, rand, edges])
    x = torch.cat([x, -x])
    # one float32 ulp either side of every E4M3 midpoint
    return torch.cat([x, torch.nextafter(mids, torch.tensor(1e9)), torch.nextafter(mids, torch.tensor(0.0))])


HW_CAST_ON_GPU = pytest.mark.skipif(INTERPRET, reason="Triton 3.9's interpreter converts fp32 -> float8e4nv "
                                    "wrongly; the hardware cast is checked on a GPU")


@pytest.mark.parametrize("hw_cast", [False, pytest.param(True, marks=HW_CAST_ON_GPU)])
def test_codecs_bit_exact(hw_cast):
    x = _inputs()
    n = x.numel()
    codes = torch.arange(n, dtype=torch.int32) % 256
    dtypes = (torch.uint8, torch.float32, torch.uint8, torch.float32, torch.float32)
    outs = [torch.empty(n, dtype=dt) for dt in dtypes]
    x, codes, outs = x.to(DEVICE), codes.to(DEVICE), [o.to(DEVICE) for o in outs]
    block = 4096
    _codec_kernel[(triton.cdiv(n, block),)](x, codes, *outs, n, HW_CAST=hw_cast, BLOCK=block)
    e4m3, back, e2m1, e2m1_back, e8m0 = (o.cpu() for o in outs)
    x, codes = x.cpu(), codes.cpu()
    ref = x.clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(e4m3, ref.view(torch.uint8))
    assert torch.equal(back, ref.float())
    assert torch.equal(e2m1, e2m1_encode_ref(x))
    bits = lambda t: t.view(torch.int32)
    assert torch.equal(bits(e2m1_back), bits(e2m1_decode_ref((codes & 15).to(torch.uint8))))
    assert torch.equal(bits(e8m0), bits(e8m0_to_float32((codes % 255).to(torch.uint8))))
