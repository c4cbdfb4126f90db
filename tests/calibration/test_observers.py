"""InputObserver: batch-wise statistics equal the ones computed on all inputs at once; padding rows are skipped."""

from __future__ import annotations

import torch

from calibration.observers import InputObserver


def test_statistics_match_the_whole_batch():
    x = torch.randn(300, 24) * torch.linspace(0.1, 3, 24)
    obs = InputObserver(24, max_samples=50)
    for chunk in x.split(37):
        obs.update(torch.cat([chunk, torch.zeros(5, 24)]).unsqueeze(0))  # [1, T, K]; zero rows: padding
    assert obs.tokens == 300
    torch.testing.assert_close(obs.hessian, (x.double().T @ x.double()) / 300)
    torch.testing.assert_close(obs.abs_mean, x.abs().mean(0))
    assert float(obs.absmax) == float(x.abs().max())
    sample = obs.sample
    assert sample.shape == (50, 24)
    rows = {tuple(r.tolist()) for r in x}
    assert all(tuple(r.tolist()) in rows for r in sample)  # every kept row is a real input row


def test_reservoir_is_deterministic_and_spread():
    x = torch.arange(1000, dtype=torch.float32).unsqueeze(1).expand(-1, 4) + 1
    a, b = InputObserver(4, max_samples=100), InputObserver(4, max_samples=100)
    for chunk in x.split(64):
        a.update(chunk)
        b.update(chunk)
    assert torch.equal(a.sample, b.sample)
    assert float(a.sample[:, 0].max()) > 500  # later rows get in, not only the first 100
