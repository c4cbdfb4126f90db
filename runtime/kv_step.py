"""One forward of the paged KV cache as index tensors: where each layer writes the step's tokens and what it
reads back, per KV-cache group, built once by `PagedKVCache.prepare` and used by every layer.

    step = build_step(tables, lengths, positions, valid, None, None, block_size=16, null_block=256,
                      null_slot=4096, device=torch.device("cpu"), decode_kernel=False)
    step.write_slots[g], step.read_slots[g]          # group g's [N] and [B * S] slots
    view = StepView(pools, step.write_slots, step.read_slots, step.length, step.kernel, layer_group)

`StepView` is such a step as tensor operations only (what a compiled decode step traces); `DecodeTables` are
what the paged decode kernels index the pools by, and `kernel_attention` writes a one-token step and attends
through them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kiln.kernels import gpu
from kiln.kernels.errors import KilnError
from kiln.runtime.kv_pools import on_device


class StepView:
    """One prepared forward of a PagedKVCache as tensor operations only: no checks, no host syncs, no Python
    value the forward reads that changes between steps (batch and history length are only tensor shapes). It
    is what a compiled decode step (torch.compile; a CUDA graph on GPU) traces: the writes are in-place index
    copies into the same pools the eager path uses, so the two paths share one cache. The caller fills
    `step_masks` (the attention masks by sliding window) before the forward; the eager path makes them inside.
    `length` (S, the history read) is for the caller; the forward never reads it. The slots and decode tables
    are per KV-cache group (`layer_group[layer]` names a layer's)."""

    explicit_mask = None

    def __init__(self, pools, write_slots: tuple[Tensor, ...], read_slots: tuple[Tensor, ...], length: int,
                 kernel: tuple[DecodeTables, ...] | None = None, layer_group: Sequence[int] | None = None):
        self.pools, self.write_slots, self.read_slots, self.length = pools, write_slots, read_slots, length
        self.kernel = kernel
        self.layer_group = tuple(layer_group) if layer_group is not None else (0,) * len(pools)
        self.step_masks: dict = {}

    @property
    def decode_kernel(self) -> bool:
        return self.kernel is not None

    def decode_attention(self, layer: int, q: Tensor | tuple[Tensor, Tensor], new: tuple[Tensor, Tensor],
                         scale: float) -> Tensor:
        """Write the step's two streams and attend through the layer's paged decode kernel, which reads the
        pools as stored (see `kernel_attention`)."""
        g = self.layer_group[layer]
        return kernel_attention(self.pools[layer], self.write_slots[g], self.kernel[g], q, new, scale)

    def update(self, layer: int, new: tuple[Tensor, ...], positions: Tensor) -> tuple[Tensor, ...]:
        # new[i]: [B, T, H, D] -> every stream of the batch's sequences, [B, S, H, D] in the model's dtype
        g = self.layer_group[layer]
        out = []
        for pool, value in zip(self.pools[layer], new, strict=True):
            pool.write(self.write_slots[g], value.reshape(-1, *value.shape[2:]))
            out.append(pool.read(self.read_slots[g]).view(value.shape[0], -1, *value.shape[2:]))
        return tuple(out)


@dataclass
class DecodeTables:
    """What the paged decode kernel (kiln.kernels.gpu.paged_decode_attention) indexes a step's pools by."""

    block_table: Tensor  # int32 [B, max blocks], the null block past each table
    context_lens: Tensor  # int32 [B]: tokens each row attends, its new one included
    block_size: int


def kernel_attention(pools, write_slots: Tensor, tables: DecodeTables, q: Tensor | tuple[Tensor, Tensor],
                      new: tuple[Tensor, Tensor], scale: float) -> Tensor:
    """Write a one-token step's two streams and attend through the decode kernel of the layer's kind: GQA's
    (q [B, 1, H, D] -> [B, 1, H, D]) or MLA's absorbed one (q = (q_latent, q_rot) [B, 1, H, r | rope], the
    streams the latent and the rotary key -> the mix of latents [B, 1, H, r])."""
    for pool, value in zip(pools, new, strict=True):
        pool.write(write_slots, value.reshape(-1, *value.shape[2:]))
    first, second = (pool.kernel_pool for pool in pools)  # built with the pool: its tensors never move
    if isinstance(q, tuple):
        out = gpu.mla_decode_attention(q[0][:, 0], q[1][:, 0], first, second, tables.block_table,
                                       tables.context_lens, tables.block_size, scale)
    else:
        out = gpu.paged_decode_attention(q[:, 0], first, second, tables.block_table, tables.context_lens,
                                         tables.block_size, scale)
    return out.unsqueeze(1)


@dataclass
class PreparedStep:
    """Index tensors for one forward, computed once in `prepare` and used by every layer (slots per group)."""

    positions: Tensor  # [B, T] storage positions (where each token is written)
    valid: Tensor | None  # [N] the written tokens' rows in [B * T] (row-major), None when every token is written
    write_slots: tuple[Tensor, ...]  # per group [N]: slot of each written token, row-major over the valid tokens
    read_slots: tuple[Tensor, ...]  # per group [B * S]
    batch: int
    length: int  # S
    rope_positions: Tensor | None = None  # [B, T] the model's positions when they differ (tree verification)
    attend: Tensor | None = None  # [B, 1, T, S] bool: an explicit attention mask (tree verification)
    key_positions: Tensor | None = None  # [B, S] with `attend`: each key's model position (a node's depth's)
    masks: dict = field(default_factory=dict)  # causal masks by window, filled by the model's first layer
    kernel: tuple[DecodeTables, ...] | None = None  # per group, a plain one-token step through the kernel


def build_step(tables: Sequence[list[list[int]]], lengths: Sequence[int], positions: Tensor, valid: Tensor | None,
               rope_positions: Tensor | None, attend: Tensor | None, block_size: int, null_block: int,
               null_slot: int, device: torch.device, decode_kernel: bool) -> PreparedStep:
    """The index tensors of a forward whose rows hold the sequences with block `tables` (per row, per group) and
    `lengths` (positions held, this forward's included); positions and valid as `PagedKVCache.prepare` takes
    them, on the host. Decode tables when `decode_kernel` and the step is a plain one-token step."""
    B, T = positions.shape
    width = max(1, max(len(t[0]) for t in tables))
    null = [null_block]  # where unallocated or released
    bs = block_size
    p = positions.clamp(0, width * bs - 1)  # padding may point past the table; it is never written
    S = max(lengths)
    k = torch.arange(S)
    held = torch.tensor(list(lengths)).unsqueeze(1)
    if attend is not None and attend.shape != (B, 1, T, S):
        raise KilnError(f"prepare: attend must be [{B}, 1, {T}, {S}], got {list(attend.shape)}")
    kernel = None
    if decode_kernel and T == 1 and valid is None and rope_positions is None and attend is None:
        kernel = []
    write_slots, read_slots = [], []
    for g in range(len(tables[0])):
        block_ids = torch.tensor([t[g] + null * (width - len(t[g])) for t in tables], dtype=torch.long)
        slots = block_ids.gather(1, p // bs) * bs + p % bs
        write_slots.append((slots.reshape(-1) if valid is None else slots[valid]).to(device))
        read = block_ids[:, k // bs] * bs + k % bs  # [B, S]
        read_slots.append(torch.where(k < held, read, null_slot).reshape(-1).to(device))
        if kernel is not None:
            kernel.append(DecodeTables(block_ids.to(device, torch.int32), held.squeeze(1).to(device, torch.int32),
                                       bs))
    written = None if valid is None else valid.reshape(-1).nonzero().squeeze(1)  # on the host: no sync
    key_positions = None
    if attend is not None:
        key_positions = _key_positions(positions, valid, rope_positions, S).to(device)
    return PreparedStep(positions.to(device), on_device(written, device), tuple(write_slots), tuple(read_slots), B,
                        S, on_device(rope_positions, device), on_device(attend, device), key_positions,
                        kernel=None if kernel is None else tuple(kernel))


def _key_positions(positions: Tensor, valid: Tensor | None, rope_positions: Tensor | None, length: int) -> Tensor:
    """[B, S] each key's model position under an explicit mask: its storage position, but a tree node's key sits
    at its depth's position (`rope_positions`)."""
    B, T = positions.shape
    key_positions = torch.arange(length).expand(B, -1).clone()
    if rope_positions is not None:
        rows = torch.arange(B).unsqueeze(1).expand(B, T)
        at = positions if valid is None else torch.where(valid, positions, length)
        keep = at < length
        key_positions[rows[keep], at[keep]] = rope_positions.cpu()[keep]
    return key_positions
