"""A contiguous KV cache: the plain reference the paged cache is tested and benchmarked against.

A layer caches one or more "streams" per token: GQA/MHA layers cache K [Hkv, D] and V [Hkv, Dv]; MLA
layers cache the compressed latent [1, kv_lora_rank] and the roped key part [1, rope_dim]. A cache's
`update(layer, new, positions)` writes the new tokens' streams at their positions and returns every
stream for the whole batch up to the longest position, which attention masks by position.
The engine serves from `kiln.runtime.paged_kv_cache.PagedKVCache` (blocks, quantized storage); nothing in the
package uses this one, so it lives beside the tests (benchmarks/kv_cache.py and mla.py import it from here).
"""

from __future__ import annotations

import torch


class ContiguousKVCache:
    """One [B, S_max, H, D] buffer per layer and stream; rows are sequences of the batch."""

    def __init__(self, stream_shapes: list[tuple[tuple[int, int], ...]], batch: int, max_len: int,
                 dtype: torch.dtype = torch.float32):
        # stream_shapes[layer] = ((heads, dim), ...) for each stream of that layer
        self.max_len = max_len
        self.buffers = [
            tuple(torch.zeros(batch, max_len, h, d, dtype=dtype) for h, d in shapes) for shapes in stream_shapes
        ]
        self.length = 0  # highest written position + 1

    def update(self, layer: int, new: tuple[torch.Tensor, ...], positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # new[i]: [B, T, H, D]; positions: [B, T]
        if int(positions.max()) >= self.max_len:
            raise ValueError(f"position {int(positions.max())} is past the cache length {self.max_len}")
        batch_index = torch.arange(positions.shape[0]).unsqueeze(1).expand_as(positions)
        for buffer, value in zip(self.buffers[layer], new, strict=True):
            buffer[batch_index, positions] = value.to(buffer.dtype)
        self.length = max(self.length, int(positions.max()) + 1)
        return tuple(buffer[:, : self.length] for buffer in self.buffers[layer])
