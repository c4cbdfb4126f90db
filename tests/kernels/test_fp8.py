"""FP8 E4M3 references against torch's own float8 casts."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import fp8

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
    q, scale = fp8.fp8_quantize_per_tensor(w, torch.tensor(1.0))  # static scale: 1000 saturates to 448
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
    q, scale = fp8.fp8_quantize_per_tensor(value, torch.tensor(1.0))
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
