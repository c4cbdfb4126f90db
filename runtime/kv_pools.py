"""The paged KV cache's storage: one pool of token slots per layer and stream in the layer's KV format, and the
KV-cache groups whose layers share those pools' tensors.

    groups = kv_groups(windows)                      # layers by attention type, cut to share storage slots
    pools, nbytes = allocate_pools(streams, groups, num_blocks=256, block_size=16, dtype=torch.float32,
                                   device=torch.device("cpu"))
    pools[layer][0].write(slots, k)                  # quantized as stored; .read(slots) dequantizes
    pool_bytes_per_token(streams, windows=windows)   # what one block id costs, per token

Storage, per storage slot and stream, is one pool of (num_blocks + 1) * block_size token slots [slots, H, D'],
slot = block * block_size + offset, in the layer's KV format (runtime.kv_format): the model's dtype for
BF16 layers (fp32 on CPU, bf16 on a GPU), float8_e4m3fn bytes (+ an fp32 scale per token when dynamic) for FP8,
packed E2M1 bytes + E4M3 block scales for NVFP4. Layer j of every group shares slot j's tensors (a block id is
one group's at a time, so their writes never meet), which is what makes a block id cost one group's layers and
not every layer's (`pool_bytes_per_token`); a layer whose layout (format, shapes) differs from the slot's keeps
tensors of its own. Scales and offsets stay per layer. The extra last block is the null block: zeros, never
handed out; reads past a sequence's length, and of released blocks, point at it.

KV-cache groups (vLLM's hybrid KV-cache manager). Layers are grouped by attention type (`kv_groups`: full
attention, or a sliding window of W tokens); when types mix, each type's layers are cut into groups of the
smallest type's layer count (Gemma 3 270M: 3 full-attention layers and 15 windowed -> one full group and five
window groups of 3), so that slot j of every group can share one storage tensor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kiln.kernels.errors import KilnError
from kiln.kernels.registry import KV_FORMATS
from kiln.kernels.torch_refs import KvPool
from kiln.runtime.kv_format import KvStream


# --- storage per stream -----------------------------------------------------------------------------------
def copy_rows(t: Tensor, src: Tensor, dst: Tensor) -> None:
    """t[dst] = t[src], bytes as they are (float8 has no CPU index_copy: its bytes are copied)."""
    view = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
    view.index_copy_(0, dst, view.index_select(0, src))


def on_device(t: Tensor | None, device: torch.device) -> Tensor | None:
    return None if t is None else t.to(device)


class _DensePool:
    """Unquantized (BF16 at deployment): the model's compute dtype, so reads equal the uncached values."""

    def __init__(self, stream: KvStream, storage: dict[str, Tensor], dtype: torch.dtype, device: torch.device):
        self.data = storage["data"]
        self.kernel_pool = KvPool(stream.format, self.data)  # what the decode kernels read (same tensors)

    def write(self, slots: Tensor, x: Tensor) -> None:
        self.data.index_copy_(0, slots, x.to(self.data.dtype))

    def read(self, slots: Tensor) -> Tensor:
        return self.data.index_select(0, slots)


class _QuantizedPool:
    """A quantized stream's slots, stored and read as its format's object says (kernels/kv_codec.py): its
    stored tensors by name (float8 `data` (+ `token_scale`) for FP8, `packed` + `block_scale` for NVFP4) and its
    calibrated scale (static FP8, NVFP4's global scale). The stream's calibrated offset comes off before
    storing, back on reading (in fp32); reads come back in the model's dtype."""

    def __init__(self, stream: KvStream, storage: dict[str, Tensor], dtype: torch.dtype, device: torch.device):
        self.codec = stream.codec
        self.offset = on_device(stream.offset, device)  # [H, D] or None
        self.scale = on_device(stream.scale, device)
        self.dtype = dtype
        self.tensors = storage
        for name, tensor in storage.items():
            setattr(self, name, tensor)
        self.kernel_pool = KvPool(self.codec.name, *self.codec.kernel_tensors(storage, self.scale), self.offset)

    def write(self, slots: Tensor, x: Tensor) -> None:
        self.codec.store(self.tensors, slots, x.float() if self.offset is None else x.float() - self.offset,
                         self.scale)

    def read(self, slots: Tensor) -> Tensor:
        values = self.codec.load(self.tensors, slots, self.scale)
        return (values if self.offset is None else values + self.offset).to(self.dtype)


def _pool_kind(s: KvStream):
    codec = KV_FORMATS.get(s.format)
    if codec is None or s.scaling not in codec.scalings:
        raise KilnError(f"no KV storage for format {s.format!r} with scaling {s.scaling!r}")
    return _QuantizedPool if codec.quantized else _DensePool


def _layout(s: KvStream, dtype: torch.dtype) -> tuple:
    """The stream's tensors per token slot: (name, shape, dtype, fill value), ... (its format's pool_layout)."""
    return s.codec.pool_layout(s.name, s.heads, s.dim, s.scaling, s.scale, dtype)


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
                layout = _layout(s, dtype)
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
            total += s.bytes_per_token() if s.codec.quantized else s.heads * s.dim * dtype.itemsize
    return total


def allocate_pools(streams: Sequence[Sequence[KvStream]], groups: Sequence[KvGroup], num_blocks: int,
                   block_size: int, dtype: torch.dtype, device: torch.device) -> tuple[list[tuple], int]:
    """Per layer, its streams' pools over (num_blocks + 1) * block_size token slots (the last block the null
    block), sharing storage as `_storage_plan` says; and the bytes all the storage takes."""
    slots = (num_blocks + 1) * block_size
    storage: dict[tuple, dict[str, Tensor]] = {}
    out = []
    for layer, plan in zip(streams, _storage_plan(streams, groups, dtype), strict=True):
        pools = []
        for s, (key, kind, layout) in zip(layer, plan, strict=True):
            if key not in storage:
                storage[key] = {name: torch.full((slots, *shape), fill, dtype=t, device=device)
                                if fill else torch.zeros(slots, *shape, dtype=t, device=device)
                                for name, shape, t, fill in layout}
            pool = kind(s, storage[key], dtype, device)
            pool.storage = tuple(name for name, *_ in layout)
            pools.append(pool)
        out.append(tuple(pools))
    nbytes = sum(t.numel() * t.element_size() for tensors in storage.values() for t in tensors.values())
    return out, nbytes
