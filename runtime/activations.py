"""Gate activations computed the same way on every CPU thread count: sigmoid, SiLU and tanh GELU.

    from kiln.runtime.activations import GATE_ACTIVATIONS
    gated = GATE_ACTIVATIONS[mlp_spec.activation](gate) * up    # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + e^-x), the same bits however torch splits x among its CPU threads.

    torch's CPU sigmoid and silu run a vectorized loop and a scalar one for the elements left over at the end
    of each thread's chunk, and the two round differently in the last bit; so which elements get which
    depends on the thread count, and a calibration that observes these activations (its Hessians, AWQ's
    search) stored other weights on two threads than on one. exp, add and divide agree in both loops."""
    if x.device.type != "cpu":
        return torch.sigmoid(x)
    if x.dtype in (torch.bfloat16, torch.float16):
        return sigmoid(x.float()).to(x.dtype)  # one rounding to the narrow type, as torch.sigmoid does
    return 1 / (_exp_neg(x) + 1)  # out of place: the tuning differentiates through it


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) as x / (1 + e^-x): thread-count independent on the CPU (see `sigmoid`)."""
    if x.device.type != "cpu":
        return F.silu(x)
    if x.dtype in (torch.bfloat16, torch.float16):
        return silu(x.float()).to(x.dtype)
    return x / (_exp_neg(x) + 1)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (Gemma's GeGLU gate, transformers' gelu_pytorch_tanh), as
    x * sigmoid(2u) = x / (1 + e^-2u), u = sqrt(2/pi) (x + 0.044715 x^3), which is 0.5 x (1 + tanh u): thread-count
    independent on the CPU (see `sigmoid`); within fp32 rounding of F.gelu(x, approximate="tanh")."""
    if x.device.type != "cpu":
        return F.gelu(x, approximate="tanh")
    if x.dtype in (torch.bfloat16, torch.float16):
        return gelu_tanh(x.float()).to(x.dtype)
    u = (2 * _SQRT_2_OVER_PI) * (x + 0.044715 * x * x * x)
    return x / (_exp_neg(u) + 1)


_SQRT_2_OVER_PI = 0.7978845608028654
GATE_ACTIVATIONS = {"silu": silu, "gelu_tanh": gelu_tanh}
"""MlpSpec.activation -> the function (runtime.spec.ACTIVATIONS)."""


def _exp_neg(x: torch.Tensor) -> torch.Tensor:
    """e^-x with the exponent capped at 88 (e^88 = 1.7e38, under fp32's maximum): e^-x stays finite, so its
    gradient is never 0 * inf = NaN for x < -88.7. Below -88 sigmoid is then under 1e-38 and silu is x e^-88
    (-6e-9 at x = -1e30, where F.silu gives -0)."""
    return torch.exp(torch.clamp(-x, max=88.0))
