"""The host-memory tier of KV offloading: block bytes by prefix hash, least recently used out.

A second level behind the KV pool: every block the engine computes is copied here (the disk
tier, when there is one, gets it too), and a prompt whose prefix the pool has evicted loads
it back from here instead of recomputing it. On a CPU both levels are RAM, and this one is
simply larger; on a GPU it is host memory behind device memory.

Only the engine thread touches it (saves after a forward, loads at admission), so it has no
lock. Payloads are never changed once stored: a load holds the array itself, so an eviction
after the lookup cannot take a block from under it.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np


class HostTier:
    """At most ``capacity_bytes`` of blocks of ``block_bytes`` each, LRU."""

    name = "ram"

    def __init__(self, capacity_bytes: int, block_bytes: int) -> None:
        if capacity_bytes < block_bytes:
            raise ValueError(
                f"kv_offload_memory ({capacity_bytes} bytes) holds no KV block of {block_bytes} "
                "bytes: give it at least one block's worth"
            )
        self.capacity_blocks = capacity_bytes // block_bytes
        self.block_bytes = block_bytes
        self._blocks: OrderedDict[bytes, np.ndarray] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def used_bytes(self) -> int:
        return len(self._blocks) * self.block_bytes

    def get(self, key: bytes) -> np.ndarray | None:
        """The block's bytes (now the most recently used), or None."""
        payload = self._blocks.get(key)
        if payload is not None:
            self._blocks.move_to_end(key)
        return payload

    def touch(self, key: bytes) -> None:
        """Mark a block used (a prefix-cache hit on it keeps it from aging out here)."""
        if key in self._blocks:
            self._blocks.move_to_end(key)

    def put(self, key: bytes, payload: np.ndarray) -> None:
        """Store a block (an existing one is only touched), evicting the least recently used."""
        if key in self._blocks:
            self._blocks.move_to_end(key)
            return
        self._blocks[key] = payload
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)
