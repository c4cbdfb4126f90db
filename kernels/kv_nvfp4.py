"""NVFP4 KV cache: E2M1 values in 16-value blocks along head_dim, an E4M3 scale per block, a global scale.

    per stream a calibrated fp32 global scale g = amax / (6 * 448); per token, head and block of 16 values
    along D an E4M3 block scale and 16 E2M1 codes packed two a byte (kernels/nvfp4.py's arithmetic, applied
    to the [N * H, D] matrix), so D must be a multiple of 16.

x is a stream [N, H, D] (kernels/kv_codec.py). Values above the calibrated amax saturate at 6 * 448 * g; they
never become NaN or inf. Every function here is what the runtime's paged cache stores and reads with, through
`NVFP4_KV` (kernels/registry.py `kv_format("nvfp4")`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kiln.kernels.errors import KilnError
from kiln.kernels.formats import KvFormat
from kiln.kernels.fp8 import E4M3_MAX
from kiln.kernels.kv_codec import (
    E2M1_PAIR_VALUES,
    E2M1_PAIRS_ON,
    E4M3_ON,
    E4M3_VALUES,
    KERNEL_PER_TENSOR,
    KvCodec,
    lookup,
    positive,
    table_on,
)
from kiln.kernels.nvfp4 import NVFP4_BLOCK_SIZE, nvfp4_quantize


def nvfp4_kv_global_scale(amax: Tensor) -> Tensor:
    """Per-stream NVFP4 global scale from a calibrated amax: amax / (6 * 448), 1.0 for zero; fp32 0-dim."""
    return positive(amax.float().reshape(()) / (6.0 * E4M3_MAX))


def nvfp4_kv_quantize(x: Tensor, global_scale: Tensor) -> tuple[Tensor, Tensor]:
    """[N, H, D] (D % 16 == 0) -> (packed uint8 [N, H, D/2], E4M3 block scales [N, H, D/16])."""
    n, h, d = x.shape
    if d % NVFP4_BLOCK_SIZE != 0:
        raise ValueError(f"NVFP4 KV needs a head dim that is a multiple of {NVFP4_BLOCK_SIZE}, got {d}")
    q = nvfp4_quantize(x.reshape(n * h, d).float(), global_scale=global_scale)
    return q.packed.reshape(n, h, d // 2), q.block_scale.reshape(n, h, d // NVFP4_BLOCK_SIZE)


def nvfp4_kv_dequantize(packed: Tensor, block_scale: Tensor, global_scale: Tensor) -> Tensor:
    """(packed [..., D/2], block scales [..., D/16], global scale) -> fp32 [..., D]; as nvfp4_dequantize."""
    values = lookup(table_on(E2M1_PAIR_VALUES, E2M1_PAIRS_ON, packed.device), packed).flatten(-2)  # [..., D]
    scales = lookup(table_on(E4M3_VALUES, E4M3_ON, packed.device) * global_scale.reshape(()),
                     block_scale.view(torch.uint8))  # [..., D/16]
    blocks = values.view(*values.shape[:-1], -1, NVFP4_BLOCK_SIZE)
    return (blocks * scales.unsqueeze(-1)).view(values.shape)


class Nvfp4KvCodec(KvCodec):
    """NVFP4: E2M1 values in 16-value blocks along D, an E4M3 scale per block, a calibrated global scale."""

    name, label, scalings = KvFormat.NVFP4, "NVFP4", ("e4m3_block16",)
    dim_multiple = NVFP4_BLOCK_SIZE
    packing = 2
    kernel_format = 2

    def bytes_per_token(self, values: int, scaling: str) -> int:
        return values // 2 + values // NVFP4_BLOCK_SIZE  # two E2M1 a byte + one E4M3 scale per 16

    def static_scale(self, scaling: str) -> bool:
        return True

    def calibrated_scale(self, x: Tensor, scaling: str) -> tuple[Tensor | None, Tensor | None]:
        g = nvfp4_kv_global_scale(x.abs().amax())
        return g, g

    def fake_quantize(self, centered: Tensor, scaling: str, scale: Tensor | None) -> Tensor:
        return nvfp4_kv_dequantize(*nvfp4_kv_quantize(centered, scale), scale)

    def pool_layout(self, name, heads, dim, scaling, scale, dtype) -> tuple:
        if scale is None:
            raise KilnError(f"NVFP4 KV stream {name!r} has no global scale")
        if dim % NVFP4_BLOCK_SIZE:
            raise KilnError(f"NVFP4 KV stream {name!r}: dim {dim} is not a multiple of {NVFP4_BLOCK_SIZE}")
        return (("packed", (heads, dim // 2), torch.uint8, 0.0),
                ("block_scale", (heads, dim // NVFP4_BLOCK_SIZE), torch.float8_e4m3fn, 0.0))

    def store(self, storage, slots, x, scale) -> None:
        packed, block_scale = nvfp4_kv_quantize(x, scale)
        storage["packed"].index_copy_(0, slots, packed)
        storage["block_scale"].view(torch.uint8).index_copy_(0, slots, block_scale.view(torch.uint8))

    def load(self, storage, slots, scale) -> Tensor:
        return nvfp4_kv_dequantize(storage["packed"].index_select(0, slots),
                                   storage["block_scale"].index_select(0, slots), scale)

    def kernel_tensors(self, storage, scale) -> tuple:
        return storage["packed"], storage["block_scale"], scale

    def check_pool(self, data, scale, global_scale) -> None:
        expected = (*data.shape[:2], data.shape[2] * 2 // NVFP4_BLOCK_SIZE)
        scale_ok = scale is not None and scale.dtype == torch.float8_e4m3fn and tuple(scale.shape) == expected
        if data.dtype != torch.uint8 or not scale_ok or global_scale is None:
            raise ValueError(f"an NVFP4 KV pool needs packed uint8 data, float8_e4m3fn block scales "
                             f"{expected} and a global scale")

    def read_pool(self, rows, data, scale, global_scale) -> Tensor:
        return nvfp4_kv_dequantize(rows(data), rows(scale), global_scale.cpu())

    def kernel_operands(self, data, scale, global_scale, dummy) -> tuple:
        return data, scale.view(torch.uint8), global_scale.float().reshape(1), KERNEL_PER_TENSOR


NVFP4_KV = Nvfp4KvCodec()
