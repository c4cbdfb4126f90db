"""A paged KV cache: fixed-size blocks, block tables per sequence and KV-cache group, allocation on demand,
quantized storage, and sliding-window layers that keep only their window.

    cache = PagedKVCache(engine.kv_streams, num_blocks=256, block_size=16, windows=engine.kv_windows)
    cache.add_sequence("a"); cache.add_sequence("b")
    cache.prepare(["a", "b"], positions, valid)   # allocate the blocks these positions need: all or none
    logits = model(tokens, positions, cache)      # each layer: cache.update(layer, (k, v), positions)
    cache.free_sequence("a")                      # its blocks go back to the free list

KV-cache groups (vLLM's hybrid KV-cache manager). Layers are grouped by attention type (`kv_groups`: full
attention, or a sliding window of W tokens); when types mix, each type's layers are cut into groups of the
smallest type's layer count (Gemma 3 270M: 3 full-attention layers and 15 windowed -> one full group and five
window groups of 3). Every group has its own block table per sequence, and all draw block ids from one
`BlockAllocator`, so memory moves freely between groups: a block id belongs to one group at a time. Without
windows there is one group of every layer, and everything below reads as one table per sequence.

Storage, per storage slot and stream, is one pool of (num_blocks + 1) * block_size token slots [slots, H, D'],
slot = block * block_size + offset, in the layer's KV format (runtime.kv_format): the model's dtype for
BF16 layers (fp32 on CPU, bf16 on a GPU), float8_e4m3fn bytes (+ an fp32 scale per token when dynamic) for FP8, packed
E2M1 bytes + E4M3 block scales for NVFP4. Layer j of every group shares slot j's tensors (a block id is one
group's at a time, so their writes never meet), which is what makes a block id cost one group's layers and not
every layer's (`pool_bytes_per_token`); a layer whose layout (format, shapes) differs from the slot's keeps
tensors of its own. Scales and offsets stay per layer. The extra last block is the null block: zeros, never
handed out; reads past a sequence's length, and of released blocks, point at it.

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
cache's `update` (tests/runtime/contiguous_kv_cache.py), so attention reads through it unchanged. When a step needs more blocks than are free, `prepare` raises
`KvCacheFull` before anything is allocated or written; the caller waits for sequences to finish or refuses.

The pools live on the cache's `device`; block tables and the scheduling arithmetic stay on the host, and
`prepare` copies each forward's index tensors to the device once (so a GPU forward reads no host tensor).
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kiln.kernels.errors import KilnError
from kiln.kernels.formats import KvFormat
from kiln.kernels.kv_quant import (
    fp8_kv_dequantize,
    fp8_kv_quantize,
    fp8_kv_quantize_per_token,
    nvfp4_kv_dequantize,
    nvfp4_kv_quantize,
)
from kiln.kernels.nvfp4 import NVFP4_BLOCK_SIZE
from kiln.kernels.torch_refs import KvPool
from kiln.runtime.kv_format import KvStream

DEFAULT_BLOCK_SIZE = 16


class KvCacheFull(KilnError):
    """The block pool cannot hold what a step needs; nothing was allocated or written."""


class BlockAllocator:
    """Block ids 0..num_blocks-1 with reference counts, and the prefix index of block contents.

    A block is free (on the free list, lowest ids first), in use (reference count >= 1: the sequences whose
    tables hold it), or cached: no sequence holds it but it keeps a full block of tokens under its content
    hash, so a later sequence with the same prefix takes it back (`share`) instead of recomputing it. Cached
    blocks count as free: when the free list is empty, `allocate` evicts the least recently released one.
    A block in use is never evicted, so sharing never exposes a block to being overwritten."""

    def __init__(self, num_blocks: int):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise KilnError(f"a KV cache needs at least one block, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._refs: dict[int, int] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()  # ref-0 blocks with a registered hash, LRU first
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out: free plus cached (evictable)."""
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        return len(self._refs)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def refs(self, block: int) -> int:
        return self._refs.get(block, 0)

    def allocate(self, count: int) -> list[int]:
        if count > self.num_free:
            raise KvCacheFull(f"KV cache out of blocks: {count} needed, {self.num_free} of {self.num_blocks} free")
        blocks = []
        for _ in range(count):
            if self._free:
                block = self._free.pop()
            else:  # evict the least recently used cached block: its prefix is forgotten
                block, _ = self._cached.popitem(last=False)
                del self._block_of[self._hash_of.pop(block)]
                self.evictions += 1
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def share(self, block: int) -> None:
        """One more sequence holds `block` (a prefix hit): a cached block comes back into use."""
        if block in self._cached:
            del self._cached[block]
        elif block not in self._refs:
            raise ValueError(f"block {block} is neither in use nor cached")
        self._refs[block] = self._refs.get(block, 0) + 1

    def release(self, blocks: Sequence[int]) -> None:
        freed = False
        for block in blocks:
            if block not in self._refs:
                raise ValueError(f"block {block} is not allocated (double free?)")
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            del self._refs[block]
            if block in self._hash_of:
                self._cached[block] = None  # most recently used at the end
            else:
                self._free.append(block)
                freed = True
        if freed:
            self._free.sort(reverse=True)

    # --- the prefix index --------------------------------------------------------------------------------
    def lookup(self, digest: bytes) -> int | None:
        return self._block_of.get(digest)

    def register(self, block: int, digest: bytes) -> bool:
        """Record that `block` (in use) holds the full block of tokens `digest` names; False when another
        block already does (the first stays the one later sequences find)."""
        if digest in self._block_of or block in self._hash_of:
            return False
        self._block_of[digest], self._hash_of[block] = block, digest
        return True

    def unregister(self, block: int) -> None:
        """`block` is about to change: it no longer holds the prefix it was registered under."""
        digest = self._hash_of.pop(block, None)
        if digest is not None:
            del self._block_of[digest]

    def is_registered(self, block: int) -> bool:
        return block in self._hash_of


def chain_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The content hash of a full block: SHA-256 of its parent block's hash and its own token ids, so equal
    hashes mean equal whole prefixes (vLLM's hash-chained blocks; SHA-256, as vLLM now defaults to, since a
    crafted collision would serve one user's cached keys to another)."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


# --- storage per stream -----------------------------------------------------------------------------------
def copy_rows(t: Tensor, src: Tensor, dst: Tensor) -> None:
    """t[dst] = t[src], bytes as they are (float8 has no CPU index_copy: its bytes are copied)."""
    view = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
    view.index_copy_(0, dst, view.index_select(0, src))


def _on(t: Tensor | None, device: torch.device) -> Tensor | None:
    return None if t is None else t.to(device)


class _DensePool:
    """Unquantized (BF16 at deployment): the model's compute dtype, so reads equal the uncached values."""

    @staticmethod
    def layout(stream: KvStream, dtype: torch.dtype) -> tuple:
        return (("data", (stream.heads, stream.dim), dtype, 0.0),)

    def __init__(self, stream: KvStream, storage: dict[str, Tensor], dtype: torch.dtype, device: torch.device):
        self.data = storage["data"]
        self.kernel_pool = KvPool(KvFormat.BF16, self.data)  # what the decode kernels read (same tensors)

    def write(self, slots: Tensor, x: Tensor) -> None:
        self.data.index_copy_(0, slots, x.to(self.data.dtype))

    def read(self, slots: Tensor) -> Tensor:
        return self.data.index_select(0, slots)


class _QuantizedPool:
    """Shared by the quantized pools: the stream's calibrated offset comes off before storing, back on reading
    (in fp32); reads come back in the model's dtype."""

    def __init__(self, stream: KvStream, dtype: torch.dtype, device: torch.device):
        self.offset = _on(stream.offset, device)  # [H, D] or None
        self.dtype = dtype

    def write(self, slots: Tensor, x: Tensor) -> None:
        self._store(slots, x.float() if self.offset is None else x.float() - self.offset)

    def read(self, slots: Tensor) -> Tensor:
        values = self._load(slots)
        return (values if self.offset is None else values + self.offset).to(self.dtype)


class _Fp8StaticPool(_QuantizedPool):
    """float8_e4m3fn bytes with a calibrated per-tensor (0-dim) or per-head ([H, 1]) scale."""

    @staticmethod
    def layout(stream: KvStream, dtype: torch.dtype) -> tuple:
        if stream.scale is None:
            raise KilnError(f"FP8 KV stream {stream.name!r} ({stream.scaling}) has no scale")
        return (("data", (stream.heads, stream.dim), torch.float8_e4m3fn, 0.0),)

    def __init__(self, stream: KvStream, storage: dict[str, Tensor], dtype: torch.dtype, device: torch.device):
        super().__init__(stream, dtype, device)
        self.scale = _on(stream.scale, device)
        self.data = storage["data"]
        self.kernel_pool = KvPool(KvFormat.FP8_E4M3, self.data, self.scale, None, self.offset)

    def _store(self, slots: Tensor, x: Tensor) -> None:
        # index_copy_ has no float8 kernel on CPU: copy the bytes
        self.data.view(torch.uint8).index_copy_(0, slots, fp8_kv_quantize(x, self.scale).view(torch.uint8))

    def _load(self, slots: Tensor) -> Tensor:
        return fp8_kv_dequantize(self.data.index_select(0, slots), self.scale)


class _Fp8DynamicPool(_QuantizedPool):
    """float8_e4m3fn bytes with one fp32 scale per token (amax over the token's heads and dims / 448)."""

    @staticmethod
    def layout(stream: KvStream, dtype: torch.dtype) -> tuple:
        return (("data", (stream.heads, stream.dim), torch.float8_e4m3fn, 0.0),
                ("token_scale", (1, 1), torch.float32, 1.0))

    def __init__(self, stream: KvStream, storage: dict[str, Tensor], dtype: torch.dtype, device: torch.device):
        super().__init__(stream, dtype, device)
        self.data, self.token_scale = storage["data"], storage["token_scale"]
        self.kernel_pool = KvPool(KvFormat.FP8_E4M3, self.data, self.token_scale, None, self.offset)

    def _store(self, slots: Tensor, x: Tensor) -> None:
        q, scale = fp8_kv_quantize_per_token(x)
        self.data.view(torch.uint8).index_copy_(0, slots, q.view(torch.uint8))
        self.token_scale.index_copy_(0, slots, scale)

    def _load(self, slots: Tensor) -> Tensor:
        return fp8_kv_dequantize(self.data.index_select(0, slots), self.token_scale.index_select(0, slots))


class _Nvfp4Pool(_QuantizedPool):
    """Packed E2M1 codes [H, D/2] and E4M3 block scales [H, D/16] per token; a calibrated global scale."""

    @staticmethod
    def layout(stream: KvStream, dtype: torch.dtype) -> tuple:
        if stream.scale is None:
            raise KilnError(f"NVFP4 KV stream {stream.name!r} has no global scale")
        if stream.dim % NVFP4_BLOCK_SIZE:
            raise KilnError(f"NVFP4 KV stream {stream.name!r}: dim {stream.dim} is not a multiple of "
                            f"{NVFP4_BLOCK_SIZE}")
        return (("packed", (stream.heads, stream.dim // 2), torch.uint8, 0.0),
                ("block_scale", (stream.heads, stream.dim // NVFP4_BLOCK_SIZE), torch.float8_e4m3fn, 0.0))

    def __init__(self, stream: KvStream, storage: dict[str, Tensor], dtype: torch.dtype, device: torch.device):
        super().__init__(stream, dtype, device)
        self.global_scale = _on(stream.scale, device)
        self.packed, self.block_scale = storage["packed"], storage["block_scale"]
        self.kernel_pool = KvPool(KvFormat.NVFP4, self.packed, self.block_scale, self.global_scale, self.offset)

    def _store(self, slots: Tensor, x: Tensor) -> None:
        packed, block_scale = nvfp4_kv_quantize(x, self.global_scale)
        self.packed.index_copy_(0, slots, packed)
        self.block_scale.view(torch.uint8).index_copy_(0, slots, block_scale.view(torch.uint8))

    def _load(self, slots: Tensor) -> Tensor:
        return nvfp4_kv_dequantize(self.packed.index_select(0, slots), self.block_scale.index_select(0, slots),
                                   self.global_scale)


_POOLS = {
    (KvFormat.BF16, "none"): _DensePool,
    (KvFormat.FP8_E4M3, "per_tensor"): _Fp8StaticPool,
    (KvFormat.FP8_E4M3, "per_head"): _Fp8StaticPool,
    (KvFormat.FP8_E4M3, "dynamic"): _Fp8DynamicPool,
    (KvFormat.NVFP4, "e4m3_block16"): _Nvfp4Pool,
}


def _pool_kind(s: KvStream):
    kind = _POOLS.get((s.format, s.scaling))
    if kind is None:
        raise KilnError(f"no KV storage for format {s.format!r} with scaling {s.scaling!r}")
    return kind


# --- KV-cache groups and the storage they share -----------------------------------------------------------
@dataclass(frozen=True)
class KvGroup:
    """Layers that share one block table per sequence: the same attention type (`window`: a sliding window of
    that many tokens, None: full attention), at most one layer per storage slot."""

    window: int | None
    layers: tuple[int, ...]


def kv_groups(windows: Sequence[int | None]) -> tuple[KvGroup, ...]:
    """Layers grouped by attention type (vLLM's hybrid KV-cache groups): one group of every layer when all share
    one type; otherwise each type's layers (full attention first, then windows from the smallest) cut into
    groups of the smallest type's layer count, so that slot j of every group can share one storage tensor."""
    by_type: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        by_type.setdefault(window, []).append(layer)
    if len(by_type) == 1:
        ((window, layers),) = by_type.items()
        return (KvGroup(window, tuple(layers)),)
    size = min(len(layers) for layers in by_type.values())
    order = sorted(by_type, key=lambda w: (w is not None, w or 0))
    return tuple(KvGroup(w, tuple(by_type[w][i: i + size])) for w in order for i in range(0, len(by_type[w]), size))


def _storage_plan(streams: Sequence[Sequence[KvStream]], groups: Sequence[KvGroup], dtype: torch.dtype):
    """Per layer and stream, (the key of the storage tensors it uses, its pool kind, its layout). Layer j of
    every group uses slot j's tensors when its layout (format, shapes, dtypes) equals theirs; a layer whose
    layout differs from the slot's first gets tensors of its own (as many blocks as the shared ones)."""
    plan: dict[int, list] = {}
    keys: dict[tuple, tuple] = {}  # (slot, stream, layout) -> key
    for group in groups:
        for slot, layer in enumerate(group.layers):
            plan[layer] = []
            for index, s in enumerate(streams[layer]):
                kind = _pool_kind(s)
                layout = kind.layout(s, dtype)
                key = keys.setdefault((slot, index, layout), (slot, index, len(keys)))
                plan[layer].append((key, kind, layout))
    return [plan[layer] for layer in range(len(streams))]


def _layout_bytes(layout) -> int:
    return sum(math.prod(shape) * dtype.itemsize for _, shape, dtype, _ in layout)


def pool_bytes_per_token(streams: Sequence[Sequence[KvStream]], dtype: torch.dtype = torch.float32,
                         windows: Sequence[int | None] | None = None) -> int:
    """Bytes one token of one block id costs in a PagedKVCache's storage (dense layers at `dtype`): every layer's
    without windows; with windows, the storage slots' that the groups share (a block id is one group's at a
    time), so a pool of N blocks takes (N + 1) x block_size x this."""
    groups = kv_groups(windows if windows is not None else [None] * len(streams))
    seen = {}
    for layer in _storage_plan(streams, groups, dtype):
        for key, _, layout in layer:
            seen[key] = _layout_bytes(layout)
    return sum(seen.values())


def stored_bytes_per_token(streams: Sequence[Sequence[KvStream]], dtype: torch.dtype = torch.float32) -> int:
    """Bytes a token occupies in this runtime's pools (dense layers at `dtype`, not BF16)."""
    total = 0
    for layer in streams:
        for s in layer:
            dense = s.format == KvFormat.BF16
            total += s.heads * s.dim * dtype.itemsize if dense else s.bytes_per_token()
    return total


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
        pools as stored (see `_kernel_attention`)."""
        g = self.layer_group[layer]
        return _kernel_attention(self.pools[layer], self.write_slots[g], self.kernel[g], q, new, scale)

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


def _kernel_attention(pools, write_slots: Tensor, tables: DecodeTables, q: Tensor | tuple[Tensor, Tensor],
                      new: tuple[Tensor, Tensor], scale: float) -> Tensor:
    """Write a one-token step's two streams and attend through the decode kernel of the layer's kind: GQA's
    (q [B, 1, H, D] -> [B, 1, H, D]) or MLA's absorbed one (q = (q_latent, q_rot) [B, 1, H, r | rope], the
    streams the latent and the rotary key -> the mix of latents [B, 1, H, r])."""
    from kiln.kernels import gpu

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
class _Step:
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
        # (a GPU engine's default), where the layer's shape allows (runtime.model.GqaAttention)
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
        slots = (num_blocks + 1) * block_size
        storage: dict[tuple, dict[str, Tensor]] = {}
        self.pools = []
        for layer, plan in zip(streams, _storage_plan(streams, self.groups, dtype), strict=True):
            pools = []
            for s, (key, kind, layout) in zip(layer, plan, strict=True):
                if key not in storage:
                    storage[key] = {name: torch.full((slots, *shape), fill, dtype=t, device=self.device)
                                    if fill else torch.zeros(slots, *shape, dtype=t, device=self.device)
                                    for name, shape, t, fill in layout}
                pool = kind(s, storage[key], dtype, self.device)
                pool.storage = tuple(name for name, *_ in layout)
                pools.append(pool)
            self.pools.append(tuple(pools))
        self.nbytes = sum(t.numel() * t.element_size() for tensors in storage.values() for t in tensors.values())
        self.block_tables: dict[Hashable, list[int]] = {}  # group 0's table, per sequence
        self.group_tables: dict[Hashable, list[list[int]]] = {}  # every group's, per sequence
        self._released: dict[Hashable, list[int]] = {}  # per sequence and group: leading entries released
        self.lengths: dict[Hashable, int] = {}  # highest written position + 1, per sequence
        self._step: _Step | None = None
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

    def _key(self, g: int, digest: bytes) -> bytes:
        """A block's name in the prefix index: group 0's is the content hash itself, another group's is tagged."""
        return digest if g == 0 else digest + g.to_bytes(4, "little")

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
            bs, parent = self.block_size, b""
            for start in range(0, len(tokens) - 1 - bs + 1, bs):
                parent = chain_hash(parent, tokens[start: start + bs])
                hashes.append(parent)
            found = [[self.allocator.lookup(self._key(g, d)) for d in hashes] for g in range(len(self.groups))]
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
                    self.allocator.register(table[i], self._key(g, hashes[-1]))

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

        width = max(1, max(len(t[0]) for t in tables))
        null = [self.null_block]  # where unallocated or released
        bs = self.block_size
        p = positions.clamp(0, width * bs - 1)  # padding may point past the table; it is never written
        S = max(self.lengths[s] for s in seq_ids)
        k = torch.arange(S)
        held = torch.tensor([self.lengths[s] for s in seq_ids]).unsqueeze(1)
        if attend is not None and attend.shape != (B, 1, T, S):
            raise KilnError(f"prepare: attend must be [{B}, 1, {T}, {S}], got {list(attend.shape)}")
        device = self.device
        kernel = None
        if self.use_decode_kernel and T == 1 and valid is None and rope_positions is None and attend is None:
            kernel = []
        write_slots, read_slots = [], []
        for g in range(len(self.groups)):
            block_ids = torch.tensor([t[g] + null * (width - len(t[g])) for t in tables], dtype=torch.long)
            slots = block_ids.gather(1, p // bs) * bs + p % bs
            write_slots.append((slots.reshape(-1) if valid is None else slots[valid]).to(device))
            read = block_ids[:, k // bs] * bs + k % bs  # [B, S]
            read_slots.append(torch.where(k < held, read, self.null_slot).reshape(-1).to(device))
            if kernel is not None:
                kernel.append(DecodeTables(block_ids.to(device, torch.int32), held.squeeze(1).to(device, torch.int32),
                                           bs))
        written = None if valid is None else valid.reshape(-1).nonzero().squeeze(1)  # on the host: no sync
        key_positions = None
        if attend is not None:  # a tree node's key sits at its depth's position
            key_positions = k.expand(B, -1).clone()
            if rope_positions is not None:
                rows = torch.arange(B).unsqueeze(1).expand(B, T)
                at = positions if valid is None else torch.where(valid, positions, S)
                keep = at < S
                key_positions[rows[keep], at[keep]] = rope_positions.cpu()[keep]
            key_positions = key_positions.to(device)
        self._step = _Step(positions.to(device), _on(written, device), tuple(write_slots), tuple(read_slots), B, S,
                           _on(rope_positions, device), _on(attend, device), key_positions,
                           kernel=None if kernel is None else tuple(kernel))
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
        pools as stored (see `_kernel_attention`). Only when `decode_kernel` says the step allows it."""
        g = self.layer_group[layer]
        return _kernel_attention(self.pools[layer], self._step.write_slots[g], self._step.kernel[g], q, new, scale)

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
