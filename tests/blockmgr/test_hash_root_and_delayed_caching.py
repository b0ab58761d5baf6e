"""What a KV connector needs of the block manager: hashes rooted where it says (so a store
that outlives the process names a prefix as a restarted engine does), and blocks allocated for
keys and values still on their way kept out of the prefix cache until they arrive."""

from __future__ import annotations

from pagedserve.blockmgr import KVCacheManager

PROMPT = list(range(100, 121))  # 5 full blocks of 4, and one token


def test_managers_with_one_root_name_a_prefix_alike_and_other_roots_do_not():
    root = b"r" * 16
    a, b = KVCacheManager(8, 4, hash_root=root), KVCacheManager(8, 4, hash_root=root)
    other, unrooted = KVCacheManager(8, 4, hash_root=b"s" * 16), KVCacheManager(8, 4)
    hashes = a.hash_prefix(PROMPT, 20)
    assert len(hashes) == 5 and b.hash_prefix(PROMPT, 20) == hashes
    assert not set(hashes) & set(other.hash_prefix(PROMPT, 20))
    assert not set(hashes) & set(unrooted.hash_prefix(PROMPT, 20))
    a.allocate_slots("s", PROMPT, 0, len(PROMPT))
    assert list(a.block_hashes("s")) == hashes  # what it registered, by the same names


def test_delayed_blocks_join_the_prefix_cache_only_once_they_arrive():
    kv = KVCacheManager(8, 4, watermark=0)
    assert kv.allocate_slots("s", PROMPT, 0, 16, delay_caching=True)
    assert kv.get_computed_blocks(PROMPT) == ([], 0)
    kv.cache_blocks("s", PROMPT, 12)  # three blocks arrived
    kv.free("s")
    hits, num_hit = kv.get_computed_blocks(PROMPT)
    assert num_hit == 12 and kv.num_free_blocks == 8
