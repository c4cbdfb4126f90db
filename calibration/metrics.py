"""The two error measures every calibration and gate figure is made of.

    kl_terms(log_p, log_q)       p * (log p - log q), element by element: summed over the vocabulary it is
                                 KL(p || q) per token (p the source, q the candidate; log-probabilities in)
    relative_error(approx, x)    ||approx - x||^2 / ||x||^2
"""

from __future__ import annotations

import torch


def kl_terms(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """p (log p - log q) for log-probabilities [..., V]: `.sum(-1)` is KL(p || q) per position. Callers reduce
    (a sum over all scored tokens, or a mean per batch), so the formula is written once."""
    return log_p.exp() * (log_p - log_q)


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """||approx - exact||^2 / ||exact||^2 (0-safe)."""
    exact = exact.float()
    return float((approx - exact).pow(2).sum() / exact.pow(2).sum().clamp_min(1e-30))
