"""Tuning quantized weights end to end on the calibration set (quantization-aware distillation).

After GPTQ has chosen scales and grid points layer by layer, the grid points are refined for the whole
model at once: every quantized linear keeps its stored scales fixed and gets a latent fp32 weight V,
initialized to its current quantized values; the forward pass uses the quantized Q(V) and the backward
pass treats rounding as the identity (straight-through estimator), so Adam moves V until its rounding flips
where that lowers the loss: the KL divergence from the source model's next-token distribution on the
calibration tokens. Norm weights (stored in full precision) are tuned with them.

    for step in range(steps):                       # batches cycle over the calibration set
        loss = KL(p_source || p_quantized) on one batch      # optimizer.measure.calibration_session computes it
        V -= adam(grad)    with a cosine learning-rate decay to 0
    stored values = Q(V) with the same scales        # so the artifact stores grid points as before

Scales stay as calibrated (block scales are on E4M3 / E8M0 grids, and the runtime's arithmetic is fixed),
so what ships is still exactly `WeightLayout.pack(values, scales)`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from kiln.calibration import progress
from kiln.calibration.grids import Scales, WeightLayout


def ste_round(layout: WeightLayout, v: Tensor, multiplier: Tensor) -> Tensor:
    """Q(v) in the forward pass, identity in the backward pass; v [N, K], multiplier [N, blocks]."""
    with torch.no_grad():
        q = layout.quantize(v, Scales(multiplier, {}))
    return v + (q - v).detach()


def ste(quantize: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """Any fake-quantizer (e.g. the runtime's activation quantizer) with a straight-through gradient."""
    with torch.no_grad():
        q = quantize(x)
    return x + (q - x).detach()


class FakeQuantWeight(nn.Module):
    """A latent weight whose value is always on its format's grid (calling it returns Q(V))."""

    def __init__(self, layout: WeightLayout, values: Tensor, scales: Scales):
        super().__init__()
        self.layout = layout
        self.scales = scales
        self.latent = nn.Parameter(values.detach().float().clone())

    def forward(self) -> Tensor:
        return ste_round(self.layout, self.latent, self.scales.multiplier)

    def values(self) -> Tensor:
        with torch.no_grad():
            return self.layout.quantize(self.latent.detach(), self.scales)


@contextmanager
def threads(count: int | None) -> Iterator[None]:
    """torch's CPU threads set to `count` (None: as they are) for the block, then restored."""
    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def tune(parameters: Sequence[Tensor], loss: Callable[[int], Tensor | float], steps: int, lr: float,
         log: Callable[[str], None] | None = None, cpu_threads: int | None = None) -> list[float]:
    """Adam with a cosine decay over `steps`; loss(step) returns the loss of that step's batch: a tensor to
    differentiate, or a float when it ran backward itself (gradients accumulated over micro-batches).

    `cpu_threads`: torch's CPU threads while it runs, when every parameter is on the CPU (None: as they are).
    Quantized weights tune on one (end_to_end_tuning.tune_end_to_end): torch splits a reduction (a norm weight's
    gradient, the loss) among its threads, so each thread count sums in another order, and hundreds of steps
    of straight-through rounding turn a last-bit difference into other grid points (the auto recipe's recovery
    moved by 0.004 between thread counts: benchmarks/results/tuning.md). On one thread, with MKL's strict mode
    set by optimizer.numerics.pin_cpu_numerics, it stores the same weights whether torch has one thread or two."""
    if steps <= 0:
        return []
    if lr <= 0:
        raise ValueError(f"lr must be positive, got {lr}")
    params = list(parameters)
    optimizer = torch.optim.Adam(params, lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    history: list[float] = []
    on_cpu = all(p.device.type == "cpu" for p in params)
    with torch.enable_grad(), threads(cpu_threads if on_cpu else None), \
            progress.stage("tune end to end", total=steps, unit="steps") as task:
        for step in range(steps):
            optimizer.zero_grad(set_to_none=True)
            value = loss(step)
            if isinstance(value, Tensor):
                value.backward()
                value = float(value.detach())
            optimizer.step()
            schedule.step()
            history.append(value)
            task.advance()
            if log is not None and (step % 50 == 0 or step == steps - 1):
                log(f"tune step {step}/{steps}: KL {history[-1]:.5f}")
    return history
