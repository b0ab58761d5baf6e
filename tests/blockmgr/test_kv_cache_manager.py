"""KVCacheManager basics: block tables, prefix-cache hits, fork and copy-on-write, free."""

from __future__ import annotations

import pytest

from pagedserve.blockmgr import KVCacheManager


def test_allocate_grows_block_table_and_free_returns_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False, watermark=0)
    tokens = list(range(10))
    assert kv.allocate_slots("a", tokens, 0, 10)
    assert len(kv.get_block_table("a")) == 3  # ceil(10 / 4)
    assert kv.num_free_blocks == 5
    tokens.append(10)
    assert kv.allocate_slots("a", tokens, 10, 1)  # slot 10 fits in block 3
    assert len(kv.get_block_table("a")) == 3
    tokens += [11, 12]
    assert kv.allocate_slots("a", tokens, 11, 2)  # token 12 needs a fourth block
    assert len(kv.get_block_table("a")) == 4
    kv.free("a")
    assert kv.num_free_blocks == 8


def test_allocation_is_all_or_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=4, enable_prefix_caching=False, watermark=0)
    assert not kv.allocate_slots("a", list(range(9)), 0, 9)
    assert kv.num_free_blocks == 2 and kv.get_block_table("a") == []


def test_prefix_hit_shares_full_blocks_but_never_the_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=4, watermark=0)
    prompt = list(range(12))
    assert kv.allocate_slots("a", prompt, 0, 12)
    hits, cached = kv.get_computed_blocks(prompt)
    assert cached == 8  # 3 full blocks, but the last token must be computed: 2 blocks
    assert [b.block_id for b in hits] == kv.get_block_table("a")[:2]
    other = list(range(8)) + [99, 98, 97, 96, 95]
    hits, cached = kv.get_computed_blocks(other)
    assert cached == 8
    assert kv.allocate_slots("b", other, cached, len(other) - cached, computed_blocks=hits)
    assert kv.get_block_table("b")[:2] == kv.get_block_table("a")[:2]
    assert all(kv.pool.blocks[i].ref_count == 2 for i in kv.get_block_table("a")[:2])


def test_freed_cached_blocks_are_still_hit_until_reused():
    kv = KVCacheManager(num_blocks=4, block_size=4, watermark=0)
    prompt = list(range(9))
    kv.allocate_slots("a", prompt, 0, 9)
    kv.free("a")
    hits, cached = kv.get_computed_blocks(prompt)
    assert cached == 8 and kv.num_free_blocks == 4
    assert kv.allocate_slots("b", prompt, cached, 1, computed_blocks=hits)
    assert kv.num_free_blocks == 1


def test_salt_separates_prefixes():
    kv = KVCacheManager(num_blocks=8, block_size=4, watermark=0)
    prompt = list(range(9))
    kv.allocate_slots("a", prompt, 0, 9, cache_salt="tenant-a")
    assert kv.get_computed_blocks(prompt, cache_salt="tenant-b")[1] == 0
    assert kv.get_computed_blocks(prompt, cache_salt="tenant-a")[1] == 8


def test_fork_shares_then_copy_on_write_on_the_partial_block():
    kv = KVCacheManager(num_blocks=8, block_size=4, watermark=0)
    prompt = list(range(6))
    kv.allocate_slots("parent", prompt, 0, 6)
    kv.fork("parent", "child")
    parent_table = kv.get_block_table("parent")
    assert kv.get_block_table("child") == parent_table
    assert kv.allocate_slots("child", prompt + [50], 6, 1)  # writes into shared block 1
    child_table = kv.get_block_table("child")
    assert child_table[0] == parent_table[0]
    assert child_table[1] != parent_table[1]
    assert kv.take_blocks_to_copy() == [(parent_table[1], child_table[1])]
    assert kv.take_blocks_to_copy() == []
    kv.free("parent")
    kv.free("child")
    assert kv.num_free_blocks == 8


def test_stats_count_each_admission_once_however_often_it_was_looked_up():
    kv = KVCacheManager(num_blocks=4, block_size=4, watermark=0)
    prompt = list(range(9))
    assert kv.allocate_slots("a", prompt, 0, 9)  # cold: 9 queried, 0 hit
    blocker = list(range(100, 104))
    assert kv.allocate_slots("blocker", blocker, 0, 4)  # the pool is now full
    for _ in range(5):  # a waiting request looked up step after step, never admitted
        hits, cached = kv.get_computed_blocks(prompt)
        assert cached == 8
        assert not kv.allocate_slots("b", prompt, cached, 1, computed_blocks=hits)
    kv.free("blocker")
    hits, cached = kv.get_computed_blocks(prompt)
    assert kv.allocate_slots("b", prompt, cached, 1, computed_blocks=hits)
    stats = kv.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (3, 9 + 4 + 9, 8)  # a, blocker, b
    assert stats.hit_rate == 8 / 22


def test_stats_through_the_scheduler_count_a_blocked_request_once():
    from pagedserve.scheduler import Request, Scheduler, SchedulerConfig

    kv = KVCacheManager(num_blocks=4, block_size=4, watermark=0)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=16)
    scheduler = Scheduler(config, kv)
    scheduler.add_request(Request("a", list(range(13)), max_tokens=3))  # holds all 4 blocks
    scheduler.add_request(Request("b", list(range(8)) + [50, 51, 52, 53], max_tokens=1))
    waiting_steps = 0
    while scheduler.has_unfinished_requests():
        waiting_steps += any(r.request_id == "b" for r in scheduler.waiting)
        out = scheduler.schedule()
        scheduler.update(out, {s.request.request_id: [7] for s in out.scheduled if s.needs_sample})
    assert waiting_steps == 4  # b was looked up at each of a's three steps, and then admitted
    assert scheduler.stats.num_preemptions == 0
    stats = kv.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 13 + 12, 8)


def test_stale_hits_are_refused():
    from pagedserve.blockmgr.kv_cache_manager import StalePrefixHitError

    kv = KVCacheManager(num_blocks=2, block_size=4, watermark=0)
    prompt = list(range(5))
    kv.allocate_slots("a", prompt, 0, 5)
    kv.free("a")
    hits, cached = kv.get_computed_blocks(prompt)
    assert cached == 4
    kv.allocate_slots("other", list(range(50, 58)), 0, 8)  # evicts and reuses the hit block
    kv.free("other")
    with pytest.raises(StalePrefixHitError):
        kv.allocate_slots("b", prompt, cached, 1, computed_blocks=hits)
    with pytest.raises(ValueError, match="cover"):
        kv.allocate_slots("c", prompt, 0, 5, computed_blocks=hits)


def test_watermark_holds_back_admission_but_not_running_sequences():
    kv = KVCacheManager(num_blocks=10, block_size=4, watermark=0.2)  # 2 blocks held back
    assert kv.watermark_blocks == 2
    assert not kv.allocate_slots("big", list(range(36)), 0, 36)  # 9 blocks: leaves 1 < 2
    assert kv.allocate_slots("a", list(range(32)), 0, 32)  # 8 blocks: leaves exactly 2
    tokens = list(range(40))
    assert kv.allocate_slots("a", tokens[:33], 32, 1)  # a running sequence may use them
    assert kv.allocate_slots("a", tokens[:37], 33, 4)
    assert kv.num_free_blocks == 0 and kv.usage() == 1.0


def test_freed_cached_blocks_are_evicted_least_recently_used_first():
    kv = KVCacheManager(num_blocks=6, block_size=2, watermark=0)
    kv.allocate_slots("old", [1, 2, 3, 4, 5], 0, 5)  # blocks 0,1 full (cached), 2 partial
    kv.allocate_slots("new", [6, 7, 8], 0, 3)  # block 3 full (cached), 4 partial
    kv.free("old")
    kv.free("new")
    # Unhashed (partial) blocks are worth nothing: handed out first. Then cached ones, oldest
    # first, and within a freed sequence its tail before its head.
    assert list(kv.pool.free_block_ids()) == [4, 2, 5, 1, 0, 3]
    kv.allocate_slots("x", list(range(100, 108)), 0, 8)  # 4 blocks: evicts old's tail (1)
    assert kv.get_computed_blocks([1, 2, 3, 4, 5])[1] == 2  # old's head is still cached
    assert kv.get_computed_blocks([6, 7, 8])[1] == 2


def test_a_hit_on_a_free_block_takes_it_out_of_the_queue():
    kv = KVCacheManager(num_blocks=4, block_size=2, watermark=0)
    kv.allocate_slots("a", [1, 2, 3], 0, 3)
    kv.free("a")
    hits, cached = kv.get_computed_blocks([1, 2, 9])
    assert kv.allocate_slots("b", [1, 2, 9], cached, 1, computed_blocks=hits)
    assert hits[0].block_id not in set(kv.pool.free_block_ids())
    assert hits[0].ref_count == 1 and kv.num_free_blocks == 2


def test_fork_of_a_full_last_block_copies_nothing():
    kv = KVCacheManager(num_blocks=8, block_size=4, watermark=0)
    kv.allocate_slots("p", list(range(8)), 0, 8)
    kv.fork("p", "c")
    assert kv.allocate_slots("c", list(range(8)) + [1], 8, 1)
    assert kv.allocate_slots("p", list(range(8)) + [2], 8, 1)
    assert kv.take_blocks_to_copy() == []
    assert kv.get_block_table("c")[:2] == kv.get_block_table("p")[:2]
    assert kv.get_block_table("c")[2] != kv.get_block_table("p")[2]


def test_bad_calls_raise_clear_errors():
    kv = KVCacheManager(num_blocks=8, block_size=4, watermark=0)
    with pytest.raises(ValueError, match="holds no blocks"):
        kv.fork("nobody", "child")
    kv.allocate_slots("a", [1, 2], 0, 2)
    kv.fork("a", "b")
    with pytest.raises(ValueError, match="already has blocks"):
        kv.fork("a", "b")
    with pytest.raises(ValueError, match="non-negative"):
        kv.allocate_slots("a", [1, 2], 2, -1)


def test_reset_prefix_cache_is_refused_while_blocks_are_held():
    kv = KVCacheManager(num_blocks=4, block_size=2, watermark=0)
    kv.allocate_slots("a", [1, 2, 3], 0, 3)
    assert not kv.reset_prefix_cache()
    kv.free("a")
    assert kv.get_computed_blocks([1, 2, 3])[1] == 2
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks([1, 2, 3])[1] == 0


def test_prefix_caching_off_never_hits_or_counts():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=False, watermark=0)
    kv.allocate_slots("a", [1, 2, 3], 0, 3)
    assert kv.get_computed_blocks([1, 2, 3]) == ([], 0)
    assert kv.pool.num_cached_blocks == 0 and kv.prefix_cache_stats.requests == 0
