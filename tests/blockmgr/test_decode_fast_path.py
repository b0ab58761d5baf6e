"""The decode fast path of allocate_slots: same tables, copies and prefix-cache entries as the
general path, step for step; block_ids lists are snapshots, replaced when a table changes."""

from __future__ import annotations

import random

import pytest

from pagedserve.blockmgr import KVCacheManager


def state(kv: KVCacheManager, seqs) -> tuple:
    tables = {s: kv.get_block_table(s) for s in seqs}
    refs = [b.ref_count for b in kv.pool.blocks]
    hashes = {s: list(kv._block_hashes.get(s, [])) for s in seqs}
    return tables, refs, hashes, kv.num_free_blocks, kv.take_blocks_to_copy()


@pytest.mark.parametrize("caching", [True, False])
def test_decodes_match_the_general_path(caching, monkeypatch):
    rng = random.Random(caching)
    fast = KVCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=caching, watermark=0)
    slow = KVCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=caching, watermark=0)
    monkeypatch.setattr(slow, "_decodes_in_place", lambda *args: False)
    tokens = {"a": [1, 2, 3, 4, 5, 6], "b": [1, 2, 3, 4, 5, 6, 7]}
    for kv in (fast, slow):
        for seq, ids in tokens.items():
            assert kv.allocate_slots(seq, ids, 0, len(ids))
        kv.fork("a", "a1")  # a and a1 share a partly filled block: the next write copies it
    tokens["a1"] = list(tokens["a"])
    for _ in range(20):
        for seq, ids in tokens.items():
            ids.append(rng.randrange(8))
            for kv in (fast, slow):
                assert kv.allocate_slots(seq, ids, len(ids) - 1, 1)
        assert state(fast, tokens) == state(slow, tokens)


def test_block_ids_are_snapshots_replaced_when_the_table_grows():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False, watermark=0)
    ids = list(range(3))
    assert kv.allocate_slots("a", ids, 0, 3)
    first = kv.block_ids("a")
    ids.append(3)
    assert kv.allocate_slots("a", ids, 3, 1)  # fills the block in place: the same list
    assert kv.block_ids("a") is first and first == kv.get_block_table("a")
    ids.append(4)
    assert kv.allocate_slots("a", ids, 4, 1)  # a second block: a new list, the old one kept
    assert len(first) == 1 and len(kv.block_ids("a")) == 2
    kv.free("a")
    assert kv.block_ids("a") == [] and len(first) == 1
