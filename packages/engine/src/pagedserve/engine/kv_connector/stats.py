"""The KV connector's counters: hits per tier, bytes moved, load time, refusals.

Tiers are where a block comes from or goes to: ``ram`` and ``disk`` (KV offloading), and
``remote`` (a disaggregated prefill's transfer). The engine thread and the connector's
threads (disk writer, loaders, the transfer server) all count, so every update takes the
lock; ``snapshot`` gives /metrics a consistent copy.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class KVConnectorStats:
    """Cumulative since the engine started, except the tiers' usage (as of now).

    ``hit_tokens``: prompt tokens the connector supplied (after the prefix cache's own hit),
    by tier. ``loaded_bytes`` / ``saved_bytes``: bytes moved into and out of the KV cache, by
    tier. ``load_seconds`` / ``loads``: time from a load's start to its blocks being in the
    cache, and how many loads, by tier (a transfer's time is its ``remote`` part).
    ``failed_loads``: loads that brought fewer blocks than asked (the rest was recomputed).
    ``rejected_blocks``: blocks refused by their header or checksum, by reason (``mismatch``,
    ``corrupt``). ``dropped_saves``: blocks not saved because a tier could not take them in
    time (the disk writer's queue was full, the transfer buffer was full), by tier.
    ``tier_bytes`` / ``tier_blocks``: what each tier holds now.
    """

    hit_tokens: Counter = field(default_factory=Counter)
    loaded_bytes: Counter = field(default_factory=Counter)
    saved_bytes: Counter = field(default_factory=Counter)
    load_seconds: Counter = field(default_factory=Counter)
    loads: Counter = field(default_factory=Counter)
    failed_loads: int = 0
    rejected_blocks: Counter = field(default_factory=Counter)
    dropped_saves: Counter = field(default_factory=Counter)
    tier_bytes: dict[str, int] = field(default_factory=dict)
    tier_blocks: dict[str, int] = field(default_factory=dict)


class StatsRecorder:
    """A thread-safe ``KVConnectorStats``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = KVConnectorStats()

    def saved(self, tier: str, num_bytes: int) -> None:
        with self._lock:
            self._stats.saved_bytes[tier] += num_bytes

    def loaded(self, tier: str, num_tokens: int, num_bytes: int) -> None:
        """Blocks of ``num_tokens`` tokens loaded from ``tier``: a hit, and bytes moved."""
        with self._lock:
            self._stats.hit_tokens[tier] += num_tokens
            self._stats.loaded_bytes[tier] += num_bytes

    def load_time(self, tier: str, seconds: float) -> None:
        """One load, from its start to its blocks in the cache, under its slowest tier."""
        with self._lock:
            self._stats.load_seconds[tier] += seconds
            self._stats.loads[tier] += 1

    def failed_load(self) -> None:
        with self._lock:
            self._stats.failed_loads += 1

    def rejected(self, reason: str) -> None:
        with self._lock:
            self._stats.rejected_blocks[reason] += 1

    def dropped(self, tier: str) -> None:
        with self._lock:
            self._stats.dropped_saves[tier] += 1

    def usage(self, tier: str, num_blocks: int, num_bytes: int) -> None:
        with self._lock:
            self._stats.tier_blocks[tier] = num_blocks
            self._stats.tier_bytes[tier] = num_bytes

    def snapshot(self) -> KVConnectorStats:
        with self._lock:
            s = self._stats
            return KVConnectorStats(
                *(Counter(c) for c in (s.hit_tokens, s.loaded_bytes, s.saved_bytes)),
                Counter(s.load_seconds),
                Counter(s.loads),
                s.failed_loads,
                Counter(s.rejected_blocks),
                Counter(s.dropped_saves),
                dict(s.tier_bytes),
                dict(s.tier_blocks),
            )
