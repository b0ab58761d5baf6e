"""Blocks behind every layer's sliding window are released as a sequence grows, and prefix
caching, fork and free stay correct beside them."""

from __future__ import annotations

from pagedserve.blockmgr import KVCacheManager, extend_block_hashes
from pagedserve.blockmgr.kv_cache_manager import OUT_OF_WINDOW

BS, WINDOW = 4, 6


def _grow(kv: KVCacheManager, seq: str, tokens: list[int], prompt_len: int) -> None:
    """A prompt in one step, then one decode step per remaining token."""
    assert kv.allocate_slots(seq, tokens, 0, prompt_len)
    for n in range(prompt_len, len(tokens)):
        assert kv.allocate_slots(seq, tokens, n, 1)


def _held(kv: KVCacheManager, seq: str) -> list[int]:
    return [b.block_id for b in kv.block_tables[seq] if b is not OUT_OF_WINDOW]


def test_decode_holds_only_the_window_and_the_tail():
    kv = KVCacheManager(32, BS, enable_prefix_caching=False, watermark=0, sliding_window=WINDOW)
    tokens = list(range(40))
    assert kv.allocate_slots("a", tokens, 0, 5)
    for n in range(5, 40):
        assert kv.allocate_slots("a", tokens, n, 1)
        table = kv.block_tables["a"]
        # the next token (position n) sees n - 5 .. n: blocks before (n - 5) // 4 are gone
        horizon = n - WINDOW + 1
        assert all(b is OUT_OF_WINDOW for b in table[: horizon // BS])
        assert all(b is not OUT_OF_WINDOW for b in table[max(0, horizon) // BS :])
        assert len(table) == n // BS + 1  # one entry per logical block: slots unchanged
        assert kv.num_free_blocks == 32 - len(_held(kv, "a"))
    assert len(_held(kv, "a")) <= -(-WINDOW // BS) + 1
    kv.free("a")
    assert kv.num_free_blocks == 32


def test_without_a_window_nothing_is_released():
    kv = KVCacheManager(32, BS, enable_prefix_caching=False, watermark=0)
    _grow(kv, "a", list(range(40)), 5)
    assert len(_held(kv, "a")) == 10


def test_released_blocks_keep_their_prefix_hashes():
    """A long windowed sequence releases its head; a later request with the same prompt still
    hits every block of it, which hold exactly that prompt's tokens."""
    kv = KVCacheManager(64, BS, watermark=0, sliding_window=WINDOW)
    prompt = list(range(100, 130))
    _grow(kv, "a", prompt + list(range(20)), len(prompt))
    assert kv.block_tables["a"][0] is OUT_OF_WINDOW
    hits, cached = kv.get_computed_blocks(prompt)
    assert cached == 28  # 7 full blocks (the last token is always computed)
    assert all(b.ref_count == 0 for b in hits[:3])  # released, still cached
    assert kv.allocate_slots("b", prompt, cached, len(prompt) - cached, computed_blocks=hits)
    # b computes from 28 on and sees 23..: its own blocks before 20 // 4 = 5 are released again
    assert kv.block_tables["b"][:5] == [OUT_OF_WINDOW] * 5
    assert [b.block_id for b in kv.block_tables["b"][5:7]] == [b.block_id for b in hits[5:7]]
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 64


def test_an_evicted_head_ends_the_prefix_hit_there():
    """Released head blocks go back to the pool while the sequence still runs, so under
    pressure they are reused first; a later hit then stops at the first block that no longer
    holds the prefix, and every block it does return holds exactly the prompt's tokens."""
    kv = KVCacheManager(10, BS, watermark=0, sliding_window=WINDOW)
    prompt = list(range(100, 124))
    _grow(kv, "a", prompt + [1, 2, 3, 4, 5], len(prompt))
    kv.free("a")
    assert kv.allocate_slots("x", list(range(500, 516)), 0, 16)  # 4 blocks: evicts the head
    hits, cached = kv.get_computed_blocks(prompt)
    chain = extend_block_hashes([], prompt[: len(hits) * BS], BS, None)
    assert [b.block_hash for b in hits] == chain
    assert cached < 20  # the head was evicted: fewer than the 5 blocks a full hit gives
    assert len(hits) == 0 or kv.pool.lookup(chain[0]) is hits[0]


def test_fork_shares_only_the_held_blocks():
    kv = KVCacheManager(32, BS, enable_prefix_caching=False, watermark=0, sliding_window=WINDOW)
    tokens = list(range(30))
    _grow(kv, "p", tokens, 10)
    kv.fork("p", "c")
    assert kv.block_tables["c"] == kv.block_tables["p"]
    assert all(kv.pool.blocks[i].ref_count == 2 for i in _held(kv, "p"))
    assert kv.allocate_slots("c", tokens + [7], 30, 1)
    kv.free("p")
    kv.free("c")
    assert kv.num_free_blocks == 32
