"""KV-cache formats as objects: the registry's lookup, and what each object answers for a stream."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels.errors import KilnError
from kiln.kernels.formats import KvFormat
from kiln.kernels.kv_codec import BF16_KV
from kiln.kernels.kv_fp8 import FP8_E4M3_KV
from kiln.kernels.kv_nvfp4 import NVFP4_KV
from kiln.kernels.registry import KV_FORMATS, kv_format


def test_the_registry_maps_every_kv_format_and_its_spellings_to_one_object():
    assert list(KV_FORMATS) == list(KvFormat)
    assert kv_format("fp8") is kv_format("fp8_e4m3") is FP8_E4M3_KV
    assert kv_format("bf16") is BF16_KV and kv_format(KvFormat.NVFP4) is NVFP4_KV
    with pytest.raises(KilnError, match="unknown KV format 'int4'; known: bf16, fp8_e4m3, nvfp4"):
        kv_format("int4")


def test_bytes_per_token_scales_and_dims():
    # 2 heads x 32 values: BF16 2 bytes each; FP8 one (+ 4 for a per-token scale); NVFP4 half + 1 per 16
    assert BF16_KV.bytes_per_token(64, "none") == 128
    assert FP8_E4M3_KV.bytes_per_token(64, "per_tensor") == 64
    assert FP8_E4M3_KV.bytes_per_token(64, "dynamic") == 68
    assert NVFP4_KV.bytes_per_token(64, "e4m3_block16") == 36
    assert [FP8_E4M3_KV.static_scale(s) for s in FP8_E4M3_KV.scalings] == [True, True, False]
    assert FP8_E4M3_KV.token_scales("dynamic") and not BF16_KV.quantized and NVFP4_KV.static_scale("e4m3_block16")
    assert NVFP4_KV.unaligned_dims([("k", 2, 32), ("v", 2, 24)]) == ["v dim 24"]
    assert FP8_E4M3_KV.unaligned_dims([("v", 2, 24)]) == []
    assert FP8_E4M3_KV.scale_shape(4, "per_head") == (4, 1) and NVFP4_KV.scale_shape(4, "e4m3_block16") == ()


@pytest.mark.parametrize("codec, scaling", [(FP8_E4M3_KV, "per_head"), (FP8_E4M3_KV, "dynamic"),
                                            (NVFP4_KV, "e4m3_block16")])
def test_store_then_load_is_the_fake_quantization(codec, scaling):
    torch.manual_seed(0)
    x = torch.randn(6, 2, 32)
    _, scale = codec.calibrated_scale(x, scaling)
    layout = codec.pool_layout("k", 2, 32, scaling, scale, torch.float32)
    storage = {name: torch.zeros(8, *shape, dtype=dtype) for name, shape, dtype, _ in layout}
    slots = torch.tensor([7, 0, 3, 1, 5, 2])
    codec.store(storage, slots, x, scale)
    torch.testing.assert_close(codec.load(storage, slots, scale), codec.fake_quantize(x, scaling, scale),
                               rtol=0, atol=0)
