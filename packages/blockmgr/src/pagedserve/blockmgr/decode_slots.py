"""The decode fast paths of the KVCacheManager: one new token for a running sequence.

Kept apart from the general path (kv_cache_manager.py) as a base class of ``KVCacheManager``:
it reads and changes the same state. Every running decode asks at every step, and nearly all of
them need nothing: the token lands in the sequence's own last block, which it does not fill
(``decode_in_place``). Once in ``block_size`` steps the token fills the block, which is then
hashed and registered in the prefix cache; once in ``block_size`` steps it starts a new block,
one popped from the free queue, with nothing to hash until that block is full
(``allocate_decode_slot``). Everything else (a shared block to copy first, a pool with no free
block) takes ``allocate_slots``.

``decode_in_place`` remembers, per sequence, the range of computed counts that decode in place
(``_in_place``): the counts that land in the last block, after every registered block and
before the token that fills it. Only a change to the sequence's own table (``_table_changed``)
or a fork (which shares its last block) can end that range early: a block past the registered
ones has no hash, so no other request's prefix hit can take a reference on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedserve.blockmgr.block_pool import BlockPool, KVBlock


class DecodeSlots:
    """``decode_in_place`` and ``allocate_decode_slot``; the base of ``KVCacheManager``, which
    provides the state below and ``block_ids``, ``allocate_slots``' helpers and the window."""

    block_size: int
    enable_prefix_caching: bool
    sliding_window: int | None
    pool: BlockPool
    block_tables: dict[str, list[KVBlock]]
    _block_ids: dict[str, list[int]]
    _num_registered: dict[str, int]
    _in_place: dict[str, tuple[int, int, list[int]]]

    def decode_in_place(self, seq_id: str, num_computed_tokens: int) -> list[int] | None:
        """The decode fast path: one new token at ``num_computed_tokens`` that needs no block.

        When ``_decodes_in_place`` holds there is nothing to allocate, copy, hash or register:
        this does what ``allocate_slots(seq_id, ..., num_computed_tokens, 1)`` would (release
        blocks behind a sliding window) and returns ``block_ids``; None (nothing changed) when
        the general path is needed. O(1), asked for every running decode at every step: one
        dict lookup while the count stays in the range remembered in ``_in_place``.
        """
        known = self._in_place.get(seq_id)
        if known is not None and known[0] <= num_computed_tokens <= known[1]:
            return known[2]
        table = self.block_tables.get(seq_id)
        if (
            table is None
            or num_computed_tokens < 1
            or not self._decodes_in_place(seq_id, table, num_computed_tokens)
        ):
            return None
        if self.sliding_window is not None:
            self._free_out_of_window(seq_id, table, num_computed_tokens)
            return self.block_ids(seq_id)
        ids = self.block_ids(seq_id)
        self._remember_in_place(seq_id, table, ids)
        return ids

    def allocate_decode_slot(
        self,
        seq_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        cache_salt: str | None = None,
        lora_int_id: int = 0,
    ) -> list[int] | None:
        """The decode path at a block boundary: the token at ``num_computed_tokens`` starts a
        new block (pop one free block; nothing to hash yet) or fills its last one (hash it and
        register it in the prefix cache). Does what ``allocate_slots(seq_id, token_ids,
        num_computed_tokens, 1, cache_salt=..., lora_int_id=...)`` would and returns
        ``block_ids`` (releasing blocks behind a sliding window, as it would); None (nothing
        changed) when that needs the general path: a block to copy first, no free block, or a
        count not at the table's end."""
        table = self.block_tables.get(seq_id)
        if table is None or num_computed_tokens < 1:
            return None
        block_size, num_blocks = self.block_size, len(table)
        index = num_computed_tokens // block_size
        if index == num_blocks:  # the first token of a new block
            if not self.pool.num_free_blocks:
                return None
            table.append(self.pool.allocate())
            self._table_changed(seq_id)
        elif index != num_blocks - 1 or table[index].ref_count > 1:
            return None
        total = num_computed_tokens + 1
        if self.enable_prefix_caching and total // block_size > self._num_registered.get(seq_id, 0):
            self._in_place.pop(seq_id, None)
            self._cache_full_blocks(seq_id, table, token_ids, total, cache_salt, lora_int_id)
        if self.sliding_window is not None:
            self._free_out_of_window(seq_id, table, num_computed_tokens)
            return self.block_ids(seq_id)
        ids = self.block_ids(seq_id)
        self._remember_in_place(seq_id, table, ids)  # the next decodes land in this block
        return ids

    def _remember_in_place(self, seq_id: str, table: list[KVBlock], ids: list[int]) -> None:
        """Record the computed counts that decode in place from now on: those whose token lands
        in the last block, which the sequence holds alone, after its registered blocks and
        before the token that fills it (with prefix caching; without, the whole last block)."""
        block_size, num_blocks = self.block_size, len(table)
        if table[-1].ref_count > 1:
            return
        low, high = max(1, (num_blocks - 1) * block_size), num_blocks * block_size - 1
        if self.enable_prefix_caching:
            registered = self._num_registered.get(seq_id, 0)
            low, high = (
                max(low, registered * block_size),
                min(high, (registered + 1) * block_size - 2),
            )
        if low <= high:
            self._in_place[seq_id] = (low, high, ids)

    def _table_changed(self, seq_id: str) -> None:
        """Forget what was kept for the sequence's table: its block ids and in-place range."""
        self._block_ids.pop(seq_id, None)
        self._in_place.pop(seq_id, None)

    def _decodes_in_place(self, seq_id: str, table: list[KVBlock], num_computed: int) -> bool:
        """The decode fast path (O(1)): True when one new token at ``num_computed`` lands in a
        block the sequence already holds alone and fills no block not yet registered in the
        prefix cache, so ``allocate_slots`` has nothing to allocate, copy or register."""
        index = num_computed // self.block_size
        if index >= len(table) or table[index].ref_count > 1:
            return False
        full = (num_computed + 1) // self.block_size
        return not self.enable_prefix_caching or full <= self._num_registered.get(seq_id, 0)
