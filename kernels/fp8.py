"""FP8 E4M3 (OCP "e4m3fn", max 448, no infinities) quantization references.

Weights, per output channel (rows of an [N, K] weight):
    scale[n] = max(|w[n, :]|) / 448            (1.0 where the row is all zero)
    q[n, k]  = cast_e4m3(w[n, k] / scale[n])   (round to nearest even, saturating; torch's cast)
    w'[n, k] = float(q[n, k]) * scale[n]
Per tensor is the same with one scale. Activations are quantized dynamically per token (one scale per row
of the flattened input) or statically with a calibrated per-tensor scale; both are fake-quantized here
(quantize, then dequantize to fp32), which is exactly what an FP8 GEMM with fp32 accumulation sees.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn


def _cast_e4m3(x: torch.Tensor) -> torch.Tensor:
    # torch's cast does not saturate (overflow becomes NaN), so clamp first.
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)


def _safe_scale(amax: torch.Tensor) -> torch.Tensor:
    scale = amax.float() / E4M3_MAX
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def fp8_quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] weight -> (float8_e4m3fn [N, K], fp32 scale [N, 1])."""
    if w.dim() != 2:
        raise ValueError(f"fp8 per-channel quantization needs a 2-D weight, got shape {tuple(w.shape)}")
    w = w.float()
    scale = _safe_scale(w.abs().amax(dim=1, keepdim=True))
    return _cast_e4m3(w / scale), scale


def fp8_quantize_per_tensor(w: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Any-shape tensor -> (float8_e4m3fn, fp32 0-dim scale). A given scale is used as is (static)."""
    w = w.float()
    if scale is None:
        scale = _safe_scale(w.abs().amax())
    scale = scale.float().reshape(())
    return _cast_e4m3(w / scale), scale


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float8 values times their broadcastable fp32 scale -> fp32."""
    if q.dtype != FP8_DTYPE:
        raise TypeError(f"expected {FP8_DTYPE}, got {q.dtype}")
    return q.float() * scale.float()


def fp8_fake_quantize_per_token(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-token activation quantization: one scale per row of the last dim, then back to fp32."""
    scale = _safe_scale(x.abs().amax(dim=-1, keepdim=True))
    return _cast_e4m3(x.float() / scale).float() * scale


def fp8_fake_quantize_per_tensor(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Static activation quantization with a calibrated per-tensor scale, then back to fp32."""
    q, scale = fp8_quantize_per_tensor(x, scale)
    return q.float() * scale
