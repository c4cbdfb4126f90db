"""KV-cache number formats: where each lives, and the store-then-read that measures their error.

    kernels/kv_codec.py   the `KvCodec` each KV format is; BF16 (unquantized); the decode tables
    kernels/kv_fp8.py     FP8 E4M3 with static (per tensor, per KV head) or per-token scales
    kernels/kv_nvfp4.py   NVFP4 blocks of 16 along head_dim with a calibrated global scale

    kv_format("fp8")  (kernels/registry.py)          the format object of a spelling
    kv_fake_quantize(x, "fp8_e4m3", "per_tensor", scale, offset)   fp32 [N, H, D], what attention sees
"""

from __future__ import annotations

from torch import Tensor

from kiln.kernels.formats import KvFormat
from kiln.kernels.registry import KV_FORMATS


def kv_fake_quantize(x: Tensor, fmt: str, scaling: str, scale: Tensor | None,
                     offset: Tensor | None = None) -> Tensor:
    """Store-then-read of [N, H, D] in a KV format, in fp32 (what attention sees); for error measurement."""
    codec = KV_FORMATS.get(fmt)
    if codec is None:
        raise ValueError(f"unknown KV format {fmt!r}; known: {', '.join(KvFormat)}")
    if not codec.quantized:
        return x.float()
    centered = x.float() if offset is None else x.float() - offset
    out = codec.fake_quantize(centered, scaling, scale)
    return out if offset is None else out + offset
