"""KV offloading: the prefix cache spills to host memory and disk, and comes back from there.

Every full block the engine computes is saved, under its prefix hash, in each tier there is
(write-through: ``--kv-offload-memory`` bytes of host memory, ``--kv-offload-dir`` files
within ``--kv-offload-disk`` bytes), each tier least recently used out. When the KV pool
evicts a prefix and a later prompt starts with it, admission finds the blocks after the
prefix cache's own hit in the tiers and loads them instead of recomputing them:

- all in host memory: a synchronous load, written into the request's blocks before this
  very step's forward (a memory copy, cheaper than computing them);
- some on disk: an asynchronous load; the request waits, holding its blocks, while loader
  threads read and check the files, and is admitted once they are in (a file that fails its
  header or checksum ends the load there: the rest is recomputed). Blocks read from disk are
  kept in host memory too.

A prefix-cache hit touches the block in the tiers, so a prefix in use never ages out of them
while the pool keeps it. Requests with an adapter or a cache salt (prompt logprobs) are left
out: an adapter's id is not stable across restarts, and a salted prefix is never hit again.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import numpy as np

from pagedserve.engine.kv_connector.base import BlockSave, KVConnectorBase, LoadJob
from pagedserve.engine.kv_connector.block_record import BlockRecordError
from pagedserve.engine.kv_connector.disk_tier import DiskTier
from pagedserve.engine.kv_connector.host_tier import HostTier
from pagedserve.engine.kv_connector.stats import StatsRecorder
from pagedserve.scheduler import Request, SchedulerOutput


class OffloadingConnector(KVConnectorBase):
    """Saves computed blocks to host memory and/or disk and loads prefix hits back."""

    def __init__(
        self,
        block_size: int,
        host: HostTier | None,
        disk: DiskTier | None,
        stats: StatsRecorder,
    ) -> None:
        super().__init__(block_size, stats)
        self.host, self.disk = host, disk
        self.tiers = [tier for tier in (host, disk) if tier is not None]
        self.hash_root = disk.hash_root if disk is not None else None
        # request id -> (first block, [(key, its bytes if in host memory else None)])
        self._lookups: dict[str, tuple[int, list[tuple[bytes, np.ndarray | None]]]] = {}
        self._saved_upto: dict[str, int] = {}  # request id -> blocks saved (or skipped) so far

    # ---- the scheduler's side ------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed: int) -> tuple[int, bool]:
        """The blocks after the prefix cache's hit found in a tier, in a row (never the block
        of the last token); asynchronous when any of them is on disk only."""
        if not _offloadable(request):
            return 0, False
        block_size = self.block_size
        max_blocks = (request.num_tokens - 1) // block_size
        keys = self.kv.hash_prefix(
            request.all_token_ids, max_blocks * block_size, None, request.lora_int_id
        )
        first = num_computed // block_size
        for key in keys[:first]:  # in use in the pool: keep it fresh in the tiers too
            for tier in self.tiers:
                tier.touch(key)
        found = []
        for key in keys[first:]:
            payload = self.host.get(key) if self.host is not None else None
            if payload is None and (self.disk is None or key not in self.disk):
                break
            found.append((key, payload))
        if not found:
            return 0, False
        self._lookups[request.request_id] = (first, found)
        return len(found) * block_size, any(payload is None for _, payload in found)

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external: int, load_async: bool
    ) -> None:
        first, found = self._lookups.pop(request.request_id)
        job = LoadJob(
            request.request_id,
            list(block_ids[first : first + len(found)]),
            ["ram" if payload is not None else "disk" for _, payload in found],
            first * self.block_size,
            keys=[key for key, _ in found],
        )
        if load_async:
            job.fetch = partial(self._read, found)
        else:
            job.payloads = [payload for _, payload in found]
        self.plan_load(job)

    def blocks_to_save(self, output: SchedulerOutput) -> list[BlockSave]:
        """The full blocks each scheduled request completes in this step that some tier
        lacks (a block every tier has is only touched). O(1) for a request that completes
        none (nearly every decode)."""
        saves, saved_upto, block_size = [], self._saved_upto, self.block_size
        for request, start, count, block_ids in zip(
            output.requests, output.num_computed_tokens, output.num_new_tokens, output.block_ids
        ):
            request_id = request.request_id
            upto = saved_upto.get(request_id, start // block_size)
            done = (start + count) // block_size
            if done <= upto or not _offloadable(request):
                saved_upto[request_id] = upto
                continue
            hashes = self.kv.block_hashes(request_id)
            end = min(done, len(hashes))
            for index in range(upto, end):
                key = hashes[index]
                if all(key in tier for tier in self.tiers):
                    for tier in self.tiers:
                        tier.touch(key)
                else:
                    saves.append(BlockSave(request_id, block_ids[index], key))
            saved_upto[request_id] = max(upto, end)
        return saves

    def request_finished(self, request: Request) -> dict | None:
        self._lookups.pop(request.request_id, None)
        self._saved_upto.pop(request.request_id, None)
        return super().request_finished(request)

    # ---- the runner's side ---------------------------------------------------------------------

    def store(self, saves: Sequence[BlockSave], payloads: Sequence[np.ndarray]) -> None:
        """Each saved block into every tier (the disk's writer thread writes it later)."""
        for save, payload in zip(saves, payloads, strict=True):
            if self.host is not None and save.key not in self.host:
                self.host.put(save.key, payload)
                self.stats.saved(self.host.name, payload.nbytes)
            if self.disk is not None:
                self.disk.put(save.key, payload)
        self._count_host_usage()

    def on_loaded(self, job: LoadJob, payloads: list[np.ndarray]) -> None:
        """Blocks read from disk are kept in host memory too: the next hit is a copy."""
        if self.host is None:
            return
        for key, tier, payload in zip(job.keys, job.tiers, payloads):
            if tier == self.disk.name:
                self.host.put(key, payload)
        self._count_host_usage()

    def shutdown(self) -> None:
        super().shutdown()
        if self.disk is not None:
            self.disk.close()

    # ---- internals -----------------------------------------------------------------------------

    def _read(self, found: list[tuple[bytes, np.ndarray | None]]) -> list[np.ndarray]:
        """A loader thread's fetch: host-memory blocks as they are, disk blocks read and
        checked, up to the first that is gone or refused (counted by its reason)."""
        payloads = []
        for key, payload in found:
            if payload is None:
                try:
                    payload = self.disk.read(key)
                except FileNotFoundError:
                    break
                except BlockRecordError as e:
                    self.stats.rejected(e.kind)
                    break
            payloads.append(payload)
        return payloads

    def _count_host_usage(self) -> None:
        if self.host is not None:
            self.stats.usage(self.host.name, len(self.host), self.host.used_bytes)


def _offloadable(request: Request) -> bool:
    """Whether the request's blocks are saved and looked up: not under an adapter (ids are
    not stable across restarts) nor a cache salt (never hit again)."""
    return not request.lora_int_id and request.cache_salt is None
