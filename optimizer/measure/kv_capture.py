"""Calibration activations for passes, computed by the runtime's own modules (optimizer may import runtime).

    KvCapture      `ModelRunner.capture_kv` (optimizer.measure.runner): K/V cache activations on the calibration tokens
    RuntimeCalibrator (optimizer.measure.calibration_session)  `ModelRunner.session`: per-linear inputs, block by block
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kiln.kernels.errors import KilnError
from kiln.optimizer.lower import lower_tensors
from kiln.optimizer.measure.calibration_session import RuntimeCalibrationSession
from kiln.passes.graph import ModelGraph
from kiln.runtime.model import Transformer


class _RecordingCache:
    """A stand-in KV cache for one prefill: returns each layer's new streams unchanged (a fresh prefill's
    cache holds exactly them) and keeps the real tokens' rows."""

    def __init__(self, mask: torch.Tensor):
        self.mask = mask  # [B, T] real tokens
        self.streams: dict[int, list[torch.Tensor]] = {}

    def update(self, layer: int, new: tuple[torch.Tensor, ...], positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.streams[layer] = [value[self.mask].cpu() for value in new]  # [tokens, heads, dim] each, on the CPU
        return new


class KvCapture:
    """`ModelRunner.capture_kv`: K/V activations on the calibration tokens as the runtime's cache would receive
    them (post-RoPE; for MLA the latent and the roped key part), through the graph as it stands now:
    layer -> one [tokens, heads, dim] tensor per cached stream, on the CPU (the model runs on `device`)."""

    def __init__(self, token_lists: Sequence[Sequence[int]], max_batch_tokens: int = 8192,
                 device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.token_lists = [list(t) for t in token_lists if len(t) > 0]
        if not self.token_lists:
            raise KilnError("KV calibration needs at least one non-empty token list")
        self.max_batch_tokens = max_batch_tokens

    @torch.inference_mode()
    def __call__(self, graph: ModelGraph) -> dict[int, tuple[torch.Tensor, ...]]:
        tensors, formats = lower_tensors(graph)
        session = RuntimeCalibrationSession(graph, self.token_lists, self.max_batch_tokens, device=self.device)
        model = session.to_device(Transformer(graph.spec, tensors, formats).eval())
        collected: dict[int, list[list[torch.Tensor]]] = {}
        for b in session.batches:
            cache = _RecordingCache(b.mask)
            model(b.tokens.to(self.device), b.positions, cache)
            for layer, streams in cache.streams.items():
                collected.setdefault(layer, []).append(streams)
        return {layer: tuple(torch.cat(parts, dim=0) for parts in zip(*batches, strict=True))
                for layer, batches in sorted(collected.items())}
