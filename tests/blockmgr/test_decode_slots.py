"""The KVCacheManager's decode paths at block boundaries (``allocate_decode_slot``: a decode that
starts a new block or fills one) and in place (``decode_in_place`` and its remembered range),
against ``allocate_slots`` alone with every fast path off: the same tables, reference counts,
copies, prefix-cache entries and free blocks, decode after decode."""

from __future__ import annotations

import random

import pytest

from pagedserve.blockmgr import KVCacheManager


def state(kv: KVCacheManager, seqs) -> tuple:
    tables = {s: kv.get_block_table(s) for s in seqs}
    refs = [b.ref_count for b in kv.pool.blocks]
    hashes = {s: list(kv._block_hashes.get(s, [])) for s in seqs}
    cached = {h: b.block_id for h, b in kv.pool.cached_block_by_hash.items()}
    return tables, refs, hashes, cached, list(kv.pool.free_block_ids()), kv.take_blocks_to_copy()


def decode_fast(kv: KVCacheManager, seq: str, ids: list[int], salt: str | None) -> bool:
    """What the scheduler's decode fast path asks, falling back to the general path."""
    num_computed = len(ids) - 1
    got = kv.decode_in_place(seq, num_computed)
    if got is None:
        got = kv.allocate_decode_slot(seq, ids, num_computed, salt)
    if got is None:
        return kv.allocate_slots(seq, ids, num_computed, 1, cache_salt=salt)
    assert got == kv.get_block_table(seq)
    return True


@pytest.mark.parametrize("window", [None, 6], ids=str)
@pytest.mark.parametrize("block_size", [1, 4])
@pytest.mark.parametrize("caching", [True, False])
def test_decode_paths_match_allocate_slots(block_size, caching, window):
    rng = random.Random(block_size * 2 + caching)
    kvs = [
        KVCacheManager(40, block_size, caching, watermark=0, sliding_window=window)
        for _ in range(2)
    ]
    fast, slow = kvs
    slow._decodes_in_place = lambda *args: False  # allocate_slots allocates every token in full
    tokens: dict[str, list[int]] = {}
    salts: dict[str, str | None] = {}
    boundary_decodes = 0
    for step in range(400):
        if len(tokens) < 5 and rng.random() < 0.2:  # a new sequence, often a shared prefix
            seq, ids = f"s{step}", [1, 2, 3, 4, 5][: rng.randint(1, 5)] + [rng.randrange(3)]
            salts[seq] = rng.choice([None, None, "x"])
            hits = [kv.get_computed_blocks(ids, salts[seq]) for kv in kvs]
            oks = [
                kv.allocate_slots(seq, ids, n, len(ids) - n, blocks, salts[seq])
                for kv, (blocks, n) in zip(kvs, hits)
            ]
            assert oks[0] == oks[1]
            if oks[0]:
                tokens[seq] = ids
        elif tokens and rng.random() < 0.05:  # a fork: the last block is shared from now on
            parent = rng.choice(sorted(tokens))
            child = f"{parent}.{step}"
            for kv in kvs:
                kv.fork(parent, child)
            tokens[child], salts[child] = list(tokens[parent]), salts[parent]
        elif tokens and rng.random() < 0.05:  # a sequence ends (its blocks go back, cached)
            seq = rng.choice(sorted(tokens))
            for kv in kvs:
                kv.free(seq)
            del tokens[seq]
        for seq, ids in list(tokens.items()):
            ids.append(rng.randrange(3))
            boundary_decodes += (len(ids) - 1) % block_size in (0, block_size - 1)
            ok = decode_fast(fast, seq, ids, salts[seq])
            assert slow.allocate_slots(seq, ids, len(ids) - 1, 1, cache_salt=salts[seq]) == ok
            if not ok:  # the pool ran dry: the scheduler would preempt
                for kv in kvs:
                    kv.free(seq)
                del tokens[seq]
        assert state(fast, tokens) == state(slow, tokens), step
    assert boundary_decodes > 100


def test_a_block_boundary_decode_needs_no_allocate_slots(monkeypatch):
    """Starting a block and filling one take ``allocate_decode_slot`` alone, and the decodes
    in between are answered from the range it remembered (``_decodes_in_place`` is not asked)."""
    kv = KVCacheManager(8, block_size=4, watermark=0)
    ids = [1, 2, 3, 4]
    assert kv.allocate_slots("a", ids, 0, 4)  # one full block, registered
    monkeypatch.setattr(kv, "allocate_slots", None)  # any call would fail
    ids.append(5)
    assert kv.decode_in_place("a", 4) is None
    assert kv.allocate_decode_slot("a", ids, 4) == kv.get_block_table("a")  # a new block
    assert len(kv.get_block_table("a")) == 2
    checks = []
    real = kv._decodes_in_place
    monkeypatch.setattr(kv, "_decodes_in_place", lambda *a: checks.append(a) or real(*a))
    for n in (5, 6):
        ids.append(n + 1)
        assert kv.decode_in_place("a", n) == kv.get_block_table("a")
    assert checks == []  # the range remembered when the block was started answered both
    ids.append(8)
    assert kv.decode_in_place("a", 7) is None  # token 7 fills block 1: it must be registered
    assert kv.allocate_decode_slot("a", ids, 7) == kv.get_block_table("a")
    assert kv._num_registered["a"] == 2 and kv.pool.num_cached_blocks == 2
