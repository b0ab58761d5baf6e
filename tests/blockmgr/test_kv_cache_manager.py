"""KVCacheManager basics: block tables, prefix-cache hits, fork and copy-on-write, free."""

from __future__ import annotations

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
