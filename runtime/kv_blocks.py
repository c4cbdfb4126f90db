"""The paged KV cache's block ids: a reference-counted allocator with the prefix index of block contents, and
the content hash that names a full block (vLLM's hash-chained blocks).

    allocator = BlockAllocator(num_blocks=256)
    a, b = allocator.allocate(2)                     # KvCacheFull when the pool cannot give them
    digest = chain_hash(b"", tokens[:16])            # a full block's name: its whole prefix
    allocator.register(a, digest)                    # later sequences with that prefix find it
    allocator.release([a, b])                        # a registered block stays cached (evictable, LRU)
    allocator.lookup(digest)                         # -> a, until it is evicted
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from kiln.kernels.errors import KilnError


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


def prompt_block_hashes(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """The chained hashes of a prompt's full blocks short of its last token (whose logits a prefix hit still
    needs computed): what its prefix is looked up by."""
    hashes, parent = [], b""
    for start in range(0, len(tokens) - 1 - block_size + 1, block_size):
        parent = chain_hash(parent, tokens[start: start + block_size])
        hashes.append(parent)
    return hashes


def index_key(group: int, digest: bytes) -> bytes:
    """A block's name in the prefix index: group 0's is the content hash itself, another group's is tagged."""
    return digest if group == 0 else digest + group.to_bytes(4, "little")
