"""E2M1 encode/decode and nibble packing: exact values, ties to even, bit-exactness with torchao."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.kernels.fp4 import E2M1_MAX, E2M1_VALUES, e2m1_decode, e2m1_encode, pack_fp4, unpack_fp4

torch.set_num_threads(1)

POSITIVE_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _next_float32(value: float, toward: float) -> float:
    return float(torch.nextafter(torch.tensor(value), torch.tensor(toward)))


def _bits(x: torch.Tensor) -> torch.Tensor:
    """float32 bit patterns, so that -0.0 != 0.0 in comparisons."""
    return x.float().contiguous().view(torch.int32)


def test_value_table_is_the_e2m1_grid():
    assert E2M1_VALUES[:8] == POSITIVE_GRID
    assert E2M1_VALUES[8:] == tuple(-v for v in POSITIVE_GRID)
    assert E2M1_MAX == 6.0
    decoded = e2m1_decode(torch.arange(16, dtype=torch.uint8))
    assert decoded.dtype == torch.float32
    assert torch.equal(_bits(decoded), _bits(torch.tensor(E2M1_VALUES)))


def test_every_code_round_trips_through_decode_and_encode():
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(e2m1_encode(e2m1_decode(codes)), codes)  # includes -0.0 -> code 8


@pytest.mark.parametrize(
    ("value", "code"),
    [
        # each midpoint goes to the neighbour with the even code
        (0.25, 0),
        (0.75, 2),
        (1.25, 2),
        (1.75, 4),
        (2.5, 4),
        (3.5, 6),
        (5.0, 6),
        (-0.25, 8),
        (-0.75, 10),
        (-5.0, 14),
        # just off a midpoint goes to the nearer neighbour
        (_next_float32(0.25, 1.0), 1),
        (_next_float32(0.75, 0.0), 1),
        (_next_float32(5.0, 9.0), 7),
        # saturation; no inf in E2M1
        (6.0, 7),
        (6.5, 7),
        (1e30, 7),
        (math.inf, 7),
        (-math.inf, 15),
        # signed zeros and tiny values keep their sign
        (0.0, 0),
        (-0.0, 8),
        (1e-40, 0),
        (-1e-3, 8),
    ],
)
def test_encode_rounds_to_nearest_even_and_saturates(value, code):
    assert int(e2m1_encode(torch.tensor([value]))[0]) == code


@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=-16.0, max_value=16.0, allow_nan=False, width=32))
def test_encode_picks_a_nearest_grid_value(x):
    decoded = float(e2m1_decode(e2m1_encode(torch.tensor([x])))[0])
    clamped = max(-E2M1_MAX, min(E2M1_MAX, x))
    best = min(abs(clamped - v) for v in POSITIVE_GRID + tuple(-v for v in POSITIVE_GRID))
    assert abs(clamped - decoded) == best


def test_encode_accepts_bfloat16_and_float16():
    x = torch.tensor([0.75, -3.5, 100.0])
    expected = e2m1_encode(x)
    assert torch.equal(e2m1_encode(x.bfloat16()), expected)
    assert torch.equal(e2m1_encode(x.half()), expected)


def test_encode_rejects_nan_and_non_float():
    with pytest.raises(ValueError, match="NaN"):
        e2m1_encode(torch.tensor([1.0, float("nan")]))
    with pytest.raises(TypeError, match="dtype"):
        e2m1_encode(torch.tensor([1, 2]))
    with pytest.raises(TypeError, match="Tensor"):
        e2m1_encode([1.0])


def test_pack_puts_element_2i_in_the_low_nibble():
    codes = torch.tensor([[0x1, 0x2, 0xF, 0x0]], dtype=torch.uint8)
    assert pack_fp4(codes).tolist() == [[0x21, 0x0F]]
    assert unpack_fp4(torch.tensor([0x21, 0x0F], dtype=torch.uint8)).tolist() == [1, 2, 15, 0]


@settings(max_examples=100, deadline=None)
@given(
    st.integers(min_value=1, max_value=4),
    st.integers(min_value=1, max_value=24).map(lambda n: 2 * n),
    st.integers(min_value=0, max_value=2**32 - 1),
)
def test_pack_unpack_round_trip(rows, cols, seed):
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, cols), dtype=torch.uint8, generator=generator)
    packed = pack_fp4(codes)
    assert packed.shape == (rows, cols // 2)
    assert torch.equal(unpack_fp4(packed), codes)
    assert torch.equal(pack_fp4(unpack_fp4(packed)), packed)


def test_pack_and_unpack_reject_bad_input():
    with pytest.raises(ValueError, match="even"):
        pack_fp4(torch.zeros(3, 5, dtype=torch.uint8))
    with pytest.raises(ValueError, match="even"):
        pack_fp4(torch.tensor(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="0..15"):
        pack_fp4(torch.tensor([1, 16], dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        pack_fp4(torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(TypeError, match="uint8"):
        unpack_fp4(torch.tensor([1, 2], dtype=torch.int8))
    with pytest.raises(ValueError, match="0-dim"):
        unpack_fp4(torch.tensor(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="0..15"):
        e2m1_decode(torch.tensor([200], dtype=torch.uint8))


# ---- bit-exactness with torchao 0.18 ----------------------------------------------------------------


def _interesting_float32() -> torch.Tensor:
    """Every bfloat16 bit pattern, a million random float32 bit patterns, and the neighbours of every
    midpoint and grid value: all non-NaN."""
    every_bf16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    generator = torch.Generator().manual_seed(0)
    random_bits = torch.randint(-(2**31), 2**31 - 1, (1_000_000,), dtype=torch.int32, generator=generator)
    anchors = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, *POSITIVE_GRID, 2.0**-126, 2.0**-149])
    anchors = torch.cat([anchors, -anchors])
    neighbours = torch.cat(
        [anchors, torch.nextafter(anchors, anchors * 2 + 1), torch.nextafter(anchors, -anchors)]
    )
    x = torch.cat([every_bf16, random_bits.view(torch.float32), neighbours])
    return x[~torch.isnan(x)]


def test_encode_matches_torchao_bit_exactly():
    pytest.importorskip("torchao")
    from torchao.prototype.mx_formats.kernels import f32_to_f4_unpacked

    x = _interesting_float32()
    assert torch.equal(e2m1_encode(x), f32_to_f4_unpacked(x))


def test_decode_matches_torchao_bit_exactly():
    pytest.importorskip("torchao")
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32

    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(_bits(e2m1_decode(codes)), _bits(f4_unpacked_to_f32(codes)))


def test_pack_matches_torchao_nibble_order():
    pytest.importorskip("torchao")
    from torchao.prototype.mx_formats.kernels import pack_uint4, unpack_uint4

    generator = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (8, 64), dtype=torch.uint8, generator=generator)
    assert torch.equal(pack_fp4(codes), pack_uint4(codes))
    assert torch.equal(unpack_fp4(pack_fp4(codes)), unpack_uint4(pack_uint4(codes)))
