"""The iteration-level scheduler.

Every step: running requests first get their next token (or next prefill chunk), then waiting
requests are admitted while the token budget, the sequence cap and the KV cache allow. When a
running request cannot get a block, the newest running request is preempted: its blocks are
freed and it goes back to the front of the waiting queue, to be recomputed (mostly from the
prefix cache) when it returns.

The scheduler decides; it does not compute. It never imports torch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedserve.blockmgr import KVCacheManager
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    """One request's share of a step: ``num_new_tokens`` tokens from ``num_computed_tokens`` on."""

    request: Request
    num_computed_tokens: int
    num_new_tokens: int
    block_table: list[int]

    @property
    def needs_sample(self) -> bool:
        """True when this chunk reaches the last known token, whose logits give the next one."""
        return self.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0
    num_scheduled_tokens: int = 0


class Scheduler:
    """Continuous batching under one token budget, with chunked prefill and preemption."""

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()

    # ---- queue -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish (or abort) requests wherever they are; their blocks are freed at once."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request in self.running:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            finished.append(request)
        return finished

    # ---- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(output, budget)
        if not output.preempted:
            self._schedule_waiting(output, budget)
        output.blocks_to_copy = self.kv.take_blocks_to_copy()
        self.stats.num_running = len(self.running)
        self.stats.num_waiting = len(self.waiting)
        self.stats.num_scheduled_tokens = output.num_scheduled_tokens
        return output

    def update(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance computed counts, append sampled tokens, and finish requests that stop.

        ``sampled`` maps request id -> next token for the requests whose chunk reached their
        last known token. Returns the requests that got a new token (finished ones included).
        """
        updated = []
        for item in output.scheduled:
            request = item.request
            if request.is_finished:
                continue
            request.num_computed_tokens += item.num_new_tokens
            token = sampled.get(request.request_id)
            if token is None:
                continue
            request.append_output_token(token)
            updated.append(request)
            stop = request.check_stop()
            if stop is not None:
                self.running.remove(request)
                self._finish(request, stop)
        return updated

    # ---- internals -----------------------------------------------------------------------

    def _chunk(self, request: Request, budget: int) -> int:
        num_new = request.num_tokens - request.num_computed_tokens
        threshold = self.config.long_prefill_token_threshold
        if threshold and num_new > 1:
            num_new = min(num_new, threshold)
        return min(num_new, budget)

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = self._chunk(request, budget)
            if num_new <= 0:
                index += 1
                continue
            while not self.kv.allocate_slots(
                request.request_id,
                request.all_token_ids,
                request.num_computed_tokens,
                num_new,
                cache_salt=request.cache_salt,
            ):
                victim = self.running.pop()
                self._preempt(victim)
                output.preempted.append(victim)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue  # the request preempted itself; nothing after it is left running
            output.scheduled.append(
                ScheduledRequest(
                    request,
                    request.num_computed_tokens,
                    num_new,
                    self.kv.get_block_table(request.request_id),
                )
            )
            budget -= num_new
            index += 1
        return budget

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hits, num_cached = self.kv.get_computed_blocks(
                request.all_token_ids, request.cache_salt
            )
            request.num_computed_tokens = num_cached
            num_new = self._chunk(request, budget)
            if not self.config.enable_chunked_prefill and num_new < request.num_tokens - num_cached:
                break
            if not self.kv.allocate_slots(
                request.request_id,
                request.all_token_ids,
                num_cached,
                num_new,
                computed_blocks=hits,
                cache_salt=request.cache_salt,
            ):
                request.num_computed_tokens = 0
                break
            self.waiting.popleft()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            output.scheduled.append(
                ScheduledRequest(
                    request, num_cached, num_new, self.kv.get_block_table(request.request_id)
                )
            )
            budget -= num_new

    def _preempt(self, request: Request) -> None:
        """Free a running request's blocks and put it back at the head of the queue."""
        self.kv.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request.request_id)
        del self.requests[request.request_id]
