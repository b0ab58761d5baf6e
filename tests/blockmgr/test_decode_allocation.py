"""A decode's allocation (one token at a time, answered inside ``allocate_slots`` from the range
of counts it remembers, or at a block boundary) against the same tokens allocated in one chunk:
the same block tables, the same blocks registered in the prefix cache, the same free blocks,
and a shared last block copied before the first write, for forks too."""

from __future__ import annotations

import random

import pytest

from pagedserve.blockmgr import KVCacheManager


def managers(block_size: int, caching: bool) -> tuple[KVCacheManager, KVCacheManager]:
    return tuple(KVCacheManager(64, block_size, caching, watermark=0) for _ in range(2))


def state(kv: KVCacheManager, seqs: list[str], tokens: dict[str, list[int]]) -> tuple:
    """What a reader of the manager sees: tables, free blocks, and how much of each sequence's
    tokens a new sequence would find in the prefix cache."""
    hits = {s: kv.get_computed_blocks(tokens[s] + [0])[1] for s in seqs}
    return {s: kv.get_block_table(s) for s in seqs}, kv.num_free_blocks, hits


@pytest.mark.parametrize("block_size", [1, 4])
@pytest.mark.parametrize("caching", [True, False])
def test_decoding_token_by_token_equals_allocating_the_run_at_once(block_size, caching):
    rng = random.Random(block_size + 2 * caching)
    for _ in range(30):
        decoded, chunked = managers(block_size, caching)
        prompt = [rng.randrange(5) for _ in range(rng.randint(1, 11))]
        generated = [rng.randrange(5) for _ in range(rng.randint(1, 13))]
        for kv in (decoded, chunked):
            assert kv.allocate_slots("s", prompt, 0, len(prompt))
        tokens = list(prompt)
        for token in generated:
            tokens.append(token)
            assert decoded.allocate_slots("s", tokens, len(tokens) - 1, 1)
        assert chunked.allocate_slots("s", tokens, len(prompt), len(generated))
        both = {"s": tokens}
        assert state(decoded, ["s"], both) == state(chunked, ["s"], both)
        assert decoded.take_blocks_to_copy() == chunked.take_blocks_to_copy() == []


@pytest.mark.parametrize("block_size", [2, 4])
def test_a_forks_first_decode_copies_the_shared_last_block(block_size):
    """Parent and child share a partly filled last block: the first of them to decode into it
    gets a private copy first, and the other then writes in place."""
    kv = KVCacheManager(32, block_size, True, watermark=0)
    prompt = list(range(block_size + 1))  # the last block holds one token: shared, not full
    assert kv.allocate_slots("parent", prompt, 0, len(prompt))
    kv.fork("parent", "child")
    shared = kv.get_block_table("parent")[-1]
    assert kv.allocate_slots("child", prompt + [7], len(prompt), 1)
    ((src, dst),) = kv.take_blocks_to_copy()
    assert src == shared and kv.get_block_table("child")[-1] == dst != shared
    assert kv.allocate_slots("parent", prompt + [8], len(prompt), 1)
    assert kv.take_blocks_to_copy() == [] and kv.get_block_table("parent")[-1] == shared
    for seq in ("parent", "child"):  # each decodes on in its own block, no copy again
        tokens = prompt + [7 if seq == "child" else 8, 9]
        assert kv.allocate_slots(seq, tokens, len(tokens) - 1, 1)
    assert kv.take_blocks_to_copy() == []
