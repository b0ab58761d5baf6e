"""What every KV connector shares: the step's work, loads (now or later) and saves.

A connector has two sides, as in vLLM V1, in one object here (the scheduler and the model
runner live in one process; tensor parallelism is refused with a connector):

- the scheduler's side (``pagedserve.scheduler.KVConnectorScheduler``): a subclass answers
  ``get_num_new_matched_tokens`` and ``update_state_after_alloc`` by planning a ``LoadJob``
  (``plan_load``), and says which newly computed blocks to save (``blocks_to_save``);
  ``build_connector_meta`` hands the step's loads and saves to the runner.
- the runner's side: ``start_load_kv`` before the forward (a synchronous load's bytes go into
  its blocks now; an asynchronous one's fetch starts in a loader thread), ``wait_for_save``
  after it (the saved blocks' bytes are gathered and handed to ``store``), and ``get_finished``
  at the start of each step (the fetches that ended are written into their blocks, on the
  engine thread, and reported: request id -> tokens its blocks now hold).

Only the engine thread touches the KV cache. A fetch (a disk read, a network transfer) brings
bytes into host memory; they reach the request's blocks at the next ``get_finished``, and only
if the request is still there: one that finished meanwhile (an abort) had its job cancelled
and its blocks freed, and they may hold another request's keys by then.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.kv_connector.block_io import KVBlockIO
from pagedserve.engine.kv_connector.stats import KVConnectorStats, StatsRecorder
from pagedserve.scheduler import Request, SchedulerOutput

logger = logging.getLogger("pagedserve.engine")

FINISHED_WAIT_SECONDS = 0.05  # an idle step waits this long for a fetch to end, not spin
LOADER_THREADS = 2
TIERS_SLOWEST_FIRST = ("remote", "disk", "ram")


@dataclass
class LoadJob:
    """Blocks to load into ``block_ids``, in order, for request ``request_id``.

    ``tiers[i]``: where block i comes from (``ram``, ``disk``, ``remote``). A synchronous job
    has its ``payloads`` now; an asynchronous one has a ``fetch`` that runs in a loader thread
    and returns the leading blocks it got intact (fewer than asked: the rest failed).
    ``num_computed_before``: the tokens the request's blocks held before (the prefix cache's
    hit), so a finished job reports ``num_computed_before + blocks loaded * block_size``.
    ``keys``: the blocks' names where they come from.
    """

    request_id: str
    block_ids: list[int]
    tiers: list[str]
    num_computed_before: int
    keys: list[bytes] = field(default_factory=list)
    payloads: list[np.ndarray] | None = None
    fetch: Callable[[], list[np.ndarray]] | None = None
    started: float = 0.0
    cancelled: bool = False


@dataclass
class BlockSave:
    """A block computed in this step, to save under ``key`` once the forward has run."""

    request_id: str
    block_id: int
    key: bytes


@dataclass
class KVConnectorMetadata:
    """One step's work for the runner's side: loads before the forward, saves after it."""

    loads: list[LoadJob] = field(default_factory=list)
    async_loads: list[LoadJob] = field(default_factory=list)
    saves: list[BlockSave] = field(default_factory=list)


class KVConnectorBase:
    """The shared machinery; subclasses decide what to load and save, and where."""

    def __init__(self, block_size: int, stats: StatsRecorder | None = None) -> None:
        self.block_size = block_size
        self.stats = stats or StatsRecorder()
        self.hash_root: bytes | None = None  # the prefix hash chain's root the store needs
        self.kv = None  # the KVCacheManager (bind_kv_cache_manager)
        self.block_io: KVBlockIO | None = None
        self._step = KVConnectorMetadata()
        self._inflight: dict[str, tuple[LoadJob, concurrent.futures.Future]] = {}
        self._loader = concurrent.futures.ThreadPoolExecutor(
            LOADER_THREADS, thread_name_prefix="kv-load"
        )

    # ---- set-up ------------------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        """The block manager whose hashes name this connector's blocks."""
        self.kv = kv_cache_manager

    def register_kv_caches(self, kv_caches) -> None:
        """The runner's KV cache tensors, which loads write and saves read."""
        self.block_io = KVBlockIO(kv_caches)

    def check_transfer_params(self, params: dict) -> None:
        """A request's ``kv_transfer_params``: refused unless the connector moves blocks
        between engines (``TCPConnector``)."""
        raise InvalidRequestError(
            "kv_transfer_params: this engine's KV connector offloads blocks and transfers none "
            "between engines (--kv-transfer-config does)",
            "kv_transfer_params",
        )

    # ---- the scheduler's side ------------------------------------------------------------------

    def plan_load(self, job: LoadJob) -> None:
        """Queue ``job`` for this step's metadata (synchronous when it has its payloads)."""
        if job.payloads is not None:
            self._step.loads.append(job)
        else:
            self._step.async_loads.append(job)

    def build_connector_meta(self, output: SchedulerOutput) -> KVConnectorMetadata:
        meta, self._step = self._step, KVConnectorMetadata()
        meta.saves = self.blocks_to_save(output)
        return meta

    def blocks_to_save(self, output: SchedulerOutput) -> list[BlockSave]:
        """The blocks this step completes that the connector keeps (subclasses)."""
        return []

    def request_finished(self, request: Request) -> dict | None:
        """Cancel the request's unfinished load; subclasses forget the rest of it."""
        entry = self._inflight.pop(request.request_id, None)
        if entry is not None:
            entry[0].cancelled = True
            entry[1].cancel()
        for job in self._step.async_loads:
            if job.request_id == request.request_id:
                job.cancelled = True
        return None

    # ---- the runner's side ---------------------------------------------------------------------

    def start_step(self, output: SchedulerOutput) -> dict[str, int]:
        """The runner's first call in a step: the loads that ended (``get_finished``; an
        empty step waits a little for one), then this step's loads (``start_load_kv``)."""
        finished = self.get_finished(wait=output.is_empty)
        self.start_load_kv(output.kv_connector_metadata)
        return finished

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        """Before the forward: write the synchronous loads, start the asynchronous ones."""
        for job in meta.loads:
            start = time.perf_counter()
            self.block_io.scatter(job.block_ids, job.payloads)
            self._count_loaded(job, len(job.payloads), time.perf_counter() - start)
        for job in meta.async_loads:
            if not job.cancelled:
                job.started = time.perf_counter()
                self._inflight[job.request_id] = (job, self._loader.submit(self._fetch, job))

    def wait_for_save(self, meta: KVConnectorMetadata) -> None:
        """After the forward: the saved blocks' bytes, handed to ``store``."""
        if meta.saves:
            payloads = self.block_io.gather([save.block_id for save in meta.saves])
            self.store(meta.saves, payloads)

    def store(self, saves: Sequence[BlockSave], payloads: Sequence[np.ndarray]) -> None:
        """Keep the saved blocks (subclasses)."""

    def get_finished(self, wait: bool = False) -> dict[str, int]:
        """The asynchronous loads that ended, written into their blocks: request id -> tokens
        its blocks hold now. ``wait``: the step has nothing to run, so wait a little for one
        to end rather than spin."""
        if not self._inflight:
            return {}
        if wait:
            futures = [future for _, future in self._inflight.values()]
            concurrent.futures.wait(futures, FINISHED_WAIT_SECONDS, "FIRST_COMPLETED")
        finished = {}
        for request_id, (job, future) in list(self._inflight.items()):
            if future.done():
                del self._inflight[request_id]
                finished[request_id] = self._complete(job, future.result())
        return finished

    def has_pending_loads(self) -> bool:
        return bool(self._inflight)

    def on_loaded(self, job: LoadJob, payloads: list[np.ndarray]) -> None:
        """A finished asynchronous load's blocks are in the cache (subclasses may keep them)."""

    def snapshot_stats(self) -> KVConnectorStats:
        return self.stats.snapshot()

    def shutdown(self) -> None:
        self._loader.shutdown(wait=False, cancel_futures=True)

    # ---- internals -----------------------------------------------------------------------------

    def _fetch(self, job: LoadJob) -> list[np.ndarray]:
        """Run a job's fetch in a loader thread; an error ends it with what it got (none)."""
        try:
            return job.fetch()
        except Exception:  # a fetch reports what failed itself; this is a bug's last stop
            logger.exception("KV load for request %s failed", job.request_id)
            return []

    def _complete(self, job: LoadJob, payloads: list[np.ndarray]) -> int:
        """Write a fetched job's blocks (engine thread) and count it."""
        count = len(payloads)
        self.block_io.scatter(job.block_ids[:count], payloads)
        self._count_loaded(job, count, time.perf_counter() - job.started)
        if count:
            self.on_loaded(job, payloads)
        return job.num_computed_before + count * self.block_size

    def _count_loaded(self, job: LoadJob, count: int, seconds: float) -> None:
        """A load's hits and bytes by tier, and its time under its slowest tier."""
        if count < len(job.block_ids):
            self.stats.failed_load()
        loaded = job.tiers[:count]
        for tier in set(loaded):
            blocks = loaded.count(tier)
            self.stats.loaded(tier, blocks * self.block_size, blocks * self.block_io.block_bytes)
        if count:
            self.stats.load_time(next(t for t in TIERS_SLOWEST_FIRST if t in loaded), seconds)
