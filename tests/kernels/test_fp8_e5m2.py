"""FP8 E5M2 weight-only: the format's reference, and everything else reaching it through the registry alone
(parse, targets, the runtime's layout check, calibration's grid, the weight pass's checks)."""

import pytest
import torch

from kiln.calibration.grids import WeightLayout
from kiln.calibration.quantize import quantize_weight, stored_layout
from kiln.kernels.errors import KilnError
from kiln.kernels.fp8_e5m2 import E5M2_MAX, FP8_E5M2_FORMAT, fp8_e5m2_dequantize, fp8_e5m2_quantize
from kiln.kernels.registry import parse_weight_format, quantized_spellings, weight_format
from kiln.kernels.targets import get_target
from kiln.runtime.weights import dequantize_weight

ENTRY = {"format": "fp8_e5m2", "activation": "none"}


def _w(n=8, k=40, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def test_per_channel_reference_is_the_e5m2_cast_of_w_over_its_row_scale():
    w = _w()
    w[3] = 0.0
    q, scale = fp8_e5m2_quantize(w)
    assert q.dtype == torch.float8_e5m2 and scale.shape == (8, 1)
    assert scale[3, 0] == 1.0  # an all-zero row
    expected_scale = w.abs().amax(dim=1, keepdim=True) / E5M2_MAX
    torch.testing.assert_close(scale[[0, 1, 2, 4]], expected_scale[[0, 1, 2, 4]], rtol=0, atol=0)
    assert torch.equal(q.view(torch.uint8), (w / scale).to(torch.float8_e5m2).view(torch.uint8))
    back = fp8_e5m2_dequantize(q, scale)
    assert (back - w).abs().le(2.0**-3 * w.abs() + 1e-30).all()  # 2 mantissa bits: half a step is 2^-3 relative
    assert back.abs().amax(dim=1).equal(w.abs().amax(dim=1))  # each row's maximum is exact (scale onto 57344)


def test_per_tensor_and_saturation():
    w = _w()
    q, scale = fp8_e5m2_quantize(w, "per_tensor")
    assert scale.ndim == 0
    big = torch.tensor([[1e9, -1e9, 1.0]])
    q, _ = fp8_e5m2_quantize(big, "per_tensor")
    assert torch.isfinite(q.float()).all()
    with pytest.raises(TypeError, match="float8_e5m2"):
        fp8_e5m2_dequantize(q.view(torch.uint8), torch.ones(()))


def test_the_registry_line_makes_it_a_weight_format_everywhere():
    assert weight_format("fp8_e5m2") is FP8_E5M2_FORMAT
    assert parse_weight_format("fp8_e5m2") == "fp8_e5m2"
    assert "fp8_e5m2" in quantized_spellings()
    get_target("hopper").check_weight_only("fp8_e5m2")
    get_target("blackwell").check_weight_only("fp8_e5m2")
    with pytest.raises(KilnError, match="no fp8_e5m2 tensor cores"):
        get_target("blackwell").check_weight_activation("fp8_e5m2")
    assert FP8_E5M2_FORMAT.stored_bytes(64, 32) == 64 * 32 + 4 * 64


def test_runtime_checks_its_stored_layout_and_dequantizes_it():
    stored = FP8_E5M2_FORMAT.quantize(_w())
    tensors = {"m.weight": stored["weight"], "m.weight_scale": stored["weight_scale"]}
    got = dequantize_weight("m", ENTRY, tensors, (8, 40))
    assert torch.equal(got, fp8_e5m2_dequantize(stored["weight"], stored["weight_scale"]))
    e4m3 = {**tensors, "m.weight": stored["weight"].float().to(torch.float8_e4m3fn)}
    with pytest.raises(KilnError, match="m.weight has dtype float8_e4m3fn; an fp8_e5m2 weight must be float8_e5m2"):
        dequantize_weight("m", ENTRY, e4m3, (8, 40))
    with pytest.raises(KilnError, match=r"m.weight_scale has shape \(1, 8\)"):
        dequantize_weight("m", ENTRY, {**tensors, "m.weight_scale": stored["weight_scale"].reshape(1, 8)}, (8, 40))
    with pytest.raises(KilnError, match="missing tensor 'm.weight_scale'"):
        dequantize_weight("m", ENTRY, {"m.weight": stored["weight"]}, (8, 40))


@pytest.mark.parametrize("method", ["rtn", "mse", "gptq"])
def test_calibration_methods_store_values_on_its_grid(method):
    w = _w(16, 64, seed=1)
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(2))
    hessian = x.T @ x / x.shape[0]
    stored = quantize_weight(w, "fp8_e5m2", method=method, hessian=hessian if method != "rtn" else None,
                             act_order=False)
    assert stored["weight"].dtype == torch.float8_e5m2 and stored["weight_scale"].shape == (16, 1)
    values = FP8_E5M2_FORMAT.dequantize(stored)
    layout = stored_layout("fp8_e5m2", stored)
    assert layout == WeightLayout("fp8_e5m2")
    # on the grid: re-rounding with the stored scales changes nothing
    assert torch.equal(layout.quantize(values, layout.scales_from_stored(stored, rows=16)), values)
    rtn = FP8_E5M2_FORMAT.dequantize(FP8_E5M2_FORMAT.quantize(w))
    error = ((values - w) @ hessian * (values - w)).sum()
    assert error <= 1.01 * ((rtn - w) @ hessian * (rtn - w)).sum()  # calibrated: no worse than round to nearest


def test_the_weight_pass_runs_it_weight_only():
    from kiln.passes.weight_quant import WeightQuantization

    assert WeightQuantization(format="fp8_e5m2").weight_format == "fp8_e5m2"
    with pytest.raises(KilnError, match=r"not allowed for fp8_e5m2: Kiln runs it weight-only \(W8A16\)"):
        WeightQuantization(format="fp8_e5m2", activations="dynamic")
