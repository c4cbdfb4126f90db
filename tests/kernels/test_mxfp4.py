"""MXFP4: layout, padding, the FLOOR scale rule, properties, and bit-exactness with torchao's MXTensor."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.kernels.fp4 import e2m1_decode, unpack_fp4
from kiln.kernels.mxfp4 import (
    Mxfp4Weight,
    e8m0_to_float32,
    mxfp4_block_scales,
    mxfp4_dequantize,
    mxfp4_fake_quantize,
    mxfp4_quantize,
    padded_in_features,
)
from tests.kernels.fp4_cases import GRID, bits, half_step, spread_weight

torch.set_num_threads(1)





def _element_scales(q: Mxfp4Weight) -> torch.Tensor:
    return e8m0_to_float32(q.scale_e8m0).repeat_interleave(32, dim=1)



# ---- layout and scale rule ----------------------------------------------------------------------------


def test_layout_with_padding_k172():
    w = spread_weight(8, 172)
    q = mxfp4_quantize(w)
    assert q.in_features == 172 and q.padded_in_features == 192 and q.out_features == 8
    tensors = q.tensors()
    assert set(tensors) == {"weight", "weight_scale"}
    assert tensors["weight"].dtype == torch.uint8 and tensors["weight"].shape == (8, 96)
    assert tensors["weight_scale"].dtype == torch.uint8 and tensors["weight_scale"].shape == (8, 6)
    assert not unpack_fp4(q.packed)[:, 172:].any()
    deq = mxfp4_dequantize(q)
    assert deq.shape == (8, 172) and deq.dtype == torch.float32 and deq.is_contiguous()
    padded = mxfp4_quantize(torch.nn.functional.pad(w, (0, 20)))
    assert torch.equal(padded.packed, q.packed) and torch.equal(padded.scale_e8m0, q.scale_e8m0)


def test_tensors_round_trip_through_from_tensors():
    q = mxfp4_quantize(spread_weight(4, 172))
    rebuilt = Mxfp4Weight.from_tensors(q.tensors(), in_features=172)
    assert torch.equal(mxfp4_dequantize(rebuilt), mxfp4_dequantize(q))
    with pytest.raises(ValueError, match="missing.*weight_scale"):
        Mxfp4Weight.from_tensors({"weight": q.packed}, in_features=172)
    with pytest.raises(ValueError, match="unexpected.*bias"):
        Mxfp4Weight.from_tensors(dict(q.tensors(), bias=q.packed), in_features=172)
    with pytest.raises(ValueError, match="packed must be"):
        Mxfp4Weight.from_tensors(q.tensors(), in_features=100)
    with pytest.raises(ValueError, match="255"):
        Mxfp4Weight(q.packed, torch.full_like(q.scale_e8m0, 255), 172)


@pytest.mark.parametrize(
    ("amax", "code"),
    [
        (1.0, 125),  # floor(log2 1) - 2 = -2
        (6.0, 127),  # floor(log2 6) - 2 = 0
        (7.99, 127),  # still 2^0: 7.99 saturates to 6 (the FLOOR rule's known clipping)
        (8.0, 128),
        (0.0, 0),  # clamped to 2^-127
        (2.0**-125, 0),  # floor(log2) - 2 = -127
        (2.0**-124, 1),
        (3.0e38, 252),
    ],
)
def test_scale_is_floor_log2_amax_minus_2(amax, code):
    w = torch.zeros(1, 32)
    w[0, 5] = -amax
    assert int(mxfp4_block_scales(w)[0, 0]) == code


def test_floor_rule_saturates_values_between_6_and_8():
    w = torch.zeros(1, 32)
    w[0, :3] = torch.tensor([7.99, -7.0, 5.5])
    assert mxfp4_fake_quantize(w)[0, :3].tolist() == [6.0, -6.0, 6.0]


def test_e8m0_to_float32_is_exact_for_every_code():
    codes = torch.arange(255, dtype=torch.uint8)
    expected = torch.tensor([math.ldexp(1.0, c - 127) for c in range(255)], dtype=torch.float32)
    assert torch.equal(bits(e8m0_to_float32(codes)), bits(expected))


# ---- properties -------------------------------------------------------------------------------------


@st.composite
def random_mxfp4(draw, canonical: bool = False):
    """Any valid Mxfp4Weight whose padding codes are +0 and whose values stay finite (scale <= 252).

    canonical: every block also holds a +-4 or +-6, so its scale is the one quantize would choose.
    """
    rows = draw(st.integers(1, 3))
    in_features = draw(st.integers(1, 100))
    seed = draw(st.integers(0, 2**32 - 1))
    generator = torch.Generator().manual_seed(seed)
    padded = padded_in_features(in_features)
    codes = torch.randint(0, 16, (rows, padded), dtype=torch.uint8, generator=generator)
    if canonical:
        for block_start in range(0, padded, 32):
            width = min(32, in_features - block_start)
            column = block_start + int(torch.randint(0, width, (), generator=generator))
            codes[:, column] = torch.tensor([6, 7, 14, 15], dtype=torch.uint8)[
                torch.randint(0, 4, (rows,), generator=generator)
            ]
    codes[:, in_features:] = 0
    scales = torch.randint(0, 253, (rows, padded // 32), dtype=torch.uint8, generator=generator)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return Mxfp4Weight(packed, scales, in_features)


@settings(max_examples=60, deadline=None)
@given(random_mxfp4())
def test_quantize_of_dequantize_is_identity_given_the_scales(q):
    again = mxfp4_quantize(mxfp4_dequantize(q), scale_e8m0=q.scale_e8m0)
    assert torch.equal(again.packed, q.packed)


@settings(max_examples=60, deadline=None)
@given(random_mxfp4(canonical=True))
def test_quantize_of_dequantize_is_identity_for_canonical_blocks(q):
    again = mxfp4_quantize(mxfp4_dequantize(q))
    assert torch.equal(again.scale_e8m0, q.scale_e8m0)
    assert torch.equal(again.packed, q.packed)


@st.composite
def random_weight(draw):
    rows = draw(st.integers(1, 4))
    cols = draw(st.integers(1, 100))
    seed = draw(st.integers(0, 2**32 - 1))
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=generator) * 10.0 ** draw(st.floats(-30, 30))
    w[:, ::3] *= 10.0 ** draw(st.floats(-8, 0))
    return w


@settings(max_examples=60, deadline=None)
@given(random_weight())
def test_dequantized_values_lie_on_the_grid_times_the_scale(w):
    q = mxfp4_quantize(w)
    deq = mxfp4_dequantize(q)
    scale = _element_scales(q)[:, : w.shape[1]]
    codes = unpack_fp4(q.packed)[:, : w.shape[1]]
    assert torch.equal(bits(deq), bits(e2m1_decode(codes) * scale))
    assert ((GRID * scale[..., None]) == deq.abs()[..., None]).any(dim=-1).all()


@settings(max_examples=60, deadline=None)
@given(random_weight())
def test_error_is_at_most_half_a_grid_step_times_the_scale(w):
    q = mxfp4_quantize(w)
    error = (w - mxfp4_dequantize(q)).abs()
    scale = _element_scales(q)[:, : w.shape[1]]
    assert (error <= half_step(w.abs() / scale) * scale).all()  # power-of-two scales: no rounding slack


@settings(max_examples=40, deadline=None)
@given(random_weight())
def test_fake_quantize_equals_dequantize_of_quantize(w):
    expected = mxfp4_dequantize(mxfp4_quantize(w))
    assert torch.equal(bits(mxfp4_fake_quantize(w)), bits(expected))
    stacked = torch.stack([w, w]).unsqueeze(1)
    assert torch.equal(
        bits(mxfp4_fake_quantize(stacked)), bits(torch.stack([expected, expected]).unsqueeze(1))
    )


# ---- errors -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("w", "error", "match"),
    [
        (torch.tensor(1.0), ValueError, "at least 2"),
        (torch.ones(32), ValueError, "at least 2"),
        (torch.ones(2, 2, 32), ValueError, "2-D"),
        (torch.ones(2, 0), ValueError, "empty"),
        (torch.tensor([[1.0, float("nan")]]), ValueError, "finite"),
        (torch.tensor([[1.0, -float("inf")]]), ValueError, "finite"),
        (torch.ones(2, 32, dtype=torch.float64), TypeError, "dtype"),
        ([[1.0]], TypeError, "Tensor"),
    ],
)
def test_quantize_rejects_bad_weights(w, error, match):
    with pytest.raises(error, match=match):
        mxfp4_quantize(w)


def test_quantize_rejects_bad_scales():
    w = torch.ones(2, 40)
    mxfp4_quantize(w, scale_e8m0=torch.full((2, 2), 127, dtype=torch.uint8))
    with pytest.raises(ValueError, match="shape"):
        mxfp4_quantize(w, scale_e8m0=torch.full((2, 1), 127, dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        mxfp4_quantize(w, scale_e8m0=torch.ones(2, 2))
    with pytest.raises(ValueError, match="255"):
        mxfp4_quantize(w, scale_e8m0=torch.full((2, 2), 255, dtype=torch.uint8))
    with pytest.raises(ValueError, match="finite"):
        mxfp4_quantize(w * float("nan"), scale_e8m0=torch.full((2, 2), 127, dtype=torch.uint8))


def test_fake_quantize_and_block_scales_reject_bad_input():
    with pytest.raises(ValueError, match="at least 1"):
        mxfp4_fake_quantize(torch.tensor(2.0))
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4_block_scales(torch.ones(2, 16))
    with pytest.raises(TypeError, match="Mxfp4Weight"):
        mxfp4_dequantize(torch.ones(2, 16, dtype=torch.uint8))


# ---- torchao 0.18 -----------------------------------------------------------------------------------
# torchao's MXTensor.to_mx (default ScaleCalculationMode.FLOOR) agrees bit for bit: packed codes, E8M0
# scale bytes and dequantized values. The one difference is scale code 0 (2^-127, a float32 subnormal;
# only blocks with amax < 2^-124): torchao divides by 2^-126 when quantizing but multiplies by 2^-127 when
# dequantizing, so its codes for such a block come out too small; Kiln uses 2^-127 both ways.


def _torchao_mx(w: torch.Tensor):
    pytest.importorskip("torchao")
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    return MXTensor.to_mx(w, torch.float4_e2m1fn_x2, block_size=32)


@pytest.mark.parametrize(
    ("rows", "cols", "dtype"), [(64, 512, torch.float32), (32, 256, torch.bfloat16), (3, 32, torch.float32)]
)
def test_matches_torchao_mxtensor(rows, cols, dtype):
    w = spread_weight(rows, cols, seed=cols)
    w[0, :32] = 0  # an all-zero block: scale code 0 in both, codes 0
    w[1, :32] = 7.5  # saturates under FLOOR in both
    w = w.to(dtype)
    q = mxfp4_quantize(w)
    reference = _torchao_mx(w)
    assert torch.equal(q.packed, reference.qdata.view(torch.uint8))
    assert torch.equal(q.scale_e8m0, reference.scale.view(torch.uint8))
    assert torch.equal(bits(mxfp4_dequantize(q)), bits(reference.dequantize(torch.float32)))


def test_scale_code_0_differs_from_torchao():
    w = torch.zeros(1, 32)
    w[0, 0] = 2.0**-125  # scale code 0: 2^-127
    q = mxfp4_quantize(w)
    reference = _torchao_mx(w)
    assert int(q.scale_e8m0[0, 0]) == int(reference.scale.view(torch.uint8)[0, 0]) == 0
    assert float(mxfp4_dequantize(q)[0, 0]) == 2.0**-125  # code 6: 4 * 2^-127, exact
    assert float(reference.dequantize(torch.float32)[0, 0]) == 2.0**-126  # torchao: code 4, 2 * 2^-127
