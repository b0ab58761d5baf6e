"""KVCacheManager: the scheduler's only door to paging.

Each sequence owns a block table: the list of physical blocks that hold its tokens' keys and
values, in order. Token ``p`` of a sequence lives in slot
``block_table[p // block_size] * block_size + p % block_size``.

The manager hands out blocks through the prefix cache, shares blocks between sequences with the
same prefix (or between the children of a fork), and copies a shared block before a sequence
writes into it (copy-on-write). It never touches tensors: the copies it decides are handed to the
engine (``take_blocks_to_copy``), which runs ``copy_blocks`` before the step's forward.

Invariants (held by the tests' state machine):
- a block's ``ref_count`` equals the number of block tables that hold it;
- every sequence's block table holds exactly its computed tokens' keys and values, once the
  step's copies and writes have run;
- a block a sequence writes into is held by that sequence alone.

Sliding windows: with ``sliding_window`` W (every layer of the model windowed), the blocks
wholly before ``num_computed - W + 1`` (the horizon of the next token to compute) are read by
no layer again. They are released as the sequence grows; their table entries become
``OUT_OF_WINDOW``, a placeholder no pool owns, so tables keep one entry per logical block (the
slot arithmetic is unchanged) and attention never reads those entries. A released block keeps
its prefix hash: another request with the same prefix can still hit it.

One token for a running sequence (a decode) is nearly every allocation of a busy server, and
nearly always needs nothing: the token lands in the sequence's own last block, which it does not
fill. ``allocate_slots`` answers those first (``_allocate_decode``): from a remembered range of
computed counts while it holds (one dict lookup), a new block popped from the free queue when the
token starts one, the block hashed and registered when the token fills it. Anything else (a
shared block to copy first, hits, several tokens) takes the general allocation below it.

Why one file: the class is one idea (a sequence's blocks through their life) at some 450
lines; its parts (lookup, allocation, the decode's, fork, copy-on-write, the window, free)
share every table, so they stay in one place rather than in halves joined by inheritance.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedserve.blockmgr.block_pool import BlockPool, KVBlock
from pagedserve.blockmgr.prefix_hash import ImagePlaceholder, extend_block_hashes

# The table entry of a block released behind the sliding window: never read, owned by no pool.
OUT_OF_WINDOW = KVBlock(block_id=0, ref_count=-1)


class StalePrefixHitError(ValueError):
    """``allocate_slots`` got hit blocks that no longer hold the sequence's prefix."""


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters, counted once per admission: requests, tokens queried, tokens hit.

    A request that waits several steps before it is admitted is counted once, when admitted; a
    preempted request that is admitted again is counted again (it really queries again).
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def record(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hit_tokens


class KVCacheManager:
    """Block tables, prefix-cache lookups, allocation, fork, copy-on-write and free."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        watermark: float = 0.01,
        sliding_window: int | None = None,
        hash_root: bytes | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        self.sliding_window = sliding_window
        # the root of every block's hash chain (None: this process's seed): a KV connector
        # whose blocks outlive the process gives its own, so the names outlive it too
        self.hash_root = hash_root
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.watermark_blocks = int(watermark * num_blocks)
        self.block_tables: dict[str, list[KVBlock]] = {}
        # Per sequence: hashes of its full known blocks, and how many of them are registered.
        self._block_hashes: dict[str, list[bytes]] = {}
        self._num_registered: dict[str, int] = {}
        # Per sequence with images in its prompt: where they sit, hashed into its blocks.
        self._images: dict[str, Sequence[ImagePlaceholder]] = {}
        self._blocks_to_copy: list[tuple[int, int]] = []
        self.prefix_cache_stats = PrefixCacheStats()
        # Per sequence: its block ids, kept between steps until its table changes (block_ids).
        self._block_ids: dict[str, list[int]] = {}
        # Per sequence: how many of its leading blocks were released behind the window.
        self._num_out_of_window: dict[str, int] = {}
        # Per sequence: the computed counts that decode in place, and its block ids
        # (``_allocate_decode``): the range whose token lands in its last block and fills none.
        self._in_place: dict[str, tuple[int, int]] = {}

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        """Fraction of the KV cache held by running sequences (cached-but-free counts as free)."""
        return self.pool.usage()

    def get_block_table(self, seq_id: str) -> list[int]:
        return list(self.block_ids(seq_id))

    def block_ids(self, seq_id: str) -> list[int]:
        """The sequence's block ids, read-only: the scheduler's per-step copy-free view.

        The list is kept until the sequence's table changes, and then replaced, never changed
        in place; so a step that holds it keeps that step's table, and a decode step that adds
        no block builds nothing.
        """
        ids = self._block_ids.get(seq_id)
        if ids is None:
            table = self.block_tables.get(seq_id)
            if table is None:
                return []
            ids = self._block_ids[seq_id] = [b.block_id for b in table]
        return ids

    def block_hashes(self, seq_id: str) -> Sequence[bytes]:
        """The prefix hashes of the sequence's full known blocks, in order, read-only: those a
        KV connector saves its blocks under (each block is registered when allocated)."""
        return self._block_hashes.get(seq_id, ())

    def hash_prefix(
        self,
        token_ids: Sequence[int],
        num_tokens: int,
        cache_salt: str | None = None,
        lora_int_id: int = 0,
        images: Sequence[ImagePlaceholder] = (),
    ) -> list[bytes]:
        """The hashes of the full blocks among the first ``num_tokens`` of ``token_ids``, as
        the prefix cache names them (a KV connector looks its own store up by them)."""
        return extend_block_hashes(
            [], token_ids, self.block_size, cache_salt, num_tokens, lora_int_id, self.hash_root,
            images,
        )  # fmt: skip

    def get_computed_blocks(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        lora_int_id: int = 0,
        images: Sequence[ImagePlaceholder] = (),
    ) -> tuple[list[KVBlock], int]:
        """Look up the longest cached prefix of ``token_ids``, in whole blocks.

        Returns the hit blocks and how many tokens they cover. Nothing is held and nothing is
        counted yet: pass the blocks to ``allocate_slots``, which takes the references and
        records the statistics when the request is admitted. The last token is never served
        from the cache: its logits are needed to sample the next token.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = max(0, len(token_ids) - 1) // self.block_size
        num_tokens = max_blocks * self.block_size
        hashes = self.hash_prefix(token_ids, num_tokens, cache_salt, lora_int_id, images)
        hits: list[KVBlock] = []
        for block_hash in hashes:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    # ---- mutations -----------------------------------------------------------------------

    def allocate_slots(
        self,
        seq_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        computed_blocks: Sequence[KVBlock] = (),
        cache_salt: str | None = None,
        lora_int_id: int = 0,
        delay_caching: bool = False,
        images: Sequence[ImagePlaceholder] = (),
    ) -> bool:
        """Make room for ``num_new_tokens`` tokens after ``num_computed_tokens``.

        ``computed_blocks`` (from ``get_computed_blocks``; first call for a sequence only) are
        shared, not copied, and must cover exactly ``num_computed_tokens``. A block the new
        tokens land in that another sequence also holds is copied first (copy-on-write). Full
        blocks whose tokens are all known are registered in the prefix cache, the prompt's
        ``images`` hashed in (with ``delay_caching``, whose keys and values a KV connector is
        still loading, only once ``cache_blocks`` says they arrived). A new sequence must
        leave the watermark free, so that admitting it does not force a preemption at the next
        decode step. All or nothing: False, nothing changed, when the pool cannot supply the
        blocks (the scheduler then preempts or waits)."""
        if num_new_tokens == 1 and not computed_blocks:  # a decode: nearly every call
            known = self._in_place.get(seq_id)
            if (known is not None and known[0] <= num_computed_tokens <= known[1]) or (
                self._allocate_decode(
                    seq_id, token_ids, num_computed_tokens, cache_salt, lora_int_id
                )
            ):
                return True
        table = self.block_tables.get(seq_id)
        _check_allocation(seq_id, table, num_computed_tokens, num_new_tokens, computed_blocks)
        self._table_changed(seq_id)
        is_new = table is None
        hit_hashes = self._check_hits(
            token_ids, num_computed_tokens, computed_blocks, cache_salt, lora_int_id, images
        )
        table = [] if table is None else table
        total = num_computed_tokens + num_new_tokens
        num_new_blocks = max(0, -(-total // self.block_size) - len(table) - len(computed_blocks))
        reactivated = sum(1 for b in computed_blocks if b.ref_count == 0)
        shared = self._shared_blocks_written(table, num_computed_tokens, total)
        needed = num_new_blocks + reactivated + len(shared)
        if needed > self.pool.num_free_blocks - (self.watermark_blocks if is_new else 0):
            return False
        for block in computed_blocks:
            self.pool.touch(block)
        table.extend(computed_blocks)
        for index in shared:
            self._copy_on_write(table, index)
        for _ in range(num_new_blocks):
            table.append(self.pool.allocate())
        self.block_tables[seq_id] = table
        self._record_hits(seq_id, is_new, len(token_ids), hit_hashes, images)
        if not delay_caching:
            self._cache_full_blocks(seq_id, table, token_ids, total, cache_salt, lora_int_id)
        self._free_out_of_window(seq_id, table, num_computed_tokens)
        return True

    def allocate_decode_slot(
        self,
        seq_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        cache_salt: str | None = None,
        lora_int_id: int = 0,
    ) -> list[int] | None:
        """``allocate_slots`` for a decode's one token, then ``block_ids``: the sequence's
        block ids, or None, nothing changed, when the pool cannot supply the block (the
        scheduler then preempts). One call per running request is the scheduler's tight loop;
        a token that lands in place (nearly every one) costs two dict lookups."""
        known = self._in_place.get(seq_id)
        in_place = known is not None and known[0] <= num_computed_tokens <= known[1]
        if not in_place and not self.allocate_slots(
            seq_id, token_ids, num_computed_tokens, 1, (), cache_salt, lora_int_id
        ):
            return None
        ids = self._block_ids.get(seq_id)  # block_ids, inline: the table rarely changes
        return ids if ids is not None else self.block_ids(seq_id)

    def cache_blocks(
        self,
        seq_id: str,
        token_ids: Sequence[int],
        num_tokens: int,
        cache_salt: str | None = None,
        lora_int_id: int = 0,
    ) -> None:
        """Register the sequence's full blocks among its first ``num_tokens`` tokens in the
        prefix cache: blocks allocated with ``delay_caching`` whose keys and values have now
        arrived (a KV connector's load)."""
        table = self.block_tables.get(seq_id)
        if table is not None:
            self._cache_full_blocks(seq_id, table, token_ids, num_tokens, cache_salt, lora_int_id)

    def free(self, seq_id: str) -> None:
        """Release a sequence's blocks, tail first, so the cached head of a prefix outlives it."""
        table = self.block_tables.pop(seq_id, None)
        self._table_changed(seq_id)
        self._block_hashes.pop(seq_id, None)
        self._num_registered.pop(seq_id, None)
        self._images.pop(seq_id, None)
        self._num_out_of_window.pop(seq_id, None)
        for block in reversed(table or []):
            if block is not OUT_OF_WINDOW:
                self.pool.release(block)

    def free_blocks_beyond(self, seq_id: str, num_tokens: int) -> None:
        """Release the blocks past those that hold the first ``num_tokens`` tokens, tail first.

        After a speculative decode the slots of rejected proposals hold garbage; a block that
        only they used is given back (the next step allocates again as it needs). Such a block
        was never registered in the prefix cache: only full blocks of known tokens are.
        """
        table = self.block_tables.get(seq_id)
        keep = -(-num_tokens // self.block_size)
        if table is None or len(table) <= keep:
            return
        self._table_changed(seq_id)
        while len(table) > keep:
            self.pool.release(table.pop())

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give ``child_id`` the parent's blocks, shared (refcount + 1 each), for n > 1 and beams.

        Nothing is copied now: the first of the two to write into the shared, partially filled
        last block gets a private copy of it (see ``allocate_slots``).
        """
        if parent_id not in self.block_tables:
            raise ValueError(f"cannot fork {parent_id!r}: it holds no blocks")
        if child_id in self.block_tables:
            raise ValueError(f"sequence {child_id!r} already has blocks")
        parent = self.block_tables[parent_id]
        for block in parent:
            if block is not OUT_OF_WINDOW:
                self.pool.touch(block)
        self.block_tables[child_id] = list(parent)
        self._table_changed(child_id)
        self._in_place.pop(parent_id, None)  # its last block is shared now: not in place
        self._block_hashes[child_id] = list(self._block_hashes.get(parent_id, []))
        self._num_registered[child_id] = self._num_registered.get(parent_id, 0)
        if parent_id in self._images:
            self._images[child_id] = self._images[parent_id]
        self._num_out_of_window[child_id] = self._num_out_of_window.get(parent_id, 0)

    def take_blocks_to_copy(self) -> list[tuple[int, int]]:
        """The (src, dst) block copies decided since the last call; the engine runs them."""
        copies, self._blocks_to_copy = self._blocks_to_copy, []
        return copies

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Refused (False) while any block is held, as in vLLM."""
        if self.pool.num_free_blocks != self.num_blocks:
            return False
        self.pool.evict_all_cached()
        return True

    # ---- internals -----------------------------------------------------------------------

    def _record_hits(self, seq_id, is_new, num_tokens: int, hit_hashes, images) -> None:
        """A sequence's prefix-cache hits: their hashes (registered already) and, when it is
        new, the statistics of its lookup; its images, hashed into its blocks until freed."""
        if images:
            self._images[seq_id] = images
        if hit_hashes is not None:
            self._block_hashes[seq_id] = hit_hashes
        if is_new and self.enable_prefix_caching:
            num_hits = len(hit_hashes or ()) * self.block_size
            self.prefix_cache_stats.record(num_tokens, num_hits)

    def _allocate_decode(
        self,
        seq_id: str,
        token_ids: Sequence[int],
        num_computed: int,
        cache_salt: str | None,
        lora_int_id: int,
    ) -> bool:
        """``allocate_slots`` for one token at ``num_computed`` that lands at the end of the
        sequence's own table: True when done; False, with nothing changed, when the general
        path must run (a shared block to copy first, no free block, a count elsewhere).

        (``allocate_slots`` answers first from the range ``_in_place`` remembers: counts whose
        token lands in the last block, which the sequence holds alone, and fills no
        unregistered block.) At a boundary the token starts a block (one popped from the free queue; nothing to hash
        until it is full) or fills one (hashed and registered in the prefix cache). Only a
        change to the sequence's own table (``_table_changed``) or a fork (which shares its
        last block) ends a remembered range early: a block past the registered ones has no
        hash, so no other request's prefix hit can take a reference on it."""
        table = self.block_tables.get(seq_id)
        if table is None or num_computed < 1:
            return False
        block_size, num_blocks = self.block_size, len(table)
        index = num_computed // block_size
        if index == num_blocks:  # the first token of a new block
            if not self.pool.num_free_blocks:
                return False
            table.append(self.pool.allocate())
            self._table_changed(seq_id)
        elif index != num_blocks - 1 or table[index].ref_count > 1:
            return False
        total = num_computed + 1
        if self.enable_prefix_caching and total // block_size > self._num_registered.get(seq_id, 0):
            self._in_place.pop(seq_id, None)
            self._cache_full_blocks(seq_id, table, token_ids, total, cache_salt, lora_int_id)
        if self.sliding_window is not None:
            self._free_out_of_window(seq_id, table, num_computed)
        else:
            self._remember_in_place(seq_id, table)
        return True

    def _remember_in_place(self, seq_id: str, table: list[KVBlock]) -> None:
        """Record the computed counts that need nothing from now on: those whose token lands in
        the last block, held alone, after the registered blocks and before the token that fills
        it (with prefix caching; without, anywhere in the last block)."""
        block_size, num_blocks = self.block_size, len(table)
        if table[-1].ref_count > 1:
            return
        low, high = max(1, (num_blocks - 1) * block_size), num_blocks * block_size - 1
        if self.enable_prefix_caching:
            registered = self._num_registered.get(seq_id, 0)
            low = max(low, registered * block_size)
            high = min(high, (registered + 1) * block_size - 2)
        if low <= high:
            self._in_place[seq_id] = (low, high)

    def _table_changed(self, seq_id: str) -> None:
        """Forget what was kept for the sequence's table: its block ids and in-place range."""
        self._block_ids.pop(seq_id, None)
        self._in_place.pop(seq_id, None)

    def _free_out_of_window(self, seq_id: str, table: list[KVBlock], num_computed: int) -> None:
        """Release the blocks wholly before the next token's window (none without a window).

        Only blocks behind ``num_computed - W + 1`` go: every token still to be computed (this
        step's, and any later one) sits at ``num_computed`` or after, so none of them sees
        those positions. A rewind (speculative decoding) only takes back tokens computed after
        the ``num_computed`` this ran with, so it never needs a released block back. O(1) when
        nothing is due (a decode step between block boundaries)."""
        if self.sliding_window is None:
            return
        horizon = num_computed - self.sliding_window + 1
        n_out = min(len(table), max(0, horizon) // self.block_size)
        first = self._num_out_of_window.get(seq_id, 0)
        if n_out <= first:
            return
        for i in range(first, n_out):
            self.pool.release(table[i])
            table[i] = OUT_OF_WINDOW
        self._num_out_of_window[seq_id] = n_out
        self._table_changed(seq_id)

    def _check_hits(
        self,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        hits: Sequence[KVBlock],
        cache_salt: str | None,
        lora_int_id: int = 0,
        images: Sequence[ImagePlaceholder] = (),
    ) -> list[bytes] | None:
        """Refuse hit blocks that do not (any longer) hold this sequence's prefix.

        Between ``get_computed_blocks`` and ``allocate_slots`` another allocation may evict a
        free cached block and reuse it; sharing it would silently serve foreign keys/values.
        None when there are no hits.
        """
        if not hits:
            return None
        if num_computed_tokens != len(hits) * self.block_size:
            raise ValueError(
                f"{len(hits)} hit blocks cover {len(hits) * self.block_size} tokens, "
                f"not num_computed_tokens={num_computed_tokens}"
            )
        expected = self.hash_prefix(token_ids, num_computed_tokens, cache_salt, lora_int_id, images)
        for block, block_hash in zip(hits, expected, strict=True):
            if block.block_hash != block_hash:
                raise StalePrefixHitError(
                    f"block {block.block_id} no longer holds this prefix; look the hits up again "
                    "right before allocate_slots"
                )
        return expected

    def _shared_blocks_written(self, table: list[KVBlock], start: int, end: int) -> list[int]:
        """Indices of held blocks that tokens ``[start, end)`` land in and others also hold."""
        if end <= start:
            return []
        first, last = start // self.block_size, (end - 1) // self.block_size
        return [i for i in range(first, min(last + 1, len(table))) if table[i].ref_count > 1]

    def _copy_on_write(self, table: list[KVBlock], index: int) -> None:
        shared = table[index]
        private = self.pool.allocate()
        self._blocks_to_copy.append((shared.block_id, private.block_id))
        self.pool.release(shared)
        table[index] = private

    def _cache_full_blocks(
        self,
        seq_id: str,
        table: list[KVBlock],
        token_ids: Sequence[int],
        num_tokens: int,
        cache_salt: str | None,
        lora_int_id: int = 0,
    ) -> None:
        """Hash the newly full blocks among the first ``num_tokens`` tokens and register them.

        Blocks are registered when allocated for the step that computes them: a request
        admitted later in the same step may share them, and reads them only after this step's
        ``store_kv`` wrote them (every layer stores the whole batch before attending).
        """
        if not self.enable_prefix_caching:
            return
        hashes = self._block_hashes.setdefault(seq_id, [])
        extend_block_hashes(
            hashes, token_ids, self.block_size, cache_salt, num_tokens, lora_int_id, self.hash_root,
            self._images.get(seq_id, ()),
        )  # fmt: skip
        first = self._num_registered.get(seq_id, 0)
        for i in range(first, len(hashes)):
            self.pool.register(table[i], hashes[i])
        self._num_registered[seq_id] = len(hashes)


def _check_allocation(seq_id, table, num_computed_tokens, num_new_tokens, computed_blocks) -> None:
    if num_new_tokens < 0 or num_computed_tokens < 0:
        raise ValueError("token counts must be non-negative")
    if table is not None and computed_blocks:
        raise ValueError(f"sequence {seq_id!r} already has blocks; hits are for new ones")
