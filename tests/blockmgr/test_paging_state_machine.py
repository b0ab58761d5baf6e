"""A hypothesis state machine over the KVCacheManager: admit (with prefix-cache hits), prefill
chunks and decodes, fork, copy-on-write writes, free, eviction under pressure, and reset.

Beside the manager the test keeps its own model of the KV cache: the token each physical slot
holds, written only as an engine would (run the step's block copies, then store the step's new
tokens through the block table). After every step it checks, against that model and not
against the manager's own bookkeeping:
- every block's ref count equals the number of block tables that hold it;
- a block is free (in the queue) exactly when nobody holds it, never both free and held;
- every cached block holds the tokens its hash covers (hash of its whole prefix, salt included);
- every sequence reads back exactly its own tokens through its block table;
- a failed allocation changes nothing; when everything is freed every block is free again.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedserve.blockmgr import KVCacheManager, extend_block_hashes

BLOCK_SIZE = 2
NUM_BLOCKS = 12
# Three token values and two-token blocks: prompts share prefixes (and hit) all the time.
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=9)
SALTS = st.sampled_from([None, None, "tenant-b"])


class Seq:
    def __init__(self, token_ids: list[int], salt: str | None) -> None:
        self.token_ids = token_ids  # known tokens (prompt + generated)
        self.num_computed = 0
        self.salt = salt


class PagingMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=True, watermark=0)
        self.seqs: dict[str, Seq] = {}
        self.slots: list[list[int | None]] = [[None] * BLOCK_SIZE for _ in range(NUM_BLOCKS)]
        # The (salt, full token prefix) a block held when its last slot was written.
        self.prefix_of: dict[int, tuple[str | None, tuple[int, ...]]] = {}
        self.next_id = 0

    # ---- the engine's side: copies, then writes through the block table --------------------

    def run_step(self, seq_id: str, num_new: int) -> None:
        for src, dst in self.kv.take_blocks_to_copy():
            self.slots[dst] = list(self.slots[src])
            if src in self.prefix_of:
                self.prefix_of[dst] = self.prefix_of[src]
            else:
                self.prefix_of.pop(dst, None)
        seq = self.seqs[seq_id]
        table = self.kv.get_block_table(seq_id)
        for pos in range(seq.num_computed, seq.num_computed + num_new):
            block, offset = table[pos // BLOCK_SIZE], pos % BLOCK_SIZE
            self.slots[block][offset] = seq.token_ids[pos]
            if offset == 0:
                self.prefix_of.pop(block, None)
            if offset == BLOCK_SIZE - 1:
                self.prefix_of[block] = (seq.salt, tuple(seq.token_ids[: pos + 1]))
        seq.num_computed += num_new

    def snapshot(self):
        return (
            [(b.ref_count, b.block_hash) for b in self.kv.pool.blocks],
            list(self.kv.pool.free_block_ids()),
            {s: self.kv.get_block_table(s) for s in self.seqs},
        )

    def allocate(self, seq_id: str, num_new: int, hits=(), num_cached: int | None = None) -> bool:
        seq = self.seqs[seq_id]
        computed = seq.num_computed if num_cached is None else num_cached
        before = self.snapshot()
        ok = self.kv.allocate_slots(seq_id, seq.token_ids, computed, num_new, hits, seq.salt)
        if not ok:
            assert self.snapshot() == before, "a failed allocation changed the pool"
            return False
        seq.num_computed = computed
        self.run_step(seq_id, num_new)
        return True

    # ---- rules -----------------------------------------------------------------------------

    @rule(token_ids=TOKENS, salt=SALTS, chunk=st.integers(1, 9))
    def admit(self, token_ids, salt, chunk):
        seq_id = f"s{self.next_id}"
        self.next_id += 1
        self.seqs[seq_id] = Seq(list(token_ids), salt)
        hits, num_cached = self.kv.get_computed_blocks(token_ids, salt)
        assert num_cached < len(token_ids), "the last prompt token must always be computed"
        for i, block in enumerate(hits):  # a hit serves exactly this prompt's tokens
            assert self.slots[block.block_id] == token_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
        num_new = min(chunk, len(token_ids) - num_cached)
        if not self.allocate(seq_id, num_new, hits, num_cached):
            del self.seqs[seq_id]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), new_tokens=st.lists(st.integers(0, 2), min_size=1, max_size=3))
    def advance(self, data, new_tokens):
        """The next prefill chunk, or (prefill done) one or more generated tokens."""
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        seq = self.seqs[seq_id]
        remaining = len(seq.token_ids) - seq.num_computed
        if remaining == 0:
            seq.token_ids.extend(new_tokens)  # sampled; stays known even if it must wait
            remaining = len(new_tokens)
        self.allocate(seq_id, data.draw(st.integers(1, remaining)))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), token=st.integers(0, 2), diverge=st.booleans())
    def fork(self, data, token, diverge):
        """n > 1: the child shares every block; with ``diverge``, parent and child then each
        write a different next token (into their shared, partly filled last block)."""
        parent_id = data.draw(st.sampled_from(sorted(self.seqs)))
        parent = self.seqs[parent_id]
        child_id = f"s{self.next_id}"
        self.next_id += 1
        self.kv.fork(parent_id, child_id)
        child = Seq(list(parent.token_ids), parent.salt)
        child.num_computed = parent.num_computed
        self.seqs[child_id] = child
        if diverge and parent.num_computed == len(parent.token_ids):
            child.token_ids.append(token)
            parent.token_ids.append((token + 1) % 3)
            self.allocate(child_id, 1)
            self.allocate(parent_id, 1)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        self.kv.free(seq_id)
        del self.seqs[seq_id]

    @rule()
    def pressure(self):
        """A request of fresh tokens takes every free block, evicting whatever was cached."""
        free = self.kv.num_free_blocks
        if free == 0:
            return
        seq_id = f"s{self.next_id}"
        self.next_id += 1
        self.seqs[seq_id] = Seq([100 + i for i in range(free * BLOCK_SIZE)], None)
        assert self.allocate(seq_id, free * BLOCK_SIZE)
        assert self.kv.num_free_blocks == 0
        self.kv.free(seq_id)
        del self.seqs[seq_id]

    @rule()
    def reset_prefix_cache(self):
        held = any(b.ref_count for b in self.kv.pool.blocks)
        assert self.kv.reset_prefix_cache() is not held
        if not held:
            assert self.kv.pool.num_cached_blocks == 0

    @rule()
    def free_everything(self):
        for seq_id in list(self.seqs):
            self.kv.free(seq_id)
        self.seqs.clear()
        assert self.kv.num_free_blocks == NUM_BLOCKS
        assert all(b.ref_count == 0 for b in self.kv.pool.blocks)
        assert self.kv.usage() == 0.0

    # ---- invariants --------------------------------------------------------------------------

    @invariant()
    def ref_counts_equal_holders(self):
        holders = Counter(b for s in self.seqs for b in self.kv.get_block_table(s))
        for block in self.kv.pool.blocks:
            assert block.ref_count == holders[block.block_id], block

    @invariant()
    def free_exactly_when_unheld(self):
        free = list(self.kv.pool.free_block_ids())
        assert len(free) == len(set(free)) == self.kv.num_free_blocks
        assert set(free) == {b.block_id for b in self.kv.pool.blocks if b.ref_count == 0}

    @invariant()
    def cached_blocks_hold_what_their_hash_says(self):
        pool = self.kv.pool
        hashed = {b.block_id for b in pool.blocks if b.block_hash is not None}
        assert hashed == {b.block_id for b in pool.cached_block_by_hash.values()}
        for block_hash, block in pool.cached_block_by_hash.items():
            assert block.block_hash == block_hash
            salt, prefix = self.prefix_of[block.block_id]
            assert extend_block_hashes([], list(prefix), BLOCK_SIZE, salt)[-1] == block_hash
            assert self.slots[block.block_id] == list(prefix[-BLOCK_SIZE:])

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        for seq_id, seq in self.seqs.items():
            table = self.kv.get_block_table(seq_id)
            assert len(table) == -(-seq.num_computed // BLOCK_SIZE)
            read = [
                self.slots[table[p // BLOCK_SIZE]][p % BLOCK_SIZE] for p in range(seq.num_computed)
            ]
            assert read == seq.token_ids[: seq.num_computed], seq_id

    @invariant()
    def stats_are_consistent(self):
        stats = self.kv.prefix_cache_stats
        assert 0 <= stats.hits <= stats.queries

    def teardown(self):
        for seq_id in list(self.seqs):
            self.kv.free(seq_id)
        assert self.kv.num_free_blocks == NUM_BLOCKS


PagingMachine.TestCase.settings = settings(
    max_examples=120,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPaging = pytest.mark.slow(PagingMachine.TestCase)
