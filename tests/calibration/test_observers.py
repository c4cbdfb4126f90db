"""InputObserver: batch-wise statistics equal the ones computed on all inputs at once; padding rows are skipped;
non-finite inputs and reading an observer that saw no token are one-line KilnErrors."""

from __future__ import annotations

import pytest
import torch

from kiln.calibration.observers import InputObserver
from kiln.kernels.errors import KilnError


def test_statistics_match_the_whole_batch():
    x = torch.randn(300, 24) * torch.linspace(0.1, 3, 24)
    obs = InputObserver(24, max_samples=50)
    for chunk in x.split(37):
        obs.update(torch.cat([chunk, torch.zeros(5, 24)]).unsqueeze(0))  # [1, T, K]; zero rows: padding
    assert obs.tokens == 300
    assert obs.hessian.dtype == torch.float32  # a running mean, rescaled in place batch by batch
    torch.testing.assert_close(obs.hessian.double(), (x.double().T @ x.double()) / 300, rtol=2e-6, atol=1e-6)
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


# --- bad input: one-line KilnErrors, never a ValueError traceback --------------------------------------------
def _refused(call, match: str) -> str:
    with pytest.raises(KilnError) as info:
        call()
    message = str(info.value)
    assert match in message and "\n" not in message, message
    return message


def test_non_finite_inputs_name_the_linear():
    name = "model.layers.0.mlp.down_proj"
    for bad in (float("inf"), float("-inf"), float("nan")):  # a NaN row is not padding
        obs = InputObserver(4, name=name)
        obs.update(torch.randn(3, 4))
        x = torch.randn(2, 5, 4)
        x[1, 2, 3] = bad
        _refused(lambda obs=obs, x=x: obs.update(x),
                 f"calibration inputs of linear {name} are not finite (NaN or Inf): the checkpoint's activations "
                 "overflow float32")
    _refused(lambda: InputObserver(2).update(torch.tensor([[1.0, float("nan")]])),
             "calibration inputs of a linear are not finite")


def test_an_observer_without_tokens_says_why():
    name = "model.layers.1.self_attn.q_proj"
    never = InputObserver(4, max_samples=8, name=name)
    for read in (lambda: never.hessian, lambda: never.abs_mean, lambda: never.sample):
        _refused(read, f"no calibration token reached linear {name}: the calibration text produced no tokens for "
                       "this layer")
    zeros = InputObserver(4, name=name)
    zeros.update(torch.zeros(2, 3, 4))  # rows that reach it but are all zero (e.g. a norm whose input overflowed)
    _refused(lambda: zeros.abs_mean, f"all 6 calibration input rows of linear {name} are zero, so it has no input "
                                     "statistics (the checkpoint's activations vanish or overflow before it)")


def test_weight_quantization_names_the_linear_its_observers_watch():
    # passes.weight_quant hands each observer its linear's name (what _awq and GPTQ read statistics from)
    from kiln.passes.graph import Linear
    from kiln.passes.weight_quant import WeightQuantization

    lin = Linear("model.layers.0.mlp.down_proj", "down", 4, 4, layer=0)

    class Session:
        def observe(self, names, callback):
            callback(names[0], torch.tensor([[1.0, 2.0, float("inf"), 0.5]]))

    _refused(lambda: WeightQuantization()._observe(Session(), [lin], max_samples=16, rotate=False),
             "calibration inputs of linear model.layers.0.mlp.down_proj are not finite")
    stats = WeightQuantization()._observe(type("Quiet", (), {"observe": lambda self, names, cb: None})(), [lin])
    _refused(lambda: stats[lin.name].abs_mean, "the calibration text produced no tokens for this layer")


def test_rescaled_statistics_are_those_of_the_scaled_inputs():
    """observer.rescale_(s) equals observing x / s (what an AWQ scale folded into a norm feeds the linears)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(200, 16, generator=g) * torch.linspace(0.2, 4, 16)
    s = torch.rand(16, generator=g) + 0.5
    direct, derived = InputObserver(16, max_samples=40), InputObserver(16, max_samples=40)
    for chunk in x.split(64):
        direct.update(chunk / s)
        derived.update(chunk)
    h = derived.hessian
    assert derived.rescale_(s) is derived and derived.hessian is h  # in place
    assert derived.tokens == direct.tokens == 200
    torch.testing.assert_close(derived.hessian, direct.hessian, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(derived.abs_mean, direct.abs_mean, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(derived.absmax, direct.absmax, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="no sample"):
        _ = derived.sample  # dropped: it served the search
    with pytest.raises(ValueError, match="channels"):
        derived.rescale_(torch.ones(3))
