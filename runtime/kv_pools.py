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


# --- storage per stream -----------------------------------------------------------------------------------
def copy_rows(t: Tensor, src: Tensor, dst: Tensor) -> None:
    """t[dst] = t[src], bytes as they are (float8 has no CPU index_copy: its bytes are copied)."""
    view = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
    view.index_copy_(0, dst, view.index_select(0, src))


def on_device(t: Tensor | None, device: torch.device) -> Tensor | None:
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
        self.offset = on_device(stream.offset, device)  # [H, D] or None
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
        self.scale = on_device(stream.scale, device)
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
        self.global_scale = on_device(stream.scale, device)
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
