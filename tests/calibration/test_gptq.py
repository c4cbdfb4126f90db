"""GPTQ on the FP8 and E2M1 grids: it lowers the layer's output error against round-to-nearest, its act-order
permutation is undone exactly, and what it returns is exactly what the stored format holds."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kiln.calibration.gptq import (
    _inverse_cholesky_upper,
    _reverse_in_place,
    gptq_quantize,
    output_error,
    permute_symmetric_,
    rtn_quantize,
)
from kiln.calibration.grids import WeightLayout
from kiln.calibration.scale_search import mse_scales
from kiln.passes.linear_quant import quantize_linear_weight

FORMATS = ("fp8", "nvfp4", "mxfp4", "mxfp6")


def correlated_layer(n_out=48, k=72, tokens=2048, seed=0):
    """A random weight and inputs with correlated channels and a few loud ones (what GPTQ exploits)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k**0.5 + torch.eye(k)
    x = torch.randn(tokens, k, generator=g) @ mix
    x[:, :4] *= 6.0
    w = torch.randn(n_out, k, generator=g) * 0.05
    return w, x


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_lowers_output_error_against_round_to_nearest(fmt, act_order):
    w, x = correlated_layer()
    h = x.T @ x / x.shape[0]
    layout = WeightLayout(fmt)
    rtn = layout.quantize(w, layout.absmax_scales(w))
    res = gptq_quantize(w, h, layout, act_order=act_order, scales="absmax")

    def err(q):
        return float((x @ w.T - x @ q.T).pow(2).sum())

    assert err(res.values) < 0.8 * err(rtn)
    assert res.loss == pytest.approx(err(res.values) / x.shape[0], rel=1e-4)  # the loss is that error


@pytest.mark.parametrize("fmt", FORMATS)
def test_gptq_values_are_exactly_what_the_format_stores(fmt):
    w, x = correlated_layer(k=70)  # K not a multiple of 16/32: the block formats pad
    res = gptq_quantize(w, x.T @ x, WeightLayout(fmt), act_order=False, scales="mse")
    stored = quantize_linear_weight(w, fmt, method="gptq", hessian=x.T @ x, act_order=False)
    assert torch.equal(stored.dequantize(), res.values)
    assert stored.method == "gptq"


@pytest.mark.parametrize("fmt", FORMATS)
def test_act_order_permutation_is_restored(fmt):
    """With a diagonal Hessian nothing propagates, so GPTQ in any order is round-to-nearest with its static
    scales: equal values, column for column, prove the permutation is undone."""
    w, _ = correlated_layer(k=64)
    diag = torch.rand(64, generator=torch.Generator().manual_seed(3)) + 0.1  # distinct: a real permutation
    layout = WeightLayout(fmt)
    res = gptq_quantize(w, torch.diag(diag), layout, act_order=True, scales="mse")
    expected = layout.quantize(w, mse_scales(layout, w, diag))
    assert torch.equal(res.values, expected)
    assert not torch.equal(torch.argsort(diag, descending=True), torch.arange(64))


def test_dynamic_scales_follow_the_updated_weights_and_stay_stored():
    w, x = correlated_layer(k=80)
    layout = WeightLayout("nvfp4")
    res = gptq_quantize(w, x.T @ x, layout, act_order=False, static_scales=False)
    assert torch.equal(layout.quantize(res.values, res.scales), res.values)  # on its own grid
    assert res.scales.stored["weight_scale"].shape == (w.shape[0], 5)


def test_rtn_quantize_and_output_error_agree():
    w, x = correlated_layer()
    h = x.T @ x / x.shape[0]
    res = rtn_quantize(w, WeightLayout("mxfp4"), h, "mse")
    assert res.loss == pytest.approx(output_error(w, res.values, h))
    assert res.loss <= rtn_quantize(w, WeightLayout("mxfp4"), h, "absmax").loss


def test_bad_inputs_raise_with_the_values():
    w, x = correlated_layer(k=32)
    with pytest.raises(ValueError, match="hessian"):
        gptq_quantize(w, torch.eye(31), WeightLayout("fp8"))
    with pytest.raises(ValueError, match="static scales"):
        gptq_quantize(w, x.T @ x, WeightLayout("nvfp4"), act_order=True, static_scales=False)
    with pytest.raises(ValueError, match="scales='max'"):
        gptq_quantize(w, x.T @ x, WeightLayout("nvfp4"), scales="max")


@pytest.mark.parametrize("fmt", FORMATS)
def test_siblings_quantized_together_equal_one_by_one(fmt):
    """q/k/v (one Hessian) go through one stacked GPTQ: rows are independent, so the stored tensors are the
    ones each weight gets alone (NVFP4 with the siblings' shared per-tensor scale)."""
    from kiln.calibration.quantize import shared_global_scales
    from kiln.passes.linear_quant import quantize_sibling_weights

    w, x = correlated_layer(n_out=80, k=64)
    parts = list(w.split([32, 16, 32]))
    h = x.T @ x / x.shape[0]
    g = shared_global_scales(dict(enumerate(parts)), dict.fromkeys(range(3), "qkv")).get(0)
    together = quantize_sibling_weights(parts, fmt, method="gptq", hessian=h, global_scale=g)
    for part, qw in zip(parts, together, strict=True):
        alone = quantize_linear_weight(part, fmt, method="gptq", hessian=h, global_scale=g)
        assert qw.tensors.keys() == alone.tensors.keys()
        for key, value in alone.tensors.items():
            assert torch.equal(qw.tensors[key].view(torch.uint8) if value.dtype.itemsize == 1 else qw.tensors[key],
                               value.view(torch.uint8) if value.dtype.itemsize == 1 else value), key


def test_large_siblings_are_quantized_one_by_one(monkeypatch):
    """Above STACK_BYTES the siblings are not stacked (memory), with the same stored values."""
    import kiln.passes.linear_quant as wq

    w, x = correlated_layer(n_out=64, k=64)
    parts, h = list(w.split([32, 32])), x.T @ x / x.shape[0]
    stacked = wq.quantize_sibling_weights(parts, "fp8", method="gptq", hessian=h)
    calls = []
    original = wq.quantize_linear_weight
    monkeypatch.setattr(wq, "quantize_linear_weight", lambda w_, *a, **k: calls.append(w_.shape) or original(w_, *a, **k))
    monkeypatch.setattr(wq, "STACK_BYTES", 4 * w.numel() - 1)
    alone = wq.quantize_sibling_weights(parts, "fp8", method="gptq", hessian=h)
    assert calls == [(32, 64), (32, 64)]
    for a, b in zip(stacked, alone, strict=True):
        assert torch.equal(a.dequantize(), b.dequantize())


@pytest.mark.parametrize("k, tokens", [(7, 40), (72, 30), (257, 2048)])
def test_inverse_cholesky_factor_matches_the_reference_route(k, tokens):
    """U with H^-1 = U^T U from the reversed factorization (potrf, trtri) equals the reference GPTQ route
    (factor, invert, factor the inverse) in float64, to fp32 precision, rank-deficient Hessians included."""
    _, x = correlated_layer(k=k, tokens=tokens, seed=k)
    h = (x.T @ x / tokens).double()
    h.diagonal().add_(0.01 * h.diagonal().mean())
    ref = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    a = h.float().flip(0, 1).contiguous()  # J H J
    upper = _inverse_cholesky_upper(a, a.diagonal().clone(), float(h.diagonal().mean()))
    assert upper.data_ptr() == a.data_ptr()  # factored in the buffer given
    assert torch.equal(upper, upper.triu())
    assert float((upper.double() - ref).abs().max()) <= 1e-4 * float(ref.abs().max())
    assert torch.allclose(upper.double().T @ upper.double(), torch.linalg.inv(h), rtol=1e-3, atol=1e-4 * float(ref.abs().max()) ** 2)


def test_inverse_cholesky_factor_adds_damping_until_positive_definite():
    """An indefinite H (rank 2 of 6, less a little on the diagonal): failed factorizations are undone in place
    from the untouched triangle, so the factor found is bit for bit the one of a fresh copy damped by the
    extra that succeeded."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, generator=g)
    h = x.T @ x
    mean = float(h.diagonal().mean())
    h.diagonal().sub_(5e-4 * mean)  # needs an extra of more than 5e-4 of the mean diagonal: several retries
    a = h.flip(0, 1).contiguous()
    upper = _inverse_cholesky_upper(a, a.diagonal().clone(), mean)
    with pytest.raises(torch.linalg.LinAlgError):
        torch.linalg.cholesky(h.double())
    fresh = []
    for n in range(7):  # the extras tried: 0, then 1e-6, 1e-5, ... of the mean diagonal
        b = h.flip(0, 1).contiguous()
        try:
            fresh.append(_inverse_cholesky_upper(b, b.diagonal() + 10.0 ** (n - 6) * mean, float("nan")))
        except ValueError:
            continue
        break
    assert fresh and torch.equal(upper, fresh[0])


@pytest.mark.parametrize("k", [1, 2, 7, 300])
def test_permute_symmetric_in_place_matches_the_gather(k):
    g = torch.Generator().manual_seed(k)
    a = torch.randn(k, k, generator=g)
    for perm in (torch.arange(k), torch.arange(k).flip(0), torch.randperm(k, generator=g),
                 torch.roll(torch.arange(k), 1)):  # identity, reversal, random cycles, one long cycle
        b = a.clone()
        out = permute_symmetric_(b, perm, rows=16)
        assert out.data_ptr() == b.data_ptr() and torch.equal(b, a[perm][:, perm])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("act_order", [True, False])
def test_gptq_consuming_the_hessian_is_bit_identical(fmt, act_order):
    """consume_hessian factors in the observer's own buffer: the same values and scales as the copy route,
    and the buffer is spent (the result holds no Hessian)."""
    w, x = correlated_layer(seed=3)
    h = x.T @ x / x.shape[0]
    layout = WeightLayout(fmt)
    static = None if act_order or fmt == "fp8" else False
    ref = gptq_quantize(w, h, layout, act_order=act_order, static_scales=static)
    buffer = h.clone()
    got = gptq_quantize(w, buffer, layout, act_order=act_order, static_scales=static, consume_hessian=True)
    assert torch.equal(got.values, ref.values) and got.hessian is None
    assert all(torch.equal(got.scales.stored[n], t) for n, t in ref.scales.stored.items())
    assert not torch.equal(buffer, h)


@pytest.mark.parametrize("shape", [(1, 1), (3, 3), (5, 7), (64, 64)])
def test_reverse_in_place_flips_both_axes(shape):
    a = torch.randn(shape)
    expected = a.flip(0, 1)
    _reverse_in_place(a, chunk=4)  # small chunks: several of them, and a partial last one
    assert torch.equal(a, expected)


def test_the_factorizations_give_the_same_bits_on_one_and_two_blas_threads():
    # OpenBLAS's blocked potrf splits its updates among its threads, so without gptq.one_blas_thread U's last
    # bits (and after them GPTQ's grid points) followed the thread count: at K = 1024 they differed
    from threadpoolctl import threadpool_limits

    from kiln.calibration.gptq import cholesky_in_place

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 1024, generator=g)
    h = x.T @ x / x.shape[0]
    found = {}
    for threads in (1, 2):
        with threadpool_limits(limits=threads, user_api="blas"):
            a = h.clone()
            u = _inverse_cholesky_upper(a, torch.diagonal(h) + 0.01, float(torch.diagonal(h).mean()))
            c = h.clone()
            assert cholesky_in_place(c)
            found[threads] = (u.clone(), c.clone())
    assert torch.equal(found[1][0], found[2][0])
    assert torch.equal(found[1][1], found[2][1])


def test_gptq_factors_with_openblas_avx2_kernels_on_every_x86_cpu():
    # left to choose, OpenBLAS runs SkylakeX kernels on AVX-512 CPUs and Haswell/Zen ones elsewhere, and their
    # factors differ in the last bits; optimize (and this test session, tests/conftest.py) pins the Haswell ones
    import scipy.linalg  # noqa: F401  (loads scipy's OpenBLAS)
    from threadpoolctl import threadpool_info

    from kiln.optimizer.numerics import has_avx2

    if not has_avx2(confirmed=True):
        pytest.skip("not an x86-64 CPU seen to have AVX2: OpenBLAS is left to choose")
    if os.environ.get("OPENBLAS_CORETYPE") != "Haswell":
        pytest.skip("OPENBLAS_CORETYPE was set before the pin: a user's variable wins")
    scipy_blas = [i for i in threadpool_info() if i["internal_api"] == "openblas"
                  and Path(i["filepath"]).name.startswith("libscipy_openblas-")]  # numpy's: libscipy_openblas64_
    if not scipy_blas:
        pytest.skip("scipy is not linked to OpenBLAS here")
    assert {i["architecture"] for i in scipy_blas} == {"Haswell"}
