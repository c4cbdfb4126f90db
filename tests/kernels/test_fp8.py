"""FP8 E4M3 references against torch's own float8 casts."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.kernels import fp8

torch.set_num_threads(1)


def test_per_channel_matches_torch_cast_bit_exactly():
    w = torch.randn(32, 48, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 32)[:, None]
    q, scale = fp8.fp8_quantize_per_channel(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (32, 1)
    expected_scale = w.abs().amax(dim=1, keepdim=True) / 448.0
    torch.testing.assert_close(scale, expected_scale, rtol=0, atol=0)
    expected = (w / expected_scale).to(torch.float8_e4m3fn)
    assert torch.equal(q.view(torch.uint8), expected.view(torch.uint8))
    # every row uses the full range: its max maps to exactly 448
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((32,), 448.0))


def test_per_tensor_and_saturation():
    w = torch.tensor([[0.0, 1.0, -2.0, 1000.0]])
    q, _scale = fp8.fp8_quantize_per_tensor(w, torch.tensor(1.0))  # static scale: 1000 saturates to 448
    assert q.float().tolist() == [[0.0, 1.0, -2.0, 448.0]]
    assert not torch.isnan(q.float()).any()


def test_zero_rows_get_unit_scale():
    q, scale = fp8.fp8_quantize_per_channel(torch.zeros(3, 4))
    assert torch.equal(scale, torch.ones(3, 1)) and torch.equal(q.float(), torch.zeros(3, 4))


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 255))
def test_every_e4m3_value_round_trips(code):
    value = torch.tensor([code], dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    if torch.isnan(value).any():
        return
    q, _scale = fp8.fp8_quantize_per_tensor(value, torch.tensor(1.0))
    assert torch.equal(q.float(), value)


def test_dynamic_per_token_error_bound():
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    y = fp8.fp8_fake_quantize_per_token(x)
    # E4M3 has 3 mantissa bits: relative rounding error <= 2^-4 for normal values
    amax = x.abs().amax(dim=-1, keepdim=True)
    assert ((y - x).abs() <= x.abs() * 2**-4 + amax / 448 * 2**-6 + 1e-12).all()


def test_wrong_inputs_raise():
    with pytest.raises(ValueError, match="2-D"):
        fp8.fp8_quantize_per_channel(torch.zeros(3))
    with pytest.raises(TypeError):
        fp8.fp8_dequantize(torch.zeros(2), torch.tensor(1.0))


def _block_reference(q: torch.Tensor, scale: torch.Tensor, bm: int, bn: int) -> torch.Tensor:
    """Element by block: w[n, k] = float(q[n, k]) * scale[n // bm, k // bn] (plain loops over the blocks)."""
    out = torch.empty(q.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn] = (q[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn].float()
                                                             * scale[i, j].float())
    return out


@pytest.mark.parametrize("shape, block", [((64, 96), (16, 32)), ((40, 72), (16, 32)), ((24, 64), (128, 128)),
                                          ((1, 1), (128, 128)), ((130, 7), (128, 3))])
def test_block_quantize_and_dequantize_match_a_block_loop(shape, block):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(*shape, generator=g) * torch.logspace(-2, 1, shape[0])[:, None]
    q, scale = fp8.fp8_quantize_blocks(w, block)
    rows, cols = -(-shape[0] // block[0]), -(-shape[1] // block[1])
    assert q.dtype == torch.float8_e4m3fn and q.shape == shape and scale.shape == (rows, cols)
    for i in range(rows):  # a partial edge block's scale is its own max / 448, padding aside
        for j in range(cols):
            part = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            assert float(scale[i, j]) == float(part.abs().max().float() / 448.0)
    got = fp8.fp8_block_dequantize(q, scale, block)
    assert got.dtype == torch.float32 and torch.equal(got, _block_reference(q, scale, *block))
    # within half an e4m3 step: 2^-4 relative, or half the smallest subnormal (2^-10) times the block's scale
    s = scale.repeat_interleave(block[0], 0)[: shape[0]].repeat_interleave(block[1], 1)[:, : shape[1]]
    assert bool(((got - w).abs() <= torch.maximum(w.abs() * 2**-4, s * 2**-10)).all())


def test_block_dequantize_takes_ue8m0_scales_and_all_zero_blocks():
    q = torch.ones(4, 4).to(torch.float8_e4m3fn)
    scale = torch.tensor([[0.25, 4.0], [2.0**-20, 1.0]]).to(torch.float8_e8m0fnu)
    got = fp8.fp8_block_dequantize(q, scale, (2, 2))
    assert got.tolist() == [[0.25] * 2 + [4.0] * 2] * 2 + [[2.0**-20] * 2 + [1.0] * 2] * 2
    zq, zs = fp8.fp8_quantize_blocks(torch.zeros(3, 5), (2, 2))
    assert torch.equal(zs, torch.ones(2, 3)) and not fp8.fp8_block_dequantize(zq, zs, (2, 2)).any()


def test_block_dequantize_refuses_a_wrong_grid_or_dtype():
    q = torch.zeros(40, 72).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"must have shape \(3, 3\), got \(2, 3\)"):
        fp8.fp8_block_dequantize(q, torch.ones(2, 3), (16, 32))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        fp8.fp8_block_dequantize(q.float(), torch.ones(3, 3), (16, 32))
    with pytest.raises(ValueError, match="two positive integers"):
        fp8.fp8_block_dequantize(q, torch.ones(3, 3), (16, 0))
