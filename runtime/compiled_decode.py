"""Decode steps through `torch.compile`: the model's forward traced once, the paged cache read and written in place.

    decode = CompiledDecode(model, device, windows, mode=None, static_shapes=None)
    logits = decode(tokens, positions, cache)      # tokens, positions [B, 1] prepared in `cache` -> logits [B, V]

The cache is read and written through `PagedKVCache.step_view`. Batch, history length and pool size are
dynamic; with `static_shapes` every step instead runs at a bucketed shape (its batch padded up to the next of
DECODE_BATCH_SIZES, its history to a multiple of DECODE_LENGTH_STEP), so a CUDA graph is captured once per bucket,
not once per step.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.functional import pad

from kiln.runtime.attention import attention_mask
from kiln.runtime.kv_step import DecodeTables, StepView
from kiln.runtime.paged_kv_cache import PagedKVCache

DECODE_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
"""A static-shape decode step pads its batch up to the next of these (vLLM's CUDA-graph capture sizes are the
same idea); a larger batch runs unpadded."""
DECODE_LENGTH_STEP = 256
"""A static-shape decode step pads the history it reads up to a multiple of this many tokens."""


class CompiledDecode:
    """`model`'s forward compiled for one-token decode steps on a paged cache (see the module docstring).
    `mode` is torch.compile's; `static_shapes` None: static with "reduce-overhead" (CUDA graphs), in which case
    the forward must trace as one graph (fullgraph: no host sync inside)."""

    def __init__(self, model: nn.Module, device: torch.device, windows: tuple[int | None, ...],
                 mode: str | None = None, static_shapes: bool | None = None):
        self.device = device
        self.static = mode == "reduce-overhead" if static_shapes is None else static_shapes
        self.forward = torch.compile(model.forward, mode=mode, dynamic=None, fullgraph=self.static)
        self.windows = windows  # every attention window of the model (None: full attention), one mask each

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache) -> torch.Tensor:
        # lazy: torch._dynamo takes seconds to import and only compiled decoding needs it
        from torch._dynamo import maybe_mark_dynamic

        view = cache.step_view()
        batch = tokens.shape[0]
        if self.static:
            tokens, positions, view = pad_step(tokens, positions, view, cache.null_slot)
        keys = torch.arange(view.length, device=positions.device).expand(tokens.shape[0], -1)
        # always a mask tensor (the eager path drops an all-true one): one graph serves every step
        view.step_masks = {window: attention_mask(positions, keys, window) for window in self.windows}
        masks = list(view.step_masks.values())
        storage = [getattr(pool, name) for layer in view.pools for pool in layer for name in pool.storage]
        if self.static and self.device.type == "cuda" and not getattr(cache, "static_addresses", False):
            mark_static_addresses(storage)
            cache.static_addresses = True
        tables = [t for kernel in view.kernel or () for t in (kernel.block_table, kernel.context_lens)]
        for tensor in (tokens, positions, *view.write_slots, *view.read_slots, *masks, *storage, *tables):
            maybe_mark_dynamic(tensor, 0)
        for table in tables[::2]:
            maybe_mark_dynamic(table, 1)
        for mask in masks:
            maybe_mark_dynamic(mask, 3)
        return self.forward(tokens, positions, view)[:batch, -1]


def mark_static_addresses(storage: list[torch.Tensor]) -> None:
    """The pools are written in place by every step: as static addresses a CUDA graph writes them where they
    are (cudagraph trees would otherwise copy, or skip capturing, a mutated input)."""
    # lazy: torch._dynamo takes seconds to import and only compiled decoding needs it
    from torch._dynamo import mark_static_address

    for tensor in storage:
        mark_static_address(tensor)


def pad_step(tokens: torch.Tensor, positions: torch.Tensor, view: StepView, null_slot: int):
    """A decode step padded to its static bucket: rows up to the next batch size, the history read up to a
    multiple of DECODE_LENGTH_STEP. Padding rows hold token 0 at position 0, written to and read from the null
    slot: they see one finite key and are cut off after the forward; padded keys lie past every real row's
    position, so the causal mask hides them."""
    B, S = tokens.shape[0], view.length
    rows = next((size for size in DECODE_BATCH_SIZES if size >= B), B) - B
    length = -(-S // DECODE_LENGTH_STEP) * DECODE_LENGTH_STEP
    read = tuple(pad(r.view(B, S), (0, length - S, 0, rows), value=null_slot).reshape(-1)
                 for r in view.read_slots)
    write = tuple(pad(w, (0, rows), value=null_slot) for w in view.write_slots)
    kernel = view.kernel
    if kernel is not None:  # padding rows read one token, the null block's first slot, which they wrote
        padded = []
        for tables in kernel:
            bs, table = tables.block_size, tables.block_table
            null_block = null_slot // bs
            width = -(-length // bs)
            padded.append(DecodeTables(pad(table, (0, width - table.shape[1], 0, rows), value=null_block),
                                       pad(tables.context_lens, (0, rows), value=1), bs))
        kernel = tuple(padded)
    return (pad(tokens, (0, 0, 0, rows)), pad(positions, (0, 0, 0, rows)),
            StepView(view.pools, write, read, length, kernel, view.layer_group))
