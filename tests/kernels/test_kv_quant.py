"""KV-cache formats: the table-driven reads equal the plain formulas bit for bit; quantizing saturates."""

from __future__ import annotations

import torch

from kiln.kernels.kv_fp8 import fp8_kv_dequantize, fp8_kv_quantize, fp8_kv_quantize_per_token
from kiln.kernels.kv_nvfp4 import nvfp4_kv_dequantize, nvfp4_kv_quantize
from kiln.kernels.kv_quant import kv_fake_quantize
from kiln.kernels.nvfp4 import nvfp4_dequantize, nvfp4_quantize

torch.set_num_threads(1)


def _x(n=40, heads=3, dim=32):
    x = torch.randn(n, heads, dim, generator=torch.Generator().manual_seed(0)) * 3
    x[0, 0, 0] = 1e-6  # subnormal territory
    return x


def test_fp8_lookup_equals_float_cast_times_scale_for_every_byte():
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].view(-1, 1, 1).view(torch.float8_e4m3fn)  # every non-NaN pattern
    for scale in (torch.tensor(0.0371), torch.tensor([[0.5], [2.0]]).reshape(1, 2, 1)):
        q = codes.expand(-1, scale.shape[1] if scale.dim() else 1, 1)
        assert torch.equal(fp8_kv_dequantize(q, scale), q.float() * scale)


def test_fp8_kv_quantize_static_per_head_and_per_token():
    x = _x()
    scale = x.abs().amax(dim=(0, 2)).reshape(-1, 1) / 448
    q = fp8_kv_quantize(x, scale)
    assert q.dtype == torch.float8_e4m3fn
    assert torch.equal(fp8_kv_dequantize(q, scale), q.float() * scale)
    assert fp8_kv_quantize(x * 10, scale).float().abs().max() == 448  # saturates, never NaN
    q, token_scale = fp8_kv_quantize_per_token(x)
    assert token_scale.shape == (40, 1, 1)
    assert torch.equal(fp8_kv_dequantize(q, token_scale), q.float() * token_scale)


def test_nvfp4_kv_equals_the_weight_format_on_the_flattened_rows():
    x = _x()
    g = x.abs().amax() / (6 * 448)
    packed, block_scale = nvfp4_kv_quantize(x, g)
    assert packed.shape == (40, 3, 16) and block_scale.shape == (40, 3, 2)
    reference = nvfp4_quantize(x.reshape(120, 32), global_scale=g)
    assert torch.equal(packed.reshape(120, 16), reference.packed)
    assert torch.equal(nvfp4_kv_dequantize(packed, block_scale, g).reshape(120, 32), nvfp4_dequantize(reference))
    offset = x.mean(0)
    centered = kv_fake_quantize(x, "nvfp4", "e4m3_block16", (x - offset).abs().amax() / (6 * 448), offset)
    assert (centered - x).norm() < (nvfp4_kv_dequantize(packed, block_scale, g) - x).norm()
