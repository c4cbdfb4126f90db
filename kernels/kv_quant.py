"""KV-cache number formats: FP8 E4M3 with static or per-token scales, and NVFP4 blocks along head_dim.

A cached stream (K, V, or an MLA latent) is a tensor [N, H, D]: N tokens, H heads, D values per head.

    FP8 E4M3, static scale s (per tensor: 0-dim; per KV head: [H, 1], calibrated offline):
        q = cast_e4m3(clamp(x / s, -448, 448))          # float8_e4m3fn, one byte per value
        x' = float(q) * s
        s = amax / 448 over the calibration activations (per tensor, or per head)
    FP8 E4M3, dynamic per token: s[n] = max(|x[n, :, :]|) / 448, stored as fp32 beside the token
    NVFP4: per stream a calibrated fp32 global scale g = amax / (6 * 448); per token, head and block of 16
        values along D an E4M3 block scale and 16 E2M1 codes packed two a byte (kernels/nvfp4.py's
        arithmetic, applied to the [N * H, D] matrix), so D must be a multiple of 16.
Values above a calibrated amax saturate (at 448 or at 6 * 448 * g); they never become NaN or inf.
Optionally a calibrated per-channel offset mu [H, D] (the mean over calibration tokens) is subtracted before
quantizing and added back on reading: x' = dequantize(quantize(x - mu)) + mu. Post-RoPE keys carry large,
nearly constant means in their slowly rotating channels; without the offset FP8's relative rounding error
lands on those means instead of on the signal. It costs nothing per token: softmax is shift-invariant per
query, so a kernel may drop the K offset (q . mu is the same for every key), and the V offset is added
once to the attention output (the weights sum to 1).
Every function here is what the runtime's paged cache stores and reads with. Reading decodes through
256-entry tables (byte -> fp32 value, or byte -> the two E2M1 values it packs) with the per-tensor scale
folded in: the same fp32 products as float(q) * scale, one lookup per byte instead of a slow float8 cast.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kiln.kernels.formats import KvFormat
from kiln.kernels.fp4 import e2m1_decode
from kiln.kernels.fp8 import E4M3_MAX, FP8_DTYPE
from kiln.kernels.nvfp4 import NVFP4_BLOCK_SIZE, nvfp4_quantize

KV_FP8_SCALINGS = ("per_tensor", "per_head", "dynamic")
"""How FP8 KV scales are chosen: one calibrated scale per tensor or per KV head, or one per token."""

_BYTES = torch.arange(256, dtype=torch.uint8)
E4M3_VALUES = _BYTES.view(FP8_DTYPE).float()
"""fp32 value of every float8_e4m3fn bit pattern (0x7F and 0xFF are NaN; quantizing never stores them)."""
E2M1_PAIR_VALUES = torch.stack((e2m1_decode(_BYTES & 0x0F), e2m1_decode(_BYTES >> 4)), dim=-1)
"""[256, 2]: the two E2M1 values a packed byte holds, low nibble (element 2i) first."""


_E4M3_ON: dict[torch.device, Tensor] = {}  # copies of the tables on other devices than the CPU
_E2M1_PAIRS_ON: dict[torch.device, Tensor] = {}


def _table(table: Tensor, copies: dict[torch.device, Tensor], device: torch.device) -> Tensor:
    """A lookup table on `device`: the CPU one, or its copy there (made once; a compiled step finds it made)."""
    if device.type == "cpu":
        return table
    copy = copies.get(device)
    if copy is None:
        copy = copies[device] = table.to(device)
    return copy


def _lookup(table: Tensor, codes: Tensor) -> Tensor:
    """table[codes] for uint8 codes of any shape -> [*codes.shape, *table.shape[1:]]."""
    return table.index_select(0, codes.reshape(-1).long()).view(*codes.shape, *table.shape[1:])


def _positive(scale: Tensor) -> Tensor:
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def fp8_kv_scale(amax: Tensor) -> Tensor:
    """Static FP8 scale(s) from calibrated amax: 0-dim (per tensor) or [H] -> [H, 1] (per head); fp32."""
    scale = _positive(amax.float() / E4M3_MAX)
    return scale.reshape(()) if scale.numel() == 1 and scale.dim() == 0 else scale.reshape(-1, 1)


def fp8_kv_quantize(x: Tensor, scale: Tensor) -> Tensor:
    """[N, H, D] -> float8_e4m3fn [N, H, D] with a static scale (0-dim or [H, 1]), saturating."""
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)


def fp8_kv_quantize_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    """[N, H, D] -> (float8_e4m3fn [N, H, D], fp32 scale [N, 1, 1]): one dynamic scale per token."""
    x = x.float()
    scale = _positive(x.abs().amax(dim=(-2, -1), keepdim=True) / E4M3_MAX)
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE), scale


def fp8_kv_dequantize(q: Tensor, scale: Tensor) -> Tensor:
    """float8 [..., H, D] times a broadcastable scale (0-dim, [H, 1] or per token [N, 1, 1]) -> fp32."""
    codes = q.view(torch.uint8)
    values = _table(E4M3_VALUES, _E4M3_ON, codes.device)
    if scale.numel() == 1:
        return _lookup(values * scale.reshape(()), codes)
    return _lookup(values, codes) * scale


def nvfp4_kv_global_scale(amax: Tensor) -> Tensor:
    """Per-stream NVFP4 global scale from a calibrated amax: amax / (6 * 448), 1.0 for zero; fp32 0-dim."""
    return _positive(amax.float().reshape(()) / (6.0 * E4M3_MAX))


def nvfp4_kv_quantize(x: Tensor, global_scale: Tensor) -> tuple[Tensor, Tensor]:
    """[N, H, D] (D % 16 == 0) -> (packed uint8 [N, H, D/2], E4M3 block scales [N, H, D/16])."""
    n, h, d = x.shape
    if d % NVFP4_BLOCK_SIZE != 0:
        raise ValueError(f"NVFP4 KV needs a head dim that is a multiple of {NVFP4_BLOCK_SIZE}, got {d}")
    q = nvfp4_quantize(x.reshape(n * h, d).float(), global_scale=global_scale)
    return q.packed.reshape(n, h, d // 2), q.block_scale.reshape(n, h, d // NVFP4_BLOCK_SIZE)


def nvfp4_kv_dequantize(packed: Tensor, block_scale: Tensor, global_scale: Tensor) -> Tensor:
    """(packed [..., D/2], block scales [..., D/16], global scale) -> fp32 [..., D]; as nvfp4_dequantize."""
    values = _lookup(_table(E2M1_PAIR_VALUES, _E2M1_PAIRS_ON, packed.device), packed).flatten(-2)  # [..., D]
    scales = _lookup(_table(E4M3_VALUES, _E4M3_ON, packed.device) * global_scale.reshape(()),
                     block_scale.view(torch.uint8))  # [..., D/16]
    blocks = values.view(*values.shape[:-1], -1, NVFP4_BLOCK_SIZE)
    return (blocks * scales.unsqueeze(-1)).view(values.shape)


def kv_fake_quantize(x: Tensor, fmt: str, scaling: str, scale: Tensor | None,
                     offset: Tensor | None = None) -> Tensor:
    """Store-then-read of [N, H, D] in a KV format, in fp32 (what attention sees); for error measurement."""
    if fmt == KvFormat.BF16:
        return x.float()
    centered = x.float() if offset is None else x.float() - offset
    if fmt == KvFormat.FP8_E4M3:
        if scaling == "dynamic":
            out = fp8_kv_dequantize(*fp8_kv_quantize_per_token(centered))
        else:
            out = fp8_kv_dequantize(fp8_kv_quantize(centered, scale), scale)
    elif fmt == KvFormat.NVFP4:
        out = nvfp4_kv_dequantize(*nvfp4_kv_quantize(centered, scale), scale)
    else:
        raise ValueError(f"unknown KV format {fmt!r}; known: {', '.join(KvFormat)}")
    return out if offset is None else out + offset
