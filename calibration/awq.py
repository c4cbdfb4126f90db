"""AWQ-style activation-aware per-channel scaling (Lin et al., 2023), searched on the layer's own statistics.

Linears that read the same input x (q/k/v after the input norm, gate/up after the post-attention norm,
o_proj after v_proj, down_proj after up_proj) can trade a per-input-channel factor s with whatever
produced x:   x W^T = (x / s) (W diag(s))^T.   The producer absorbs 1/s exactly (a norm's weight, or the
rows of the previous linear), so the fp32 function is unchanged, while the quantizer now sees W diag(s):
channels that carry large activations get larger weights and so finer relative resolution.

    for alpha in 0, 1/grid, ..., 1:
        s = mean|x| ^ alpha, normalized so that max(s) * min(s) = 1     (alpha = 0: s = 1, no scaling)
        s = mean of s over each tie group (channels that one producer channel feeds must share s)
        loss = sum over the linears of || x W^T - (x / s) Q(W diag s)^T ||^2
    keep the alpha with the lowest loss (alpha = 0 is a candidate, so the search never loses to plain Q)

The loss is computed from the input Hessian H = E[x^T x] for weight-only formats, since then
||x W^T - x D^T||^2 = tr((W - D) H (W - D)^T) with D = Q(W diag s) / s, and on a sample of activation rows
when the input is quantized too (then x / s is quantized before the product, which H cannot express).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

WeightQuantizer = Callable[[Tensor], Tensor]  # W [N, K] -> its fake-quantized values


@dataclass(frozen=True)
class AwqResult:
    scale: Tensor  # fp32 [K]; the linears' weights are multiplied by it, their input divided by it
    alpha: float
    loss: float  # at the chosen alpha
    loss_unscaled: float  # at alpha = 0 (s = 1)


def awq_candidate(abs_mean: Tensor, alpha: float, tie: Tensor | None = None) -> Tensor:
    """s = mean|x|^alpha normalized to max * min = 1, shared within tie groups (tie[k] = group of channel k)."""
    s = abs_mean.float().clamp_min(1e-8).pow(alpha)
    if tie is not None:
        groups = int(tie.max()) + 1
        sums = torch.zeros(groups).index_add_(0, tie, s)
        counts = torch.zeros(groups).index_add_(0, tie, torch.ones_like(s))
        s = (sums / counts)[tie]
    s = s / (s.max() * s.min()).sqrt()
    return s


def awq_search(weights: Sequence[Tensor], quantize: WeightQuantizer, abs_mean: Tensor, *,
               hessian: Tensor | None = None, sample: Tensor | None = None,
               act_quantize: Callable[[Tensor], Tensor] | None = None, grid: int = 20,
               tie: Tensor | None = None) -> AwqResult:
    """The per-channel scale (from the alpha grid) that minimizes the group's output error.

    Give `hessian` (weight-only), or `sample` [S, K]: with `act_quantize` the input is quantized too; without
    it the loss is the weight-only one on those rows (every row: tr(D H D^T), cheaper when S < K).
    """
    if (hessian is None) == (sample is None):
        raise ValueError("awq_search needs exactly one of hessian (weight-only) or sample (quantized input)")
    if grid < 1:
        raise ValueError(f"grid must be >= 1, got {grid}")
    k = abs_mean.shape[0]
    for w in weights:
        if w.ndim != 2 or w.shape[1] != k:
            raise ValueError(f"every weight must be [N, {k}], got {tuple(w.shape)}")
    ws = [w.float() for w in weights]
    h32 = hessian.float() if hessian is not None else None
    if sample is not None:
        x = sample.float()
        targets = [x @ w.T for w in ws]
    best: tuple[float, float, Tensor] | None = None
    unscaled = float("nan")
    for i in range(grid + 1):
        alpha = i / grid
        s = awq_candidate(abs_mean, alpha, tie)
        loss = 0.0
        for j, w in enumerate(ws):
            q = quantize(w * s)
            if sample is None:
                d = w - q / s  # tr(D H D^T): the product in fp32 (float64 is several times slower), summed in float64
                loss += float(((d @ h32) * d).sum(dtype=torch.float64))
            else:
                xs = x / s
                xs = act_quantize(xs) if act_quantize is not None else xs
                loss += float((xs @ q.T - targets[j]).pow(2).sum(dtype=torch.float64) / x.shape[0])
        if i == 0:
            unscaled = loss
        if best is None or loss < best[0]:
            best = (loss, alpha, s)
    loss, alpha, s = best
    return AwqResult(s, alpha, loss, unscaled)
