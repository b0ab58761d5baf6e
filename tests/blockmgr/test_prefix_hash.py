"""Chained prefix hashes: a block's hash covers every token before it, its own tokens and the
salt; SHA-256 seeded per process, so a hash can be neither predicted nor forged from outside."""

from __future__ import annotations

import subprocess
import sys

from pagedserve.blockmgr import extend_block_hashes, hash_block


def test_a_block_hash_covers_its_whole_prefix():
    a = extend_block_hashes([], [1, 2, 3, 4, 5, 6], 2)
    b = extend_block_hashes([], [9, 9, 3, 4, 5, 6], 2)
    assert len(a) == 3 and len(set(a)) == 3
    assert all(x != y for x, y in zip(a, b, strict=True))  # same later tokens, other prefix
    assert a == extend_block_hashes([], [1, 2, 3, 4, 5, 6, 7], 2)  # the partial block: no hash


def test_extending_incrementally_equals_hashing_at_once():
    tokens = list(range(20))
    hashes: list[bytes] = []
    for end in range(1, 21):
        extend_block_hashes(hashes, tokens[:end], 4)
    assert hashes == extend_block_hashes([], tokens, 4)


def test_salt_and_token_width_keep_hashes_apart():
    assert hash_block(None, [1, 2]) != hash_block(None, [1, 2], "tenant")
    assert hash_block(None, [1, 2], "a") != hash_block(None, [1, 2], "b")
    assert hash_block(None, [1 << 32]) != hash_block(None, [0, 1])  # 64-bit token ids
    assert len(hash_block(None, [1, 2])) == 32  # SHA-256, not Python's hash()


def test_hashes_are_seeded_per_process():
    code = "from pagedserve.blockmgr import hash_block; print(hash_block(None, [1, 2, 3]).hex())"
    runs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.strip()
        for _ in range(2)
    }
    assert len(runs) == 2
    assert hash_block(None, [1, 2, 3]).hex() not in runs


def test_the_lora_adapter_keeps_hashes_apart_in_every_block():
    tokens = list(range(12))
    base = extend_block_hashes([], tokens, 4)
    one = extend_block_hashes([], tokens, 4, lora_int_id=1)
    two = extend_block_hashes([], tokens, 4, lora_int_id=2)
    assert len({*base, *one, *two}) == 9  # no block shared across adapters, or with the base
    assert one == extend_block_hashes([], tokens, 4, lora_int_id=1)
    # an adapter id is not a salt: no salt spells one
    assert hash_block(None, [1, 2], lora_int_id=1) != hash_block(None, [1, 2], "\x00lora\x00")
