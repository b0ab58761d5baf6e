"""The offload tiers and the block record on their own: LRU within a budget, the disk tier's
index across a restart, and the header that pins what a record is."""

from __future__ import annotations

import time

import numpy as np
import pytest

from pagedserve.engine.kv_connector.block_record import (
    HEADER,
    BlockLayout,
    BlockRecordError,
    check_record,
    encode_header,
)
from pagedserve.engine.kv_connector.disk_tier import DiskTier
from pagedserve.engine.kv_connector.host_tier import HostTier
from pagedserve.engine.kv_connector.stats import StatsRecorder

LAYOUT = BlockLayout(b"m" * 16, "float16", 4, 2, 1, 8)  # 2*2*4*1*8*2 = 256 bytes a block


def _payload(value: int) -> np.ndarray:
    return np.full(LAYOUT.payload_bytes, value, dtype=np.uint8)


def _key(i: int) -> bytes:
    return i.to_bytes(32, "little")


def test_host_tier_keeps_the_most_recently_used_within_its_budget():
    tier = HostTier(3 * 256, 256)
    for i in range(3):
        tier.put(_key(i), _payload(i))
    tier.get(_key(0))  # used: now the newest
    tier.put(_key(3), _payload(3))
    assert [_key(i) in tier for i in range(4)] == [True, False, True, True]
    assert tier.used_bytes == 3 * 256
    with pytest.raises(ValueError, match="kv_offload_memory"):
        HostTier(100, 256)


def _disk(folder, blocks: int, stats=None) -> DiskTier:
    record = HEADER.size + LAYOUT.payload_bytes
    return DiskTier(str(folder), LAYOUT, blocks * record, stats or StatsRecorder())


def test_disk_tier_deletes_the_least_recently_used_files_beyond_its_budget(tmp_path):
    tier = _disk(tmp_path, blocks=3)
    for i in range(3):
        tier.put(_key(i), _payload(i))
    tier.close()  # written
    tier = _disk(tmp_path, blocks=3)
    np.testing.assert_array_equal(tier.read(_key(0)), _payload(0))  # used: now the newest
    tier.put(_key(3), _payload(3))
    tier.close()
    assert [_key(i) in tier for i in range(4)] == [True, False, True, True]
    assert len(list(tmp_path.glob("*/*.kv"))) == 3


def test_a_restart_finds_the_files_and_their_order(tmp_path):
    tier = _disk(tmp_path, blocks=4)
    for i in range(3):
        tier.put(_key(i), _payload(i))
        tier.close()  # one at a time: distinct modification times
        tier = _disk(tmp_path, blocks=4)
        time.sleep(0.01)
    root = tier.hash_root
    tier.close()
    again = _disk(tmp_path, blocks=2)  # a smaller budget: the oldest goes at start
    assert again.hash_root == root
    assert [_key(i) in again for i in range(3)] == [False, True, True]


def test_a_record_loads_only_into_the_layout_and_key_it_was_saved_for():
    payload = _payload(7)
    record = encode_header(LAYOUT, _key(1), payload) + payload.tobytes()
    np.testing.assert_array_equal(check_record(LAYOUT, _key(1), record), payload)
    others = {
        "model": BlockLayout(b"o" * 16, "float16", 4, 2, 1, 8),
        "dtype": BlockLayout(b"m" * 16, "bfloat16", 4, 2, 1, 8),
        "shape": BlockLayout(b"m" * 16, "float16", 8, 1, 1, 8),
    }
    for layout in others.values():
        with pytest.raises(BlockRecordError) as error:
            check_record(layout, _key(1), record)
        assert error.value.kind == "mismatch"
    with pytest.raises(BlockRecordError, match="key") as error:
        check_record(LAYOUT, _key(2), record)
    assert error.value.kind == "mismatch"
    flipped = bytearray(record)
    flipped[-1] ^= 1
    for broken in (bytes(flipped), record[:-1], record[:50], b"x" * len(record)):
        with pytest.raises(BlockRecordError) as error:
            check_record(LAYOUT, _key(1), broken)
        assert error.value.kind == "corrupt"
