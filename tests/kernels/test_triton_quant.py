"""Fused RMSNorm + activation quantization: bytes and scales against kernels/fp8.py, nvfp4.py and mxfp4.py.

Tolerances: without the norm, and against the quantizers applied to the kernel's own normalized y, the bytes
and scales are bit-exact. y itself is within 1e-6 (relative to its largest magnitude) of
runtime.model_weights.RMSNorm; against the quantizers applied to torch's y, at most 1% of the bytes may differ, each
by one code."""

from __future__ import annotations

import pytest
import torch

# triton_setup first: it skips without Triton and sets TRITON_INTERPRET before any kernel is defined
# isort: off
from tests.kernels.triton_setup import DEVICE, relative_max_error
from kiln.kernels.torch_refs import quantize_fp8_ref, quantize_mxfp4_ref, quantize_nvfp4_ref, rmsnorm_ref
from kiln.kernels.triton_quant import quantize_fp8, quantize_mxfp4, quantize_nvfp4
# isort: on

torch.set_num_threads(1)
EPS = 1e-5


def _x(m: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 1, k)[torch.randperm(k, generator=g)]
    x[0, :5] = torch.tensor([0.0, -0.0, 1e-8, -3.0, 3.0])
    return x.to(dtype)


def _norm_weight(k: int) -> torch.Tensor:
    return torch.rand(k, generator=torch.Generator().manual_seed(1)) + 0.5


def _quantize(fmt: str, x, weight, **kw):
    fn, ref = {"fp8": (quantize_fp8, quantize_fp8_ref), "nvfp4": (quantize_nvfp4, quantize_nvfp4_ref),
               "mxfp4": (quantize_mxfp4, quantize_mxfp4_ref)}[fmt]
    return fn(x.to(DEVICE), None if weight is None else weight.to(DEVICE), EPS, return_normed=True, **kw), ref


def _static(fmt: str) -> dict:
    return {"fp8": {"input_scale": torch.tensor(0.0123)}, "nvfp4": {"global_scale": torch.tensor(0.0021)},
            "mxfp4": {}}[fmt]


def _ref_kwargs(fmt: str, static: dict) -> dict:
    return {"input_scale" if fmt == "fp8" else "global_scale": v for v in static.values()}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.cpu()


CASES = [("fp8", False), ("fp8", True), ("nvfp4", False), ("nvfp4", True), ("mxfp4", False)]


@pytest.mark.parametrize("fmt,static", CASES)
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("dtype,k", [(torch.float32, 256), (torch.bfloat16, 200), (torch.float16, 72)])
def test_bit_exact_with_reference_quantizer(fmt, static, norm, dtype, k):
    x = _x(6, k, dtype)
    weight = _norm_weight(k) if norm else None
    kw = _static(fmt) if static else {}
    out, ref_fn = _quantize(fmt, x, weight, **kw)
    y = out.normed.cpu()
    expected = x.float() if not norm else rmsnorm_ref(x, weight, EPS)
    assert relative_max_error(y, expected) <= 1e-6
    if not norm:
        assert torch.equal(y, x.float())
    ref = ref_fn(y, **_ref_kwargs(fmt, kw))
    assert out.data.shape == ref.data.shape and out.data.dtype == ref.data.dtype
    assert torch.equal(_bytes(out.data), _bytes(ref.data))
    assert torch.equal(_bytes(out.scale), _bytes(ref.scale))
    if fmt == "nvfp4":
        assert torch.equal(out.global_scale.cpu(), ref.global_scale)


def _magnitude_steps(a: torch.Tensor, b: torch.Tensor, sign_bit: int) -> torch.Tensor:
    """How many codes apart two same-format codes are (sign-magnitude formats: E4M3 bytes, E2M1 nibbles)."""
    def ordinal(c):
        c = c.long()
        magnitude = c & (sign_bit - 1)
        return torch.where(c & sign_bit != 0, -magnitude, magnitude)
    return (ordinal(a) - ordinal(b)).abs()


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "mxfp4"])
def test_within_one_code_of_torch_rmsnorm_then_quantize(fmt):
    k = 512
    x = _x(8, k, torch.bfloat16, seed=3)
    weight = _norm_weight(k)
    out, ref_fn = _quantize(fmt, x, weight)
    ref = ref_fn(rmsnorm_ref(x, weight, EPS))
    got, want = _bytes(out.data), _bytes(ref.data)
    if fmt == "fp8":
        steps = _magnitude_steps(got, want, 0x80)
        assert torch.allclose(out.scale.cpu(), ref.scale, rtol=1e-6, atol=0)
    else:
        steps = torch.maximum(_magnitude_steps(got & 15, want & 15, 8),
                              _magnitude_steps(got >> 4, want >> 4, 8))
        scale_sign_bit = 0x80 if fmt == "nvfp4" else 256  # E8M0 has no sign
        assert _magnitude_steps(_bytes(out.scale), _bytes(ref.scale), scale_sign_bit).max() <= 1
    assert steps.max() <= 1
    assert (steps > 0).float().mean() <= 0.01


def test_nvfp4_dynamic_global_scale_is_the_whole_tensors():
    x = _x(5, 64, torch.float32)
    x[3] *= 100  # one row holds the tensor's maximum
    out, _ = _quantize("nvfp4", x, None)
    ref = quantize_nvfp4_ref(x)
    assert torch.equal(out.global_scale.cpu(), ref.global_scale)
    assert torch.equal(out.data.cpu(), ref.data)


def test_bad_inputs_are_refused():
    x = _x(2, 64, torch.float32).to(DEVICE)
    with pytest.raises(ValueError, match="norm weight must be"):
        quantize_fp8(x, torch.ones(32, device=DEVICE))
    with pytest.raises(TypeError, match="float32/bfloat16/float16"):
        quantize_mxfp4(x.to(torch.int32))
    with pytest.raises(ValueError, match="2-D"):
        quantize_nvfp4(x[0])
