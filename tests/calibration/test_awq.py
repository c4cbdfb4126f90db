"""AWQ search: alpha 0 is plain quantization (so the search never loses to it), the loss it reports is the
output error, and tie groups share one scale."""

from __future__ import annotations

import pytest
import torch

from kiln.calibration.awq import awq_candidate, awq_search
from kiln.calibration.grids import WeightLayout
from kiln.kernels.fp8 import fp8_fake_quantize_per_token


def layer(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1024, 64, generator=g) * (torch.rand(64, generator=g) * 4 + 0.1)
    x[:, 3] *= 20  # an activation outlier channel, what AWQ is for
    return [torch.randn(32, 64, generator=g) * 0.05, torch.randn(48, 64, generator=g) * 0.05], x


def test_search_beats_or_matches_plain_quantization_and_reports_the_output_error():
    weights, x = layer()
    layout = WeightLayout("mxfp4")

    def quantize(w):
        return layout.quantize(w, layout.absmax_scales(w))

    h = x.T @ x / x.shape[0]
    found = awq_search(weights, quantize, x.abs().mean(0), hessian=h)
    assert found.loss <= found.loss_unscaled and found.alpha > 0
    s = found.scale
    direct = sum(float((x @ w.T - (x / s) @ quantize(w * s).T).pow(2).sum()) / x.shape[0] for w in weights)
    assert abs(direct - found.loss) <= 1e-3 * direct
    plain = sum(float((x @ w.T - x @ quantize(w).T).pow(2).sum()) / x.shape[0] for w in weights)
    assert abs(plain - found.loss_unscaled) <= 1e-3 * plain


def test_weight_only_search_on_every_input_row_equals_the_hessian_search():
    """Fewer tokens than channels: the weight-only loss from the rows themselves is tr(D H D^T)."""
    weights, x = layer(2)
    x = x[:48]  # 48 rows, 64 channels
    layout = WeightLayout("fp8")

    def quantize(w):
        return layout.quantize(w, layout.absmax_scales(w))

    by_h = awq_search(weights, quantize, x.abs().mean(0), hessian=x.T @ x / x.shape[0])
    by_rows = awq_search(weights, quantize, x.abs().mean(0), sample=x)
    assert by_rows.alpha == by_h.alpha and by_h.alpha > 0
    assert by_rows.loss == pytest.approx(by_h.loss, rel=1e-4)
    assert by_rows.loss_unscaled == pytest.approx(by_h.loss_unscaled, rel=1e-4)


def test_search_with_quantized_inputs_uses_the_sample():
    weights, x = layer(1)
    layout = WeightLayout("fp8")
    found = awq_search(weights, lambda w: layout.quantize(w, layout.absmax_scales(w)), x.abs().mean(0),
                       sample=x[:256], act_quantize=fp8_fake_quantize_per_token)
    assert found.loss <= found.loss_unscaled


def test_candidate_is_one_at_alpha_zero_and_shared_within_ties():
    mean = torch.rand(16) + 0.1
    assert torch.equal(awq_candidate(mean, 0.0), torch.ones(16))
    tie = torch.arange(16) % 4
    s = awq_candidate(mean, 0.7, tie)
    for group in range(4):
        assert torch.unique(s[tie == group]).numel() == 1
    assert abs(float(s.max() * s.min()) - 1.0) < 1e-5  # normalized


def test_needs_exactly_one_statistic():
    weights, x = layer()
    with pytest.raises(ValueError, match="exactly one"):
        awq_search(weights, lambda w: w, x.abs().mean(0))


@pytest.mark.parametrize("source", ["sample", "hessian"])
def test_sketch_estimates_the_hessian_without_bias(source):
    """S^T S averaged over many sketch rows is H, from the rows or from the Hessian's Cholesky factor."""
    from kiln.calibration.awq import sketch_rows

    _, x = layer(3)
    h = x.T @ x / x.shape[0]
    s = sketch_rows(x, None, 20000) if source == "sample" else sketch_rows(None, h, 20000)
    estimate = s.T @ s / s.shape[0]
    assert float((estimate - h).norm() / h.norm()) < 0.03
    # a small sketch is a noisy estimate, but a seeded one: the same rows every call
    assert torch.equal(sketch_rows(x, None, 16), sketch_rows(x, None, 16))


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_sketched_search_picks_an_alpha_as_good_as_the_exact_one(fmt):
    """The 8B path (there 256 sketch rows for 2048+ channels; here 32 for 64): the alpha it picks, scored
    exactly, keeps most of the exact search's gain over plain quantization, or is within a few percent of its
    loss where there is little gain to keep."""
    layout = WeightLayout(fmt)

    def quantize(w):
        return layout.quantize(w, layout.absmax_scales(w))

    for seed in range(4):
        weights, x = layer(seed)
        h = x.T @ x / x.shape[0]
        exact = awq_search(weights, quantize, x.abs().mean(0), hessian=h)
        for kwargs in ({"hessian": h}, {"sample": x}):
            s = awq_search(weights, quantize, x.abs().mean(0), sketch=32, **kwargs).scale
            true_loss = sum(float((x @ w.T - (x / s) @ quantize(w * s).T).pow(2).sum()) / x.shape[0]
                            for w in weights)
            assert true_loss <= max(1.06 * exact.loss, exact.loss + 0.25 * (exact.loss_unscaled - exact.loss))
    # sketching needs fewer rows than the exact inner dimension; otherwise the loss is exact
    same = awq_search(weights, quantize, x.abs().mean(0), hessian=h, sketch=64)
    assert same.loss == exact.loss
