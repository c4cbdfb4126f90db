"""NVFP4: ModelOpt export layout, padding, properties, and bit-exactness with torchao's NVFP4Tensor."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.kernels.fp4 import e2m1_decode, unpack_fp4
from kiln.kernels.nvfp4 import (
    E4M3_MIN_SUBNORMAL,
    Nvfp4Weight,
    nvfp4_block_scales,
    nvfp4_dequantize,
    nvfp4_fake_quantize,
    nvfp4_global_scale,
    nvfp4_quantize,
    padded_in_features,
)
from tests.kernels.fp4_cases import GRID, bits, half_step, spread_weight

torch.set_num_threads(1)





def _element_scales(q: Nvfp4Weight) -> torch.Tensor:
    """float32 scale of every (padded) element: float32(block_scale) * global_scale, [N, Kp]."""
    return (q.block_scale.float() * q.global_scale).repeat_interleave(16, dim=1)



# ---- layout -----------------------------------------------------------------------------------------


def test_layout_with_padding_k172():
    w = spread_weight(8, 172)
    q = nvfp4_quantize(w)
    assert q.in_features == 172 and q.padded_in_features == 176 and q.out_features == 8
    tensors = q.tensors()
    assert set(tensors) == {"weight", "weight_scale", "weight_scale_2"}
    assert tensors["weight"].dtype == torch.uint8 and tensors["weight"].shape == (8, 88)
    assert tensors["weight_scale"].dtype == torch.float8_e4m3fn and tensors["weight_scale"].shape == (8, 11)
    assert tensors["weight_scale_2"].dtype == torch.float32 and tensors["weight_scale_2"].shape == ()
    # the 4 padding columns are +0 codes, and dequantize drops them
    assert not unpack_fp4(q.packed)[:, 172:].any()
    deq = nvfp4_dequantize(q)
    assert deq.shape == (8, 172) and deq.dtype == torch.float32 and deq.is_contiguous()
    # the padded tensor quantizes to the same bytes
    padded = nvfp4_quantize(torch.nn.functional.pad(w, (0, 4)))
    assert torch.equal(padded.packed, q.packed)
    assert torch.equal(padded.block_scale.view(torch.uint8), q.block_scale.view(torch.uint8))


def test_tensors_round_trip_through_from_tensors():
    q = nvfp4_quantize(spread_weight(4, 172))
    rebuilt = Nvfp4Weight.from_tensors(q.tensors(), in_features=172)
    assert torch.equal(nvfp4_dequantize(rebuilt), nvfp4_dequantize(q))
    one_element = dict(q.tensors(), weight_scale_2=q.global_scale.reshape(1))
    assert Nvfp4Weight.from_tensors(one_element, in_features=172).global_scale.shape == ()
    with pytest.raises(ValueError, match="missing.*weight_scale_2"):
        Nvfp4Weight.from_tensors({"weight": q.packed, "weight_scale": q.block_scale}, in_features=172)
    with pytest.raises(ValueError, match="unexpected.*input_scale"):
        Nvfp4Weight.from_tensors(dict(q.tensors(), input_scale=q.global_scale), in_features=172)
    with pytest.raises(ValueError, match="packed must be"):
        Nvfp4Weight.from_tensors(q.tensors(), in_features=200)


def test_global_scale_is_amax_over_6_times_448():
    w = spread_weight(4, 64)
    g = nvfp4_global_scale(w)
    assert g.dtype == torch.float32 and g.shape == ()
    assert torch.equal(g, w.abs().amax() / 2688.0)
    assert float(nvfp4_global_scale(torch.zeros(3, 16))) == 1.0
    q = nvfp4_quantize(torch.zeros(3, 20))
    assert not nvfp4_dequantize(q).any()
    assert (q.block_scale.float() == 1.0).all()  # ModelOpt's scale for an all-zero block


def test_block_scales_follow_modelopt():
    g = torch.tensor(0.5)
    w = torch.zeros(1, 64)
    w[0, 0:16] = 6.0 * 448 * 0.5  # block amax / (6 g) = 448: the largest E4M3 value
    w[0, 16] = 6.0 * 0.5 * 0.1  # 0.1 rounds to the nearest E4M3 value, 0.1015625
    w[0, 32] = 1e-9  # far below the smallest E4M3 subnormal: floored at 2^-9, never 0
    # w[0, 48:64] stays zero: scale 1.0
    scales = nvfp4_block_scales(w, g).float()
    assert scales.tolist() == [[448.0, 0.1015625, E4M3_MIN_SUBNORMAL, 1.0]]
    assert float(nvfp4_block_scales(w * 10, g)[0, 0].float()) == 448.0  # clamped, not NaN


def test_explicit_smaller_global_scale_clips():
    w = spread_weight(2, 32)
    natural = nvfp4_global_scale(w)
    q = nvfp4_quantize(w, global_scale=natural / 4)
    assert (q.block_scale.float() <= 448).all()
    assert nvfp4_dequantize(q).abs().max() <= w.abs().max()


# ---- properties -------------------------------------------------------------------------------------


@st.composite
def random_nvfp4(draw):
    """Any valid Nvfp4Weight whose padding codes are +0: random codes, positive E4M3 block scales."""
    rows = draw(st.integers(1, 4))
    in_features = draw(st.integers(1, 72))
    seed = draw(st.integers(0, 2**32 - 1))
    generator = torch.Generator().manual_seed(seed)
    padded = padded_in_features(in_features)
    codes = torch.randint(0, 16, (rows, padded), dtype=torch.uint8, generator=generator)
    codes[:, in_features:] = 0
    # E4M3 bytes 0x01..0x7e: every positive finite value, subnormals included
    scale_bytes = torch.randint(1, 0x7F, (rows, padded // 16), dtype=torch.uint8, generator=generator)
    global_scale = torch.tensor(2.0 ** draw(st.floats(-20, 4)), dtype=torch.float32)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return Nvfp4Weight(packed, scale_bytes.view(torch.float8_e4m3fn), global_scale, in_features)


@settings(max_examples=60, deadline=None)
@given(random_nvfp4())
def test_quantize_of_dequantize_is_identity_given_the_scales(q):
    again = nvfp4_quantize(nvfp4_dequantize(q), global_scale=q.global_scale, block_scale=q.block_scale)
    assert torch.equal(again.packed, q.packed)
    assert torch.equal(again.block_scale.view(torch.uint8), q.block_scale.view(torch.uint8))
    assert torch.equal(again.global_scale, q.global_scale)


@st.composite
def random_weight(draw):
    rows = draw(st.integers(1, 4))
    cols = draw(st.integers(1, 80))
    seed = draw(st.integers(0, 2**32 - 1))
    generator = torch.Generator().manual_seed(seed)
    magnitude = 10.0 ** draw(st.floats(-6, 3))
    w = torch.randn(rows, cols, generator=generator) * magnitude
    # some blocks far smaller than the tensor's amax exercise subnormal block scales
    w[:, ::3] *= 10.0 ** draw(st.floats(-8, 0))
    return w


@settings(max_examples=60, deadline=None)
@given(random_weight())
def test_dequantized_values_lie_on_the_grid_times_the_scale(w):
    q = nvfp4_quantize(w)
    deq = nvfp4_dequantize(q)
    scale = _element_scales(q)[:, : w.shape[1]]
    codes = unpack_fp4(q.packed)[:, : w.shape[1]]
    assert torch.equal(bits(deq), bits(e2m1_decode(codes) * scale))
    on_grid = ((GRID * scale[..., None]) == deq.abs()[..., None]).any(dim=-1)
    assert on_grid.all()


@settings(max_examples=60, deadline=None)
@given(random_weight())
def test_error_is_at_most_half_a_grid_step_times_the_scale(w):
    q = nvfp4_quantize(w)
    error = (w - nvfp4_dequantize(q)).abs()
    scale = _element_scales(q)[:, : w.shape[1]]
    bound = half_step(w.abs() / scale) * scale
    assert (error <= bound * (1 + 1e-6)).all()


@settings(max_examples=40, deadline=None)
@given(random_weight())
def test_fake_quantize_equals_dequantize_of_quantize(w):
    expected = nvfp4_dequantize(nvfp4_quantize(w))
    assert torch.equal(bits(nvfp4_fake_quantize(w)), bits(expected))
    # leading dimensions share the per-tensor scale
    stacked = torch.stack([w, w])
    assert torch.equal(bits(nvfp4_fake_quantize(stacked)), bits(torch.stack([expected, expected])))


def test_fake_quantize_with_a_given_global_scale_matches_quantize():
    x = spread_weight(3, 40).reshape(3, 1, 40)
    g = torch.tensor(1e-4)
    expected = nvfp4_dequantize(nvfp4_quantize(x.reshape(3, 40), global_scale=g)).reshape(3, 1, 40)
    assert torch.equal(bits(nvfp4_fake_quantize(x, global_scale=g)), bits(expected))
    assert torch.equal(bits(nvfp4_fake_quantize(x, global_scale=1e-4)), bits(expected))
    assert nvfp4_fake_quantize(torch.randn(7)).shape == (7,)


def test_bfloat16_input_quantizes_like_its_float32_value():
    w = spread_weight(4, 64).bfloat16()
    a, b = nvfp4_quantize(w), nvfp4_quantize(w.float())
    assert torch.equal(a.packed, b.packed) and torch.equal(a.global_scale, b.global_scale)


# ---- errors -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("w", "error", "match"),
    [
        (torch.tensor(1.0), ValueError, "at least 2"),
        (torch.ones(16), ValueError, "at least 2"),
        (torch.ones(2, 2, 16), ValueError, "2-D"),
        (torch.ones(0, 16), ValueError, "empty"),
        (torch.tensor([[1.0, float("nan")]]), ValueError, "finite"),
        (torch.tensor([[1.0, float("inf")]]), ValueError, "finite"),
        (torch.ones(2, 16, dtype=torch.int32), TypeError, "dtype"),
    ],
)
def test_quantize_rejects_bad_weights(w, error, match):
    with pytest.raises(error, match=match):
        nvfp4_quantize(w)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan"), torch.ones(2), True, "1"])
def test_quantize_rejects_bad_global_scales(bad):
    with pytest.raises((ValueError, TypeError), match="global_scale"):
        nvfp4_quantize(torch.ones(2, 16), global_scale=bad)


def test_quantize_rejects_bad_block_scales():
    w = torch.ones(2, 20)
    good = torch.ones(2, 2).to(torch.float8_e4m3fn)
    nvfp4_quantize(w, block_scale=good)
    with pytest.raises(ValueError, match="shape"):
        nvfp4_quantize(w, block_scale=torch.ones(2, 1).to(torch.float8_e4m3fn))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        nvfp4_quantize(w, block_scale=torch.ones(2, 2))
    with pytest.raises(ValueError, match="positive"):
        nvfp4_quantize(w, block_scale=torch.zeros(2, 2).to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="NaN"):
        nvfp4_quantize(w, block_scale=torch.full((2, 2), float("nan")).to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="finite"):
        nvfp4_quantize(torch.full((2, 20), float("inf")), global_scale=1.0, block_scale=good)


def test_fake_quantize_and_block_scales_reject_bad_input():
    with pytest.raises(ValueError, match="at least 1"):
        nvfp4_fake_quantize(torch.tensor(1.0))
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4_block_scales(torch.ones(2, 20), 1.0)
    with pytest.raises(TypeError, match="Nvfp4Weight"):
        nvfp4_dequantize(torch.ones(2, 8, dtype=torch.uint8))


# ---- torchao 0.18 -----------------------------------------------------------------------------------
# torchao's NVFP4Tensor takes per_tensor_scale = amax / (448 * 6) (its `per_tensor_amax_to_scale`),
# the same value as ModelOpt's weight_scale_2, so we feed it our global scale. What differs:
#   - torchao floors block scales at 2^-6, the smallest E4M3 *normal*; ModelOpt and Kiln use 1.0 for an
#     all-zero block and floor others at 2^-9, the smallest subnormal. Codes and values still agree on
#     all-zero blocks; blocks that need a scale below 2^-6 are quantized more coarsely by torchao.
#   - torchao scales elements as w * ((1 / g) / s) and computes s from amax / 6 / g; ModelOpt and Kiln use
#     w / (s * g) and amax / (6 * g). For float32 data these agree except within an ulp of a rounding
#     midpoint. bfloat16 weights, with 8 significant bits, often land *exactly* on a midpoint (1.75, 3.5,
#     ...): w / (s * g) then rounds to the even code, while torchao's reciprocal is an ulp off and rounds
#     to the odd neighbour. The bfloat16 case below checks that every code that differs is such an exact tie.
MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def _torchao_nvfp4(w: torch.Tensor, g: torch.Tensor):
    pytest.importorskip("torchao")
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor

    return NVFP4Tensor.to_nvfp4(w, block_size=16, per_tensor_scale=g)


@pytest.mark.parametrize(("rows", "cols"), [(64, 512), (3, 16)])
def test_matches_torchao_nvfp4tensor(rows, cols):
    w = spread_weight(rows, cols, seed=cols)
    q = nvfp4_quantize(w)
    reference = _torchao_nvfp4(w, q.global_scale)
    assert float(q.block_scale.float().min()) >= 2.0**-6  # inside the range where the floors agree
    assert torch.equal(q.packed, reference.qdata.view(torch.uint8))
    assert torch.equal(q.block_scale.view(torch.uint8), reference.scale.view(torch.uint8))
    assert torch.equal(bits(nvfp4_dequantize(q)), bits(reference.dequantize(torch.float32)))


def test_bfloat16_differs_from_torchao_only_on_exact_ties():
    w = spread_weight(32, 256, seed=256).bfloat16()
    q = nvfp4_quantize(w)
    reference = _torchao_nvfp4(w, q.global_scale)
    assert torch.equal(q.block_scale.view(torch.uint8), reference.scale.view(torch.uint8))
    ours, theirs = unpack_fp4(q.packed), unpack_fp4(reference.qdata.view(torch.uint8))
    scaled = w.float() / _element_scales(q)  # what Kiln (and ModelOpt) rounds
    differs = ours != theirs
    assert differs.any()  # otherwise this test checks nothing
    assert torch.isin(scaled[differs].abs(), MIDPOINTS).all()
    assert (ours[differs] % 2 == 0).all()  # Kiln's tie went to the even code
    same = ~differs
    assert torch.equal(bits(nvfp4_dequantize(q)[same]), bits(reference.dequantize(torch.float32)[same]))


def test_zero_blocks_differ_from_torchao_only_in_the_scale_byte():
    w = spread_weight(4, 64)
    w[:, 16:32] = 0
    q = nvfp4_quantize(w)
    reference = _torchao_nvfp4(w, q.global_scale)
    assert (q.block_scale[:, 1].float() == 1.0).all()
    assert (reference.scale[:, 1].float() == 2.0**-6).all()
    assert torch.equal(q.packed, reference.qdata.view(torch.uint8))
    assert torch.equal(bits(nvfp4_dequantize(q)), bits(reference.dequantize(torch.float32)))


# ---- NVIDIA ModelOpt (optional; `pip install .[anchors]`) -------------------------------------------


@pytest.mark.modelopt
def test_matches_modelopt_nvfp4qtensor():
    qtensor = pytest.importorskip("modelopt.torch.quantization.qtensor")
    w = spread_weight(16, 172, seed=3)
    w[:, 32:48] = 0
    quantized, block_scale, global_scale = qtensor.NVFP4QTensor.quantize(w, 16)
    q = nvfp4_quantize(w)
    assert torch.equal(q.packed, quantized._quantized_data)
    assert torch.equal(q.block_scale.view(torch.uint8), block_scale.view(torch.uint8))
    assert torch.equal(q.global_scale, global_scale.float().reshape(()))
