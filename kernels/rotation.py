"""Block Hadamard rotation of a linear's input: the online half of a rotation folded into the weight.

A linear stores W R (quantized) and rotates its input the same way before quantizing it, so it computes
(x R)(W R)^T = x R R^T W^T = x W^T: R is orthogonal. Rotating spreads an outlier channel over its block,
which is what 4-bit activations and block scales need (QuaRot, MR-GPTQ: a Hadamard transform the size of
the quantization block, cheap enough to fuse into the activation-quantization kernel).

    R = blockdiag(H_b, H_b, ..., H_tail)            H_n: the Sylvester Hadamard matrix / sqrt(n), symmetric
    K = q * b + r:  q full blocks of b; the tail r (not a power of two, e.g. 172 = 5 * 32 + 12) is split
                    into powers of two, largest first (12 = 8 + 4), so R is orthogonal for every K
    rotate(x) = x R  along the last dimension; rotate is its own inverse (R = R^T = R^-1)

Weights rotate with the same function (each row w -> w R), so the optimizer and the runtime share this code.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch import Tensor

ROTATION_KINDS = ("block_hadamard",)


@lru_cache(maxsize=32)
def hadamard_matrix(n: int, device: torch.device | str | None = None) -> Tensor:
    """Sylvester's Hadamard matrix of order n (a power of two), divided by sqrt(n): orthogonal, symmetric; fp32
    on `device` (None: the CPU), one cached copy per device."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard_matrix: n must be a power of two, got {n}")
    with torch.inference_mode(False):  # cached: must stay usable by autograd even if first built in inference
        if device is not None and torch.device(device) != torch.device("cpu"):
            return hadamard_matrix(n).to(device)
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        return (h / math.sqrt(n)).float()


def block_sizes(in_features: int, block_size: int) -> tuple[int, ...]:
    """The diagonal blocks of R: full blocks of `block_size`, then the tail split into powers of two."""
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"rotation block_size must be a power of two, got {block_size}")
    if in_features < 1:
        raise ValueError(f"in_features must be positive, got {in_features}")
    sizes = [block_size] * (in_features // block_size)
    tail = in_features % block_size
    while tail:
        piece = 1 << (tail.bit_length() - 1)
        sizes.append(piece)
        tail -= piece
    return tuple(sizes)


def block_hadamard(x: Tensor, block_size: int) -> Tensor:
    """x R along the last dimension (fp32), R = blockdiag of normalized Hadamard matrices (see above)."""
    if not x.dtype.is_floating_point:
        raise TypeError(f"block_hadamard: x must be a float tensor, got {x.dtype}")
    x = x.float()
    k = x.shape[-1]
    full = (k // block_size) * block_size
    parts = []
    if full:
        blocks = x[..., :full].reshape(*x.shape[:-1], full // block_size, block_size)
        parts.append((blocks @ hadamard_matrix(block_size, x.device)).reshape(*x.shape[:-1], full))
    start = full
    for size in block_sizes(k, block_size)[full // block_size:]:
        parts.append(x[..., start: start + size] @ hadamard_matrix(size, x.device))
        start += size
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def rotation_matrix(in_features: int, block_size: int) -> Tensor:
    """R itself [K, K] (for Hessians: the rotated input's Hessian is R^T H R)."""
    return torch.block_diag(*[hadamard_matrix(s) for s in block_sizes(in_features, block_size)])
