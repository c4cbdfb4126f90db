"""FP8 E4M3 KV cache: one byte a value, with a calibrated scale per tensor or per KV head, or one per token.

    static scale s (per tensor: 0-dim; per KV head: [H, 1], calibrated offline):
        q = cast_e4m3(clamp(x / s, -448, 448))          # float8_e4m3fn, one byte per value
        x' = float(q) * s
        s = amax / 448 over the calibration activations (per tensor, or per head)
    dynamic per token: s[n] = max(|x[n, :, :]|) / 448, stored as fp32 beside the token

x is a stream [N, H, D] (kernels/kv_codec.py). Values above a calibrated amax saturate at 448; they never
become NaN or inf. Every function here is what the runtime's paged cache stores and reads with, through
`FP8_E4M3_KV` (kernels/registry.py `kv_format("fp8")`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kiln.kernels.errors import KilnError
from kiln.kernels.formats import KvFormat
from kiln.kernels.fp8 import E4M3_MAX, FP8_DTYPE
from kiln.kernels.kv_codec import (
    E4M3_ON,
    E4M3_VALUES,
    KERNEL_PER_HEAD,
    KERNEL_PER_TENSOR,
    KERNEL_PER_TOKEN,
    KvCodec,
    lookup,
    positive,
    table_on,
)

KV_FP8_SCALINGS = ("per_tensor", "per_head", "dynamic")
"""How FP8 KV scales are chosen: one calibrated scale per tensor or per KV head, or one per token."""


def fp8_kv_scale(amax: Tensor) -> Tensor:
    """Static FP8 scale(s) from calibrated amax: 0-dim (per tensor) or [H] -> [H, 1] (per head); fp32."""
    scale = positive(amax.float() / E4M3_MAX)
    return scale.reshape(()) if scale.numel() == 1 and scale.dim() == 0 else scale.reshape(-1, 1)


def fp8_kv_quantize(x: Tensor, scale: Tensor) -> Tensor:
    """[N, H, D] -> float8_e4m3fn [N, H, D] with a static scale (0-dim or [H, 1]), saturating."""
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)


def fp8_kv_quantize_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    """[N, H, D] -> (float8_e4m3fn [N, H, D], fp32 scale [N, 1, 1]): one dynamic scale per token."""
    x = x.float()
    scale = positive(x.abs().amax(dim=(-2, -1), keepdim=True) / E4M3_MAX)
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE), scale


def fp8_kv_dequantize(q: Tensor, scale: Tensor) -> Tensor:
    """float8 [..., H, D] times a broadcastable scale (0-dim, [H, 1] or per token [N, 1, 1]) -> fp32."""
    codes = q.view(torch.uint8)
    values = table_on(E4M3_VALUES, E4M3_ON, codes.device)
    if scale.numel() == 1:
        return lookup(values * scale.reshape(()), codes)
    return lookup(values, codes) * scale


class Fp8KvCodec(KvCodec):
    """FP8 E4M3 values with a calibrated scale per tensor or per KV head, or a dynamic one per token."""

    name, label, scalings = KvFormat.FP8_E4M3, "FP8 E4M3", KV_FP8_SCALINGS
    kernel_format = 1

    def bytes_per_token(self, values: int, scaling: str) -> int:
        return values + (4 if scaling == "dynamic" else 0)  # dynamic: one fp32 scale per token

    def static_scale(self, scaling: str) -> bool:
        return scaling != "dynamic"

    def token_scales(self, scaling: str) -> bool:
        return scaling == "dynamic"

    def calibrated_scale(self, x: Tensor, scaling: str) -> tuple[Tensor | None, Tensor | None]:
        """(0-dim or [H] to store, 0-dim or [H, 1] to compute with); none for dynamic scaling."""
        if scaling == "dynamic":
            return None, None
        amax = x.abs().amax() if scaling == "per_tensor" else x.abs().amax(dim=(0, 2))
        scale = amax.float() / E4M3_MAX
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return scale, (scale if scaling == "per_tensor" else scale.reshape(-1, 1))

    def fake_quantize(self, centered: Tensor, scaling: str, scale: Tensor | None) -> Tensor:
        if scaling == "dynamic":
            return fp8_kv_dequantize(*fp8_kv_quantize_per_token(centered))
        return fp8_kv_dequantize(fp8_kv_quantize(centered, scale), scale)

    def pool_layout(self, name, heads, dim, scaling, scale, dtype) -> tuple:
        data = ("data", (heads, dim), torch.float8_e4m3fn, 0.0)
        if scaling == "dynamic":
            return (data, ("token_scale", (1, 1), torch.float32, 1.0))
        if scale is None:
            raise KilnError(f"FP8 KV stream {name!r} ({scaling}) has no scale")
        return (data,)

    def store(self, storage, slots, x, scale) -> None:
        # index_copy_ has no float8 kernel on CPU: copy the bytes
        if "token_scale" in storage:
            q, token_scale = fp8_kv_quantize_per_token(x)
            storage["data"].view(torch.uint8).index_copy_(0, slots, q.view(torch.uint8))
            storage["token_scale"].index_copy_(0, slots, token_scale)
        else:
            storage["data"].view(torch.uint8).index_copy_(0, slots, fp8_kv_quantize(x, scale).view(torch.uint8))

    def load(self, storage, slots, scale) -> Tensor:
        if "token_scale" in storage:
            scale = storage["token_scale"].index_select(0, slots)
        return fp8_kv_dequantize(storage["data"].index_select(0, slots), scale)

    def kernel_tensors(self, storage, scale) -> tuple:
        return storage["data"], storage.get("token_scale", scale), None

    def check_pool(self, data, scale, global_scale) -> None:
        if data.dtype != torch.float8_e4m3fn or scale is None:
            raise ValueError("an FP8 KV pool needs float8_e4m3fn data and a scale")
        slots, heads = data.shape[:2]
        if tuple(scale.shape) not in ((), (heads, 1), (slots, 1, 1)):
            raise ValueError(f"an FP8 KV scale is 0-dim, [{heads}, 1] or [{slots}, 1, 1], "
                             f"got {tuple(scale.shape)}")

    def read_pool(self, rows, data, scale, global_scale) -> Tensor:
        return fp8_kv_dequantize(rows(data), rows(scale) if scale.ndim == 3 else scale.cpu())

    def kernel_operands(self, data, scale, global_scale, dummy) -> tuple:
        mode = {0: KERNEL_PER_TENSOR, 2: KERNEL_PER_HEAD, 3: KERNEL_PER_TOKEN}[scale.ndim]
        return data.view(torch.uint8), scale.float().contiguous(), dummy, mode

    def scale_shape(self, heads: int, scaling: str) -> tuple[int, ...]:
        return (heads, 1) if scaling == "per_head" else ()


FP8_E4M3_KV = Fp8KvCodec()
