"""Observers: running statistics of a linear's inputs, accumulated batch by batch so memory stays bounded.

    InputObserver(K).update(x [..., K])   for every calibration batch, then read:
        hessian      X^T X / tokens                      [K, K]  (GPTQ, and every output-error proxy); fp32, a
                                                         running mean updated in place (no [K, K] temporary:
                                                         an 8B down_proj has K = 14336, 0.8 GB); read-only,
                                                         or handed over by take_hessian() to its last reader
        abs_mean     mean |x| per input channel          [K]     (AWQ)
        absmax       max |x| over everything seen        0-dim   (static activation scales; kept per channel)
        sample       up to `max_samples` input rows      [S, K]  (searches that must see activation
                     kept at random (reservoir sampling)         quantization, which H cannot express)
`observer.rescale_(s)` turns the statistics into those of x / s, in place (exact up to rounding; the sample,
kept for searches, is dropped): an AWQ scale folded into a norm or a producing linear divides the input by
s, and the linears reading it need not be observed again.
Rows that are all zero (padding) are skipped. Bad input is a one-line KilnError, never a traceback:
    - a batch holding NaN or Inf (a checkpoint whose activations overflow float32) is refused as it arrives,
      naming the linear (`name`); the check reuses the per-row maximum the padding test computes anyway;
    - reading a statistic of an observer that saw no token says whether no calibration row reached the
      layer at all or every row that did was zero.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kiln.kernels.errors import KilnError

SUM_SLICE_BYTES = 8 << 20  # float64 bytes of the rows summed at once


class InputObserver:
    def __init__(self, in_features: int, max_samples: int = 0, seed: int = 0, name: str | None = None):
        self.in_features = in_features
        self.name = name  # the linear whose inputs these are, for messages
        self.tokens = 0  # non-zero rows: the statistics' denominator
        self.rows = 0  # every row seen, padding included
        self._h = torch.zeros(in_features, in_features)  # running mean of x^T x
        self._abs_sum = torch.zeros(in_features, dtype=torch.float64)
        self._absmax = torch.zeros(in_features, dtype=torch.float32)  # per input channel
        self.max_samples = max_samples
        self._sample: Tensor | None = None
        self._generator = torch.Generator().manual_seed(seed)

    def update(self, x: Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        if x.shape[-1] != self.in_features:
            raise ValueError(f"observer expects {self.in_features} input features, got {x.shape[-1]}")
        self.rows += x.shape[0]
        row_max = x.abs().amax(dim=1)  # NaN for a row holding NaN, inf for one holding inf
        if x.shape[0] and not bool(torch.isfinite(row_max).all()):
            raise KilnError(f"calibration inputs of {self._what()} are not finite (NaN or Inf): the checkpoint's "
                            "activations overflow float32")
        real = row_max > 0  # padding rows are zero
        if not bool(real.all()):
            x = x[real]
        if x.shape[0] == 0:
            return
        # |x| once for the mean and the maximum (an 8B down_proj's batch is [tokens, 14336] fp32)
        magnitude = x.abs()
        # fp32 throughout, as GPTQ implementations keep H (float64 matmuls are several times slower on CPU, and
        # the rounding, ~1e-6 relative, is far below GPTQ's damping); the mean is rescaled in place
        seen = self.tokens + x.shape[0]
        here = self._h.device
        if x.device == here:
            self._h.mul_(self.tokens / seen).addmm_(x.T, x, alpha=1.0 / seen)
        else:  # inputs on a GPU (a build's --device): the product there, the statistics stay on the CPU
            self._h.mul_(self.tokens / seen).add_((x.T @ x).to(here), alpha=1.0 / seen)
        # summed in float64 a slice of rows at a time: sum(dtype=float64) first copies what it sums to float64
        rows = max(1, SUM_SLICE_BYTES // (8 * x.shape[1]))
        for part in magnitude.split(rows):
            self._abs_sum += part.sum(0, dtype=torch.float64).to(here)
        self._absmax = torch.maximum(self._absmax, magnitude.amax(0).to(here))
        del magnitude
        if self.max_samples:
            self._reservoir(x.to(here))
        self.tokens += x.shape[0]

    def _reservoir(self, x: Tensor) -> None:
        # Algorithm R, vectorized per batch: row t (0-based, over everything seen) replaces a random slot
        # with probability max_samples / (t + 1).
        seen = self.tokens
        if self._sample is None:
            self._sample = x[: self.max_samples].clone()
            x, seen = x[self.max_samples:], seen + min(self.max_samples, x.shape[0])
        elif self._sample.shape[0] < self.max_samples:
            room = self.max_samples - self._sample.shape[0]
            self._sample = torch.cat([self._sample, x[:room]])
            x, seen = x[room:], seen + min(room, x.shape[0])
        if x.shape[0] == 0:
            return
        t = torch.arange(seen, seen + x.shape[0], dtype=torch.float64)
        slot = (torch.rand(x.shape[0], generator=self._generator, dtype=torch.float64) * (t + 1)).long()
        rows = (slot < self.max_samples).nonzero().squeeze(1)
        if rows.numel():
            # a later row wins a shared slot, as in the sequential algorithm (and deterministically)
            order = torch.argsort(slot[rows], stable=True)
            rows, slots = rows[order], slot[rows][order]
            last = torch.ones_like(slots, dtype=torch.bool)
            last[:-1] = slots[1:] != slots[:-1]
            self._sample[slots[last]] = x[rows[last]]

    def rescale_(self, s: Tensor) -> InputObserver:
        """In place, the statistics of x / s (s [K], positive) from those of x, without observing again (no
        [K, K] copy: 0.8 GB at K = 14336). The sample is dropped (it served the search that chose s)."""
        s = s.float().reshape(-1)
        if s.shape[0] != self.in_features:
            raise ValueError(f"scale has {s.shape[0]} channels, the observer {self.in_features}")
        inv = 1.0 / s
        with torch.inference_mode():  # the statistics may have been made there (calibration runs in it)
            self._h.mul_(inv.unsqueeze(1)).mul_(inv.unsqueeze(0))
            self._abs_sum.mul_(inv.double())
            self._absmax.div_(s)
        self.max_samples, self._sample = 0, None
        return self

    def _what(self) -> str:
        return f"linear {self.name}" if self.name else "a linear"

    def _no_tokens(self) -> KilnError:
        if self.rows == 0:
            return KilnError(f"no calibration token reached {self._what()}: the calibration text produced no "
                             "tokens for this layer")
        return KilnError(f"all {self.rows} calibration input rows of {self._what()} are zero, so it has no input "
                         "statistics (the checkpoint's activations vanish or overflow before it)")

    def _mean(self, t: Tensor) -> Tensor:
        if self.tokens == 0:
            raise self._no_tokens()
        return t / self.tokens

    @property
    def hessian(self) -> Tensor:
        """E[x^T x] (fp32, the observer's own tensor: read it, do not change it)."""
        if self.tokens == 0:
            raise self._no_tokens()
        if self._h is None:
            raise ValueError(f"the Hessian of {self._what()} was taken (take_hessian) and overwritten")
        return self._h

    def take_hessian(self) -> Tensor:
        """The Hessian's own buffer, for its last reader to overwrite (GPTQ's consume_hessian: no [K, K] copy,
        0.8 GB at an 8B down_proj); the observer has none afterwards."""
        h = self.hessian
        self._h = None
        return h

    @property
    def abs_mean(self) -> Tensor:
        return self._mean(self._abs_sum).float()

    @property
    def absmax(self) -> Tensor:
        return self._absmax.amax()

    @property
    def sample(self) -> Tensor:
        if not self.max_samples:
            raise ValueError("observer keeps no sample (max_samples=0)")
        if self._sample is None:
            raise self._no_tokens()
        return self._sample
