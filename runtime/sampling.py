"""Sampling: the distribution at a temperature and top-p, a draw from it, and the repetition penalty.

Shared by plain generation (runtime.engine), the continuous-batching scheduler and speculative decoding, so
that all three sample the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kiln.kernels.errors import KilnError


def probabilities(logits: torch.Tensor, temperature: float, top_p: float, normalize: bool = True) -> torch.Tensor:
    """The sampling distribution for logits [..., V]: softmax at `temperature`, cut to the top-p nucleus (the
    top token always kept), renormalized unless `normalize` is False (multinomial needs no normalizing)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        keep = sorted_probs.cumsum(dim=-1) - sorted_probs < top_p  # always keeps the top token
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs * keep)
        if normalize:
            probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> torch.Tensor:
    # logits: [B, V] -> [B]
    if temperature <= 0:
        return logits.argmax(dim=-1)
    return torch.multinomial(probabilities(logits, temperature, top_p, normalize=False), 1,
                             generator=generator).squeeze(-1)


def penalize_repeats(logits: torch.Tensor, seen: Sequence[Sequence[int]], penalty: float) -> torch.Tensor:
    """The repetition penalty of transformers and vLLM: for each row's tokens already in its prompt or output,
    a positive logit is divided by `penalty` and a negative one multiplied (above 1 discourages repeats, below
    1 encourages them, 1 changes nothing)."""
    if penalty == 1.0:
        return logits
    logits = logits.clone()
    for row, tokens in enumerate(seen):
        index = torch.as_tensor(sorted(set(tokens)), dtype=torch.long).to(logits.device, non_blocking=True)
        picked = logits[row, index]
        logits[row, index] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def check_repetition_penalty(penalty) -> float:
    if isinstance(penalty, bool) or not isinstance(penalty, int | float) or not 0 < penalty < float("inf"):
        raise KilnError(f"repetition_penalty must be a finite number > 0 (1 = off), got {penalty!r}")
    return float(penalty)
