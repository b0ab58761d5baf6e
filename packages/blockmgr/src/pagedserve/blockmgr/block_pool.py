"""The block pool: every physical KV block, its reference count, and the prefix-cache index.

A block is *held* while some sequence's block table points at it (``ref_count > 0``) and *free*
otherwise. Free blocks wait in an LRU queue. A free block may still carry the hash of the full
block of tokens it holds: until the pool hands it out again, a later request with the same
prefix can pick it up (a prefix-cache hit) and skip recomputing it.

Invariants (checked by the tests):
- a block is in the free queue if and only if its ``ref_count`` is 0;
- ``cached_block_by_hash[h]`` is a block whose ``block_hash`` is ``h``, and every block with a
  hash is in that map (one block per hash);
- a hashed block holds exactly the tokens its hash covers (the caller hashes only full blocks).

Eviction order: the free queue's front is handed out first. A freed block without a hash is
worth nothing and goes to the front; a freed block with a hash goes to the back, so cached
blocks are evicted least recently used first. All operations are O(1).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass


class BlockPoolExhausted(RuntimeError):
    """``allocate`` found no free block; callers check ``num_free_blocks`` first."""


@dataclass(eq=False)
class KVBlock:
    """One physical block: ``block_size`` token slots in every layer's K and V cache."""

    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None

    def __repr__(self) -> str:
        tag = self.block_hash.hex()[:8] if self.block_hash else "-"
        return f"KVBlock({self.block_id}, ref={self.ref_count}, hash={tag})"


class BlockPool:
    """Physical blocks, reference counts, an LRU free queue and the hash -> block map."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Front = handed out first. OrderedDict gives O(1) removal from the middle on a hit.
        self._free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached_block_by_hash: dict[bytes, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_queue)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that carry a prefix hash, held or free."""
        return len(self.cached_block_by_hash)

    def free_block_ids(self) -> Iterator[int]:
        """Free block ids in eviction order (the first is handed out next)."""
        return iter(self._free_queue)

    def usage(self) -> float:
        """Fraction of blocks held by some sequence (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self) -> KVBlock:
        """Take the block at the front of the free queue; if it was cached, its hash is evicted."""
        if not self._free_queue:
            raise BlockPoolExhausted(
                "block pool exhausted: check num_free_blocks before allocating"
            )
        block_id, _ = self._free_queue.popitem(last=False)
        block = self.blocks[block_id]
        self._evict_hash(block)
        block.ref_count = 1
        return block

    def touch(self, block: KVBlock) -> None:
        """Take one more reference on ``block`` (a prefix-cache hit or a fork)."""
        if block.ref_count == 0:
            del self._free_queue[block.block_id]
        block.ref_count += 1

    def release(self, block: KVBlock) -> None:
        """Drop one reference. A block nobody holds goes back to the free queue."""
        if block.ref_count <= 0:
            raise RuntimeError(f"release of a free block: {block!r}")
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free_queue[block.block_id] = None
            if block.block_hash is None:
                self._free_queue.move_to_end(block.block_id, last=False)

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self.cached_block_by_hash.get(block_hash)

    def register(self, block: KVBlock, block_hash: bytes) -> None:
        """Record that ``block`` now holds the full block of tokens that ``block_hash`` covers.

        If another block already holds the same content (two sequences computed the same block
        at once), that one stays the cached copy and ``block`` stays unhashed.
        """
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached_block_by_hash:
            return
        block.block_hash = block_hash
        self.cached_block_by_hash[block_hash] = block

    def evict_all_cached(self) -> None:
        """Forget every cached hash (a reset of the prefix cache)."""
        for block in self.cached_block_by_hash.values():
            block.block_hash = None
        self.cached_block_by_hash.clear()

    def _evict_hash(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self.cached_block_by_hash[block.block_hash]
            block.block_hash = None
