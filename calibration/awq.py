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

A weight-only loss costs 2 N K min(K, T) per candidate (T sampled rows), 2.5 TFLOP for the 21 candidates of an
8B model's down_proj. With `sketch=r` it is estimated from r Gaussian combinations of the rows instead,
S = G X / sqrt(T) (or G L^T from the Hessian's Cholesky factor H = L L^T), G [r, .] standard normal: each
row s of S has E[s^T s] = H, so the mean of ||s D^T||^2 over S's rows is an unbiased estimate, at 2 N K r.
One seeded G serves every candidate, so their differences, which the search compares, are far more precise
than each loss.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kiln.calibration.gptq import cholesky_in_place

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
               tie: Tensor | None = None, sketch: int = 0) -> AwqResult:
    """The per-channel scale (from the alpha grid) that minimizes the group's output error.

    Give `hessian` (weight-only), or `sample` [S, K]: with `act_quantize` the input is quantized too; without
    it the loss is the weight-only one on those rows (every row: tr(D H D^T), cheaper when S < K).
    `sketch` > 0 estimates a weight-only loss from that many Gaussian row combinations (see the module doc)
    when it is fewer than min(K, S); 0: exact.
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
    x = sample.float() if sample is not None else None
    if act_quantize is None and 0 < sketch < min(k, x.shape[0] if x is not None else k):
        x, h32 = sketch_rows(x, h32, sketch), None
    if x is not None:
        targets = [x @ w.T for w in ws]
    best: tuple[float, float, Tensor] | None = None
    unscaled = float("nan")
    for i in range(grid + 1):
        alpha = i / grid
        s = awq_candidate(abs_mean, alpha, tie)
        loss = 0.0
        for j, w in enumerate(ws):
            q = quantize(w * s)
            if x is None:
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


def sketch_rows(sample: Tensor | None, hessian: Tensor | None, rows: int, seed: int = 0) -> Tensor:
    """[rows, K] S with E[S^T S] = H: from the sample's rows (H = X^T X / T) or the Hessian's Cholesky factor
    (damped by 1e-6 of its mean diagonal, so channels that never fire do not break it). Scaled so that the
    mean over S's rows of ||s D^T||^2 estimates tr(D H D^T), as a sample's loss is computed."""
    g = torch.Generator().manual_seed(seed)
    if sample is not None:
        x = sample.float()
        return torch.randn(rows, x.shape[0], generator=g) @ x / x.shape[0] ** 0.5
    h = hessian.float()
    damped = h.clone()  # the one [K, K] copy: factorized in place (GPTQ's cholesky_in_place)
    damped.diagonal().add_(1e-6 * float(h.diagonal().mean().clamp_min(1e-12)))
    if cholesky_in_place(damped):  # H = U^T U
        return torch.randn(rows, h.shape[0], generator=g) @ damped.triu_()
    del damped  # not positive definite even so: the eigen-decomposition's square root, H = F F^T
    values, vectors = torch.linalg.eigh(h)
    return torch.randn(rows, h.shape[0], generator=g) @ (vectors * values.clamp_min(0).sqrt()).T
