"""MXFP6 (E2M3): the element encoding against torchao bit for bit, the 4-in-3 packing, the layout, and quantize /
dequantize round trips."""

import pytest
import torch

from kiln.kernels.mxfp4 import mxfp4_block_scales
from kiln.kernels.mxfp6 import (
    E2M3_MAX,
    E2M3_VALUES,
    Mxfp6Weight,
    e2m3_decode,
    e2m3_encode,
    mxfp6_dequantize,
    mxfp6_quantize,
    pack_fp6,
    unpack_fp6,
)
from tests.kernels.fp4_cases import bits, spread_weight


def _ties_and_neighbours() -> torch.Tensor:
    values = torch.tensor(E2M3_VALUES[:32])
    mids = (values[1:] + values[:-1]) / 2  # exact in fp32: every tie
    near = torch.cat([mids, torch.nextafter(mids, torch.zeros(())), torch.nextafter(mids, torch.full((), 9.0)), values,
                      torch.tensor([7.74, 7.75, 7.76, 8.0, 1e30, float("inf"), 1e-45, 0.0])])
    return torch.cat([near, -near])


def test_e2m3_grid():
    assert E2M3_VALUES[:9] == (0.0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)
    assert E2M3_VALUES[16] == 2.0 and E2M3_VALUES[24] == 4.0 and E2M3_VALUES[31] == E2M3_MAX == 7.5
    assert str(E2M3_VALUES[32]) == "-0.0" and E2M3_VALUES[63] == -7.5


def test_encode_rounds_ties_to_even_and_saturates():
    x = torch.tensor([0.0625, 0.1875, 1.0625, 1.1875, 2.125, 7.74, 7.76, 100.0, -0.0, -0.0625, float("inf")])
    assert e2m3_decode(e2m3_encode(x)).tolist() == [0.0, 0.25, 1.0, 1.25, 2.0, 7.5, 7.5, 7.5, -0.0, -0.0, 7.5]
    assert e2m3_encode(torch.tensor([-0.0])).item() == 32  # the sign survives


def test_encode_rejects_nan():
    with pytest.raises(ValueError, match="NaN"):
        e2m3_encode(torch.tensor([1.0, float("nan")]))


def test_encode_and_decode_match_torchao_bit_for_bit():
    pytest.importorskip("torchao")
    from torchao.prototype.mx_formats.kernels import f6_e2m3_unpacked_to_f32, f32_to_f6_e2m3_unpacked

    g = torch.Generator().manual_seed(0)
    patterns = torch.randint(-(2**31), 2**31 - 1, (1_000_000,), generator=g, dtype=torch.int64).to(torch.int32)
    samples = patterns.view(torch.float32)
    for x in (samples[~torch.isnan(samples)], _ties_and_neighbours(), torch.randn(100_000, generator=g) * 3):
        assert torch.equal(e2m3_encode(x), f32_to_f6_e2m3_unpacked(x))
    codes = torch.arange(64, dtype=torch.uint8)
    assert torch.equal(bits(e2m3_decode(codes)), bits(f6_e2m3_unpacked_to_f32(codes)))


def test_pack_puts_four_codes_in_three_bytes_low_bits_first():
    codes = torch.tensor([[1, 2, 3, 63]], dtype=torch.uint8)
    word = 1 | 2 << 6 | 3 << 12 | 63 << 18
    assert pack_fp6(codes).tolist() == [[word & 255, word >> 8 & 255, word >> 16]]
    every = torch.randint(0, 64, (5, 128), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    assert torch.equal(unpack_fp6(pack_fp6(every)), every)
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_fp6(every[:, :6])
    with pytest.raises(ValueError, match="0..63"):
        pack_fp6(every | 64)


def test_layout_with_padding_k172():
    q = mxfp6_quantize(spread_weight(3, 172, seed=0))
    assert q.packed.shape == (3, 192 * 3 // 4) and q.scale_e8m0.shape == (3, 6)
    assert mxfp6_dequantize(q).shape == (3, 172)
    assert torch.equal(unpack_fp6(q.packed)[:, 172:], torch.zeros(3, 20, dtype=torch.uint8))  # padding: code 0
    with pytest.raises(ValueError, match=r"packed must be \[N, 144\]"):
        Mxfp6Weight(q.packed[:, :-3], q.scale_e8m0, 172)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_of_dequantize_is_identity_and_values_lie_on_the_grid(dtype):
    w = spread_weight(16, 256, seed=3).to(dtype)
    q = mxfp6_quantize(w)
    again = mxfp6_quantize(mxfp6_dequantize(q))
    assert torch.equal(again.packed, q.packed) and torch.equal(again.scale_e8m0, q.scale_e8m0)
    assert torch.equal(q.scale_e8m0, mxfp4_block_scales(w.float()))  # floor(log2 amax) - 2, as MXFP4's
    scale = 2.0 ** (q.scale_e8m0.float() - 127).repeat_interleave(32, dim=1)
    on_grid = mxfp6_dequantize(q) / scale
    assert torch.isin(on_grid, torch.tensor(E2M3_VALUES)).all()
    # round to nearest: within half a step of the grid at the value's exponent (the saturating top aside)
    x = w.float() / scale
    step = torch.where(x.abs() < 1, 0.125, 2.0 ** torch.floor(torch.log2(x.abs().clamp(min=1))) / 8)
    inside = x.abs() <= E2M3_MAX
    assert ((on_grid - x).abs()[inside] <= step[inside] / 2).all()


def test_matches_torchao_mxtensor():
    pytest.importorskip("torchao")
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    w = spread_weight(64, 512, seed=5)
    w[0, :32] = 0
    w[1, :32] = 7.9  # saturates to 7.5 times the scale in both
    q = mxfp6_quantize(w)
    reference = MXTensor.to_mx(w, "fp6_e2m3", block_size=32)
    assert torch.equal(q.scale_e8m0, reference.scale.view(torch.uint8))
    assert torch.equal(bits(mxfp6_dequantize(q)), bits(reference.dequantize(torch.float32)))


def test_error_is_near_fp8s_and_far_below_fp4s():
    from kiln.kernels.fp8 import fp8_dequantize, fp8_quantize_per_channel
    from kiln.kernels.mxfp4 import mxfp4_dequantize, mxfp4_quantize

    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(2))

    def error(d):
        return float((d - w).norm() / w.norm())

    e6 = error(mxfp6_dequantize(mxfp6_quantize(w)))
    assert error(mxfp4_dequantize(mxfp4_quantize(w))) > 3.5 * e6
    assert e6 < 1.3 * error(fp8_dequantize(*fp8_quantize_per_channel(w)))
