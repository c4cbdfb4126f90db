"""A paged KV cache: fixed-size blocks, block tables per sequence and KV-cache group, allocation on demand,
quantized storage, and sliding-window layers that keep only their window.

    cache = PagedKVCache(engine.kv_streams, num_blocks=256, block_size=16, windows=engine.kv_windows)
    cache.add_sequence("a"); cache.add_sequence("b")
    cache.prepare(["a", "b"], positions, valid)   # allocate the blocks these positions need: all or none
    logits = model(tokens, positions, cache)      # each layer: cache.update(layer, (k, v), positions)
    cache.free_sequence("a")                      # its blocks go back to the free list

KV-cache groups (runtime.kv_pools.kv_groups: layers by attention type). Every group has its own block table
per sequence, and all draw block ids from one `BlockAllocator`, so memory moves freely between groups: a block
id belongs to one group at a time. Without windows there is one group of every layer, and everything below
reads as one table per sequence.

Storage (runtime.kv_pools): per storage slot and stream, one pool of (num_blocks + 1) * block_size token slots
in the layer's KV format; layer j of every group shares slot j's tensors, so a block id costs one group's layers
(`pool_bytes_per_token`). The extra last block is the null block: zeros, never handed out; reads past a
sequence's length, and of released blocks, point at it. Block ids and the prefix index: runtime.kv_blocks; a
prepared forward's index tensors: runtime.kv_step.

Sliding windows. A query at position q of a W-token window layer sees keys q - W + 1..q. `prepare` takes a row's
lowest written position p as the lowest any of its future queries can have (a speculative rollback keeps at
least the token it fed first; `lookahead` allows more) and, in each window group, releases the blocks wholly
before p - lookahead - W + 1 before it allocates: the table keeps their places as the null block, so positions
and the history read stay as they were, and the window mask hides those positions anyway (their weight is an
exact 0, so logits are bit-identical to a cache that keeps everything). A sequence's window group so holds at
most blocks_for(W - 1 + lookahead + the forward's width) + 1 blocks (`sequence_blocks`); a released block that
is registered in the prefix index stays cached like any released block, and a prefix hit needs, in a window
group, only the cached blocks inside its first query's window. `truncate` refuses to roll back to where a
released block would be seen.

`update` writes the new tokens of each row into that row's own blocks (rows' padding positions, marked
invalid in `prepare`, are never written) and returns every stream gathered and dequantized to the model's
dtype [B, S, H, D] for S = the longest sequence in the batch: the same contract as the contiguous reference
cache's `update` (tests/runtime/contiguous_kv_cache.py), so attention reads through it unchanged. When a step
needs more blocks than are free, `prepare` raises `KvCacheFull` before anything is allocated or written; the
caller waits for sequences to finish or refuses.

The pools live on the cache's `device`; block tables and the scheduling arithmetic stay on the host, and
`prepare` copies each forward's index tensors to the device once (so a GPU forward reads no host tensor).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from kiln.kernels.errors import KilnError
from kiln.runtime.kv_blocks import BlockAllocator, KvCacheFull, chain_hash, index_key, prompt_block_hashes
from kiln.runtime.kv_format import KvStream
from kiln.runtime.kv_pools import allocate_pools, copy_rows, kv_groups
from kiln.runtime.kv_step import PreparedStep, StepView, build_step, kernel_attention

DEFAULT_BLOCK_SIZE = 16


class PagedKVCache:
    """Block pools per layer and stream, block tables per sequence and KV-cache group, a shared block allocator.

    With `prefix_caching`, full blocks are shared between sequences by content (vLLM's automatic prefix
    caching): `add_sequence(id, tokens)` starts a sequence on the cached blocks of its longest cached prefix
    and returns how many tokens it need not recompute; `commit(id, tokens)` registers the sequence's newly
    filled blocks. A write into a block another sequence also holds copies it first (copy on write), and a
    registered block that is about to change leaves the index, so a cached block's content never changes.

    `windows` (per layer, None: full attention; default: none) groups the layers (`kv_groups`); a window group
    releases the blocks no future query can see (see the module docstring). `lookahead`: positions a `truncate`
    may roll a sequence back below the lowest position its latest forward wrote (0: speculative verification
    never rolls back past the token it fed first)."""

    def __init__(self, streams: Sequence[Sequence[KvStream]], num_blocks: int,
                 block_size: int = DEFAULT_BLOCK_SIZE, dtype: torch.dtype = torch.float32,
                 prefix_caching: bool = False, device: torch.device | str = "cpu", decode_kernel: bool = False,
                 windows: Sequence[int | None] | None = None, lookahead: int = 0):
        # streams[layer] = the layer's KvStreams (runtime.kv_format.resolve_kv_streams); dtype: the model's
        # compute dtype (what reads return, and what BF16 layers store)
        if not isinstance(block_size, int) or block_size < 1:
            raise KilnError(f"block_size must be a positive integer, got {block_size!r}")
        windows = [None] * len(streams) if windows is None else list(windows)
        if len(windows) != len(streams):
            raise KilnError(f"windows: {len(windows)} entries for {len(streams)} layers")
        if any(w is not None and (not isinstance(w, int) or w < 1) for w in windows):
            raise KilnError(f"a sliding window must be a positive integer, got {windows}")
        if not isinstance(lookahead, int) or lookahead < 0:
            raise KilnError(f"lookahead must be a non-negative integer, got {lookahead!r}")
        self.block_size = block_size
        self.lookahead = lookahead
        self.device, self.dtype = torch.device(device), dtype
        # one-token steps attend through kiln.kernels.gpu.paged_decode_attention, reading the pools as stored
        # (a GPU engine's default), where the layer's shape allows (runtime.attention.GqaAttention)
        self.use_decode_kernel = decode_kernel
        self.allocator = BlockAllocator(num_blocks)
        self.null_block = num_blocks  # the last block of every pool: zeros, never handed out
        self.null_slot = num_blocks * block_size  # first slot of the null block
        self.groups = kv_groups(windows)
        self.layer_group = [0] * len(streams)
        for g, group in enumerate(self.groups):
            for layer in group.layers:
                self.layer_group[layer] = g
        self._windowed = [g for g, group in enumerate(self.groups) if group.window is not None]
        self.pools, self.nbytes = allocate_pools(streams, self.groups, num_blocks, block_size, dtype, self.device)
        self.block_tables: dict[Hashable, list[int]] = {}  # group 0's table, per sequence
        self.group_tables: dict[Hashable, list[list[int]]] = {}  # every group's, per sequence
        self._released: dict[Hashable, list[int]] = {}  # per sequence and group: leading entries released
        self.lengths: dict[Hashable, int] = {}  # highest written position + 1, per sequence
        self._step: PreparedStep | None = None
        self.prefix_caching = prefix_caching
        self._hashes: dict[Hashable, list[bytes]] = {}  # chained hashes of each sequence's leading full blocks
        self.prefix_queried = 0  # prompt tokens looked up, and of those found cached
        self.prefix_hits = 0
        self.copies_on_write = 0
        self.window_releases = 0  # blocks released because they left a window
        self._forked = False  # whether fork has shared blocks (prefix caching shares them too)

    # --- bookkeeping -----------------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.allocator.num_used

    @property
    def windowed(self) -> bool:
        """Whether some group has a sliding window (and releases the blocks that leave it)."""
        return bool(self._windowed)

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens served from cached blocks over prompt tokens looked up (0 before any lookup)."""
        return self.prefix_hits / self.prefix_queried if self.prefix_queried else 0.0

    def blocks_for(self, tokens: int) -> int:
        """Entries a group's table needs to cover `tokens` positions."""
        return -(-tokens // self.block_size)

    def _releasable(self, window: int, position: int) -> int:
        """Leading blocks of a window group's table no query at `position` or later can see, with `lookahead`
        positions of rollback kept: those wholly before position - lookahead - window + 1."""
        return max(0, position - self.lookahead - window + 1) // self.block_size

    def sequence_blocks(self, tokens: int, step: int | None = None) -> int:
        """The most blocks, all groups together, one sequence holds while it grows to `tokens` positions, each
        forward writing at most `step` positions (None: all at once): blocks_for(tokens) in a full-attention
        group; in a window group at most the blocks spanning window - 1 + lookahead + step positions."""
        full = self.blocks_for(tokens)
        if not self._windowed:
            return full * len(self.groups)
        step = tokens if step is None else max(1, step)
        total = 0
        for group in self.groups:
            if group.window is None:
                total += full
            else:
                total += min(full, self.blocks_for(group.window - 1 + self.lookahead + step) + 1)
        return total

    def max_sequence_tokens(self, step: int | None = None) -> int:
        """The most positions one sequence can hold in this pool (`sequence_blocks` <= num_blocks)."""
        low, high = 0, self.num_blocks * self.block_size  # sequence_blocks grows with tokens
        while low < high:
            mid = (low + high + 1) // 2
            if self.sequence_blocks(mid, step) <= self.num_blocks:
                low = mid
            else:
                high = mid - 1
        return low

    def blocks_needed(self, seq_id: Hashable, end: int, step: int | None = None) -> int:
        """Blocks the sequence takes from the pool, beyond those it holds, to hold positions up to `end` with
        forwards of at most `step` positions from its length on (None: one forward): the table entries it adds,
        less what its window groups release that only it holds. Negative when it gives back more. A sequence
        without windows: blocks_for(end) minus its table's length."""
        tables = self._tables(seq_id)
        length = self.lengths[seq_id]
        need = 0
        for g, group in enumerate(self.groups):
            table = tables[g]
            if group.window is None:
                need += self.blocks_for(end) - len(table)
                continue
            released = self._released[seq_id][g]
            low = max(released, self._releasable(group.window, length))
            span = self.blocks_for(end) - low
            if step is not None and step < end - length:
                span = min(span, self.blocks_for(group.window - 1 + self.lookahead + step) + 1)
            held = [b for b in table[released:] if b != self.null_block]
            gone = sum(1 for b in table[released:low] if b != self.null_block and self.allocator.refs(b) > 1)
            need += span - len(held) + gone  # a shared block that leaves the table frees nothing
        return need

    def sequences(self) -> list[Hashable]:
        return list(self.block_tables)

    def _new_tables(self, seq_id: Hashable, tables: list[list[int]], released: list[int]) -> None:
        self.group_tables[seq_id] = tables
        self.block_tables[seq_id] = tables[0]
        self._released[seq_id] = released

    def add_sequence(self, seq_id: Hashable, tokens: Sequence[int] | None = None) -> int:
        """Start a sequence. With prefix caching and its `tokens` (the prompt), its tables start with the cached
        blocks of its longest cached prefix of full blocks, short of the last token (whose logits the caller
        needs computed); returns the number of tokens so cached (0 without prefix caching). A window group needs
        only the cached blocks inside the window of that prefix's first query; the rest of its table is null."""
        if seq_id in self.block_tables:
            raise KilnError(f"sequence {seq_id!r} is already in the KV cache")
        tables: list[list[int]] = [[] for _ in self.groups]
        released = [0] * len(self.groups)
        hashes: list[bytes] = []
        if self.prefix_caching and tokens:
            bs, hashes = self.block_size, prompt_block_hashes(tokens, self.block_size)
            found = [[self.allocator.lookup(index_key(g, d)) for d in hashes] for g in range(len(self.groups))]
            hit = len(hashes)
            for g, group in enumerate(self.groups):
                if group.window is None:
                    hit = min(hit, next((i for i, b in enumerate(found[g]) if b is None), len(hashes)))
            while hit and any(None in found[g][self._releasable(self.groups[g].window, hit * bs):hit]
                              for g in self._windowed):
                hit -= 1
            del hashes[hit:]
            for g, group in enumerate(self.groups):
                low = 0 if group.window is None else min(hit, self._releasable(group.window, hit * bs))
                released[g] = low
                tables[g] = [self.null_block] * low + found[g][low:hit]
                for block in tables[g][low:]:
                    self.allocator.share(block)
            self.prefix_queried += len(tokens)
            self.prefix_hits += hit * bs
        self._new_tables(seq_id, tables, released)
        self.lengths[seq_id] = len(tables[0]) * self.block_size
        self._hashes[seq_id] = hashes
        return self.lengths[seq_id]

    def commit(self, seq_id: Hashable, tokens: Sequence[int]) -> None:
        """Register the sequence's full blocks written since the last commit under their content hashes
        (`tokens`: the sequence's tokens, at least as many as it holds), in every group that still holds them.
        A no-op without prefix caching."""
        if not self.prefix_caching:
            return
        tables, hashes, bs = self._tables(seq_id), self._hashes[seq_id], self.block_size
        if len(tokens) < self.lengths[seq_id]:
            raise KilnError(f"commit: {len(tokens)} tokens for sequence {seq_id!r}, which holds "
                            f"{self.lengths[seq_id]}")
        for i in range(len(hashes), self.lengths[seq_id] // bs):
            hashes.append(chain_hash(hashes[-1] if hashes else b"", tokens[i * bs: (i + 1) * bs]))
            for g, table in enumerate(tables):
                if table[i] != self.null_block:
                    self.allocator.register(table[i], index_key(g, hashes[-1]))

    def fork(self, seq_id: Hashable, new_id: Hashable) -> None:
        """A second sequence holding everything `seq_id` holds, sharing its blocks (parallel sampling of one
        prompt); the first write into a shared block copies it."""
        if new_id in self.block_tables:
            raise KilnError(f"sequence {new_id!r} is already in the KV cache")
        tables = self._tables(seq_id)
        self._forked = True
        for table in tables:
            for block in table:
                if block != self.null_block:
                    self.allocator.share(block)
        self._new_tables(new_id, [list(t) for t in tables], list(self._released[seq_id]))
        self.lengths[new_id] = self.lengths[seq_id]
        self._hashes[new_id] = list(self._hashes[seq_id])

    def free_sequence(self, seq_id: Hashable) -> None:
        """The sequence ended: its blocks go back to the free list (registered full blocks stay cached)."""
        for table in self._tables(seq_id):
            self.allocator.release([b for b in table if b != self.null_block])
        del self.block_tables[seq_id], self.group_tables[seq_id], self._released[seq_id]
        del self.lengths[seq_id], self._hashes[seq_id]
        self._step = None

    def _release_window(self, seq_id: Hashable, position: int) -> None:
        """In each window group, release the leading blocks no query at `position` or later can see: the table
        keeps their places as the null block (a registered block stays cached)."""
        tables, released = self.group_tables[seq_id], self._released[seq_id]
        for g in self._windowed:
            low = self._releasable(self.groups[g].window, position)
            if low <= released[g]:
                continue
            table = tables[g]
            if len(table) < low:
                table.extend([self.null_block] * (low - len(table)))
            gone = [b for b in table[released[g]:low] if b != self.null_block]
            self.allocator.release(gone)
            self.window_releases += len(gone)
            table[released[g]:low] = [self.null_block] * (low - released[g])
            released[g] = low

    def _writable(self, seq_id: Hashable, first: int, end: int, plan_only: bool = False) -> int:
        """Make the blocks the sequence will write at positions first..end-1 its own, in every group: a block
        another sequence holds is copied (copy on write), a registered one leaves the prefix index. Returns the
        number of copies that needs (and makes none) when `plan_only`."""
        bs = self.block_size
        copies = 0
        for g, table in enumerate(self.group_tables[seq_id]):
            for i in range(first // bs, min(self.blocks_for(end), len(table))):
                block = table[i]
                if block == self.null_block:
                    continue
                if self.allocator.refs(block) > 1:
                    copies += 1
                    if not plan_only:
                        (new,) = self.allocator.allocate(1)
                        self._copy_block(g, block, new)
                        self.allocator.release([block])
                        table[i] = new
                        self.copies_on_write += 1
                elif not plan_only and self.allocator.is_registered(block):
                    self.allocator.unregister(block)
        if not plan_only:
            del self._hashes[seq_id][first // bs:]
        return copies

    def _copy_block(self, g: int, src: int, dst: int) -> None:
        bs = self.block_size
        src_slots = torch.arange(src * bs, (src + 1) * bs, device=self.device)
        dst_slots = torch.arange(dst * bs, (dst + 1) * bs, device=self.device)
        self._copy_slots(self.groups[g].layers, src_slots, dst_slots)

    def _copy_slots(self, layers: Sequence[int], src: Tensor, dst: Tensor) -> None:
        for layer in layers:
            for pool in self.pools[layer]:
                for name in pool.storage:
                    copy_rows(getattr(pool, name), src, dst)

    def truncate(self, seq_id: Hashable, length: int) -> None:
        """Keep the sequence's first `length` positions (speculative decoding rolls back rejected drafts):
        blocks past them go back to the free list; what a kept block holds past `length` is never read (reads
        stop at the sequence's length) and is overwritten by the next tokens. Refused when a window group has
        released a block a query at `length` would see (a rollback further than `lookahead` allows)."""
        tables = self._tables(seq_id)
        if not 0 <= length <= self.lengths[seq_id]:
            raise KilnError(f"truncate: sequence {seq_id!r} holds {self.lengths[seq_id]} positions, cannot keep "
                            f"{length}")
        for g in self._windowed:
            if self._released[seq_id][g] * self.block_size > max(0, length - self.groups[g].window + 1):
                raise KilnError(f"truncate: sequence {seq_id!r} has released the blocks before position "
                                f"{self._released[seq_id][g] * self.block_size} of its {self.groups[g].window}-token "
                                f"window layers; it cannot roll back to {length} (lookahead {self.lookahead})")
        keep = self.blocks_for(length)
        for table in tables:
            self.allocator.release([b for b in table[keep:] if b != self.null_block])
            del table[keep:]
        del self._hashes[seq_id][length // self.block_size:]
        self.lengths[seq_id] = length
        self._step = None

    def _tables(self, seq_id: Hashable) -> list[list[int]]:
        try:
            return self.group_tables[seq_id]
        except KeyError:
            raise KilnError(f"sequence {seq_id!r} is not in the KV cache; add_sequence it first") from None

    # --- one forward -----------------------------------------------------------------------------------------
    def prepare(self, seq_ids: Sequence[Hashable], positions: Tensor, valid: Tensor | None = None,
                rope_positions: Tensor | None = None, attend: Tensor | None = None) -> Tensor:
        """Bind the rows of the next forward to sequences and allocate the blocks their valid positions need.
        Returns the positions the forward runs with (`rope_positions` if given, else `positions`) on the
        cache's device: the tensor to pass to the model (the same object when it is already there).

        positions: [B, T] absolute positions; valid: [B, T] bool, False for padding (never written); both
        best on the host (they are read there).
        A row's lowest written position is the lowest any of its future queries has (less `lookahead`): its
        window groups first release the blocks that puts out of every window.
        All or nothing: raises KvCacheFull, with nothing allocated or written, when the blocks run out.
        Tree verification writes each node at its own storage position (`positions`) while the model runs it at
        its depth's position (`rope_positions`), and sees its ancestors only (`attend`, [B, 1, T, S]).
        """
        B, T = positions.shape
        positions, valid = positions.cpu(), None if valid is None else valid.cpu()
        if len(seq_ids) != B:
            raise KilnError(f"prepare: {len(seq_ids)} sequence ids for a batch of {B} rows")
        if valid is not None and bool(valid.all()):
            valid = None
        negative = positions < 0 if valid is None else (positions < 0) & valid
        if bool(negative.any()):
            raise KilnError("prepare: positions must be non-negative")
        masked = positions if valid is None else torch.where(valid, positions, -1)
        ends = (masked.amax(dim=1) + 1).tolist() if T else [0] * B
        tables = [self._tables(s) for s in seq_ids]
        firsts = None
        if self.prefix_caching or self._forked or self._windowed:
            firsts = (positions if valid is None else torch.where(valid, positions, 1 << 62)).amin(dim=1).tolist()
        if self._windowed:
            for seq_id, first, end in zip(seq_ids, firsts, ends, strict=True):
                if first < end:
                    self._release_window(seq_id, first)
        needed = [sum(max(0, self.blocks_for(end) - len(t)) for t in table) for end, table in zip(ends, tables,
                                                                                                    strict=True)]
        if self.prefix_caching or self._forked:  # writes into shared blocks copy them first: count the copies
            needed = [n + self._writable(s, first, end, plan_only=True)
                      for s, n, first, end in zip(seq_ids, needed, firsts, ends, strict=True)]
        if sum(needed) > self.allocator.num_free:
            raise KvCacheFull(f"KV cache out of blocks: this step needs {sum(needed)} more blocks of "
                              f"{self.block_size} tokens and {self.allocator.num_free} of {self.num_blocks} are "
                              "free; nothing was written (wait for sequences to finish, or add blocks)")
        if self.prefix_caching or self._forked:
            for seq_id, first, end in zip(seq_ids, firsts, ends, strict=True):
                if first < end:
                    self._writable(seq_id, first, end)
        for table, end in zip(tables, ends, strict=True):
            for t in table:
                if self.blocks_for(end) > len(t):
                    t.extend(self.allocator.allocate(self.blocks_for(end) - len(t)))
        for seq_id, end in zip(seq_ids, ends, strict=True):
            self.lengths[seq_id] = max(self.lengths[seq_id], end)
        self._step = build_step(tables, [self.lengths[s] for s in seq_ids], positions, valid, rope_positions, attend,
                                self.block_size, self.null_block, self.null_slot, self.device,
                                self.use_decode_kernel)
        return self._step.positions if rope_positions is None else self._step.rope_positions

    def step_view(self) -> StepView:
        """The prepared forward as a `StepView`, for a compiled decode step: it must be a plain forward (every
        token written, no tree verification)."""
        step = self._step
        if step is None or step.valid is not None or step.rope_positions is not None or step.attend is not None:
            raise KilnError("step_view: prepare(seq_ids, positions) a plain forward first (no padding, no tree)")
        return StepView(self.pools, step.write_slots, step.read_slots, step.length, step.kernel, self.layer_group)

    @property
    def decode_kernel(self) -> bool:
        """Whether the prepared forward attends through the paged decode kernel (see `decode_attention`)."""
        return self._step is not None and self._step.kernel is not None

    def decode_attention(self, layer: int, q: Tensor | tuple[Tensor, Tensor], new: tuple[Tensor, Tensor],
                         scale: float) -> Tensor:
        """Write the step's two streams and attend through the layer's paged decode kernel, which reads the
        pools as stored (see `kiln.runtime.kv_step.kernel_attention`). Only when `decode_kernel` says the step allows it."""
        g = self.layer_group[layer]
        return kernel_attention(self.pools[layer], self._step.write_slots[g], self._step.kernel[g], q, new, scale)

    @property
    def step_masks(self) -> dict | None:
        """The prepared forward's attention masks by sliding window, computed by the first layer that needs
        one and reused by the others (None: no forward prepared)."""
        return None if self._step is None else self._step.masks

    @property
    def explicit_mask(self) -> Tensor | None:
        """The prepared forward's explicit attention mask, or None (causal by position)."""
        return None if self._step is None else self._step.attend

    @property
    def explicit_key_positions(self) -> Tensor | None:
        """With an explicit mask, each key's model position [B, S] (a tree node's is its depth's), which a
        window layer's mask is cut by."""
        return None if self._step is None else self._step.key_positions

    def move(self, seq_id: Hashable, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy what the sequence holds at positions `src` to positions `dst` (stored bytes as they are, every
        layer and stream): a tree verification's accepted path moves to consecutive positions."""
        tables = self._tables(seq_id)
        bs = self.block_size

        if any(p >= self.lengths[seq_id] for p in (*src, *dst)):
            raise KilnError(f"move: positions past sequence {seq_id!r}'s length {self.lengths[seq_id]}")
        if not src:
            return
        if any(tables[g][p // bs] == self.null_block for g in self._windowed for p in (*src, *dst)):
            raise KilnError(f"move: sequence {seq_id!r} has released the blocks of these positions in its window "
                            "layers")
        if self.prefix_caching or self._forked:
            if self._writable(seq_id, min(dst), max(dst) + 1, plan_only=True) > self.allocator.num_free:
                raise KvCacheFull("move: no free block to copy a shared block into; nothing was written")
            self._writable(seq_id, min(dst), max(dst) + 1)

        def slots(table, positions):
            return torch.tensor([table[p // bs] * bs + p % bs for p in positions], dtype=torch.long,
                                device=self.device)

        for g, group in enumerate(self.groups):
            self._copy_slots(group.layers, slots(tables[g], src), slots(tables[g], dst))
        self._step = None

    def update(self, layer: int, new: tuple[Tensor, ...], positions: Tensor) -> tuple[Tensor, ...]:
        # new[i]: [B, T, H, D] -> every stream of the batch's sequences, [B, S, H, D] in the model's dtype
        step = self._step
        expected = None if step is None else step.positions if step.rope_positions is None else step.rope_positions
        if step is None or not (positions is expected or (positions.device == expected.device
                                                          and torch.equal(positions, expected))):
            raise KilnError("PagedKVCache.update: call prepare(seq_ids, positions) before this forward")
        g = self.layer_group[layer]
        out = []
        for pool, value in zip(self.pools[layer], new, strict=True):
            tokens = value.reshape(-1, *value.shape[2:])
            if step.valid is not None:
                tokens = tokens.index_select(0, step.valid)
            if tokens.shape[0]:
                pool.write(step.write_slots[g], tokens)
            out.append(pool.read(step.read_slots[g]).view(step.batch, step.length, *value.shape[2:]))
        return tuple(out)
