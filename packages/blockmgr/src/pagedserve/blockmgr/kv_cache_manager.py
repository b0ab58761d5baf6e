"""KVCacheManager: the scheduler's only door to paging.

Each sequence owns a block table: the list of physical blocks that hold its tokens' keys and
values, in order. Token ``p`` of a sequence lives in slot
``block_table[p // block_size] * block_size + p % block_size``.

The manager hands out blocks through the prefix cache, shares blocks between sequences with the
same prefix (or between the children of a fork), and copies a shared block before a sequence
writes into it (copy-on-write). It never touches tensors: the copies it decides are handed to the
engine (``take_blocks_to_copy``), which runs ``copy_blocks`` before the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedserve.blockmgr.block_pool import BlockPool, KVBlock
from pagedserve.blockmgr.prefix_hash import extend_block_hashes


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters, in tokens: queried on admission, and found in the cache."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Block tables, prefix-cache lookups, allocation, fork, copy-on-write and free."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        watermark: float = 0.01,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.watermark_blocks = int(watermark * num_blocks)
        self.block_tables: dict[str, list[KVBlock]] = {}
        self._block_hashes: dict[str, list[bytes]] = {}
        self._blocks_to_copy: list[tuple[int, int]] = []
        self.prefix_cache_stats = PrefixCacheStats()

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        """Fraction of the KV cache held by running sequences."""
        return self.pool.usage()

    def get_block_table(self, seq_id: str) -> list[int]:
        return [b.block_id for b in self.block_tables.get(seq_id, ())]

    def get_computed_blocks(
        self, token_ids: Sequence[int], cache_salt: str | None = None
    ) -> tuple[list[KVBlock], int]:
        """Look up the longest cached prefix of ``token_ids``, in whole blocks.

        Returns the hit blocks and how many tokens they cover. Nothing is held yet; pass the
        blocks to ``allocate_slots``. The last prompt token is never served from the cache: its
        logits are needed to sample the first output token.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (len(token_ids) - 1) // self.block_size
        hashes = extend_block_hashes(
            [], token_ids[: max_blocks * self.block_size], self.block_size, cache_salt
        )
        hits: list[KVBlock] = []
        for block_hash in hashes:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        self.prefix_cache_stats.queries += len(token_ids)
        self.prefix_cache_stats.hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def num_blocks_needed(self, seq_id: str, num_tokens: int) -> int:
        """Blocks a sequence must still get to hold ``num_tokens`` tokens."""
        held = len(self.block_tables.get(seq_id, ()))
        return max(0, -(-num_tokens // self.block_size) - held)

    # ---- mutations -----------------------------------------------------------------------

    def allocate_slots(
        self,
        seq_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        computed_blocks: Sequence[KVBlock] = (),
        cache_salt: str | None = None,
    ) -> bool:
        """Make room for ``num_new_tokens`` tokens after ``num_computed_tokens``.

        ``computed_blocks`` (from ``get_computed_blocks``, first call for a sequence only) are
        shared, not copied. If the sequence is about to write into a block that another sequence
        also holds, that block is copied first. Full blocks whose tokens are all known are
        registered in the prefix cache. All or nothing: returns False and changes nothing when
        the pool cannot supply the blocks (the scheduler then preempts or waits).
        """
        table = self.block_tables.get(seq_id)
        is_new = table is None
        table = [] if table is None else table
        total = num_computed_tokens + num_new_tokens
        num_held_after_hits = len(table) + len(computed_blocks)
        num_new_blocks = max(0, -(-total // self.block_size) - num_held_after_hits)
        reactivated = sum(1 for b in computed_blocks if b.ref_count == 0)
        cow_index = self._shared_block_written(table, num_computed_tokens)
        needed = num_new_blocks + reactivated + (cow_index is not None)
        reserve = self.watermark_blocks if is_new else 0
        if needed > self.pool.num_free_blocks - reserve:
            return False

        for block in computed_blocks:
            self.pool.touch(block)
        table.extend(computed_blocks)
        if cow_index is not None:
            self._copy_on_write(table, cow_index)
        for _ in range(num_new_blocks):
            table.append(self.pool.allocate())
        self.block_tables[seq_id] = table
        self._cache_full_blocks(seq_id, table, token_ids[: min(total, len(token_ids))], cache_salt)
        return True

    def free(self, seq_id: str) -> None:
        """Release a sequence's blocks, tail first, so the cached head of a prefix outlives it."""
        table = self.block_tables.pop(seq_id, None)
        self._block_hashes.pop(seq_id, None)
        for block in reversed(table or []):
            self.pool.release(block)

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give ``child_id`` the parent's blocks, shared (refcount + 1 each), for n > 1 and beams."""
        if child_id in self.block_tables:
            raise ValueError(f"sequence {child_id!r} already has blocks")
        parent = self.block_tables[parent_id]
        for block in parent:
            self.pool.touch(block)
        self.block_tables[child_id] = list(parent)
        self._block_hashes[child_id] = list(self._block_hashes.get(parent_id, []))

    def take_blocks_to_copy(self) -> list[tuple[int, int]]:
        """The (src, dst) block copies decided since the last call; the engine runs them."""
        copies, self._blocks_to_copy = self._blocks_to_copy, []
        return copies

    def reset_prefix_cache(self) -> None:
        self.pool.evict_all_cached()

    # ---- internals -----------------------------------------------------------------------

    def _shared_block_written(self, table: list[KVBlock], num_computed_tokens: int) -> int | None:
        """Index of the block the next write lands in, if another sequence also holds it."""
        index = num_computed_tokens // self.block_size
        if index < len(table) and table[index].ref_count > 1:
            return index
        return None

    def _copy_on_write(self, table: list[KVBlock], index: int) -> None:
        shared = table[index]
        private = self.pool.allocate()
        self._blocks_to_copy.append((shared.block_id, private.block_id))
        self.pool.release(shared)
        table[index] = private

    def _cache_full_blocks(
        self, seq_id: str, table: list[KVBlock], known_tokens: Sequence[int], cache_salt: str | None
    ) -> None:
        if not self.enable_prefix_caching:
            return
        hashes = self._block_hashes.setdefault(seq_id, [])
        num_before = len(hashes)
        extend_block_hashes(hashes, known_tokens, self.block_size, cache_salt)
        for i in range(num_before, len(hashes)):
            self.pool.register(table[i], hashes[i])
