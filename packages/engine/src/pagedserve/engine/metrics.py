"""Engine metrics in one place: gauges, cumulative counters, and finished-request latencies.

The engine thread records into a ``StatsCollector`` after every step; the server (another thread)
reads a consistent ``EngineStats`` snapshot from it for /metrics. Counters are cumulative since
the engine started (Prometheus counters); the finished-request latencies are handed over once:
``snapshot(drain=True)`` returns those recorded since the previous drain, so an exporter can
feed them into histograms without counting any twice.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace

from pagedserve.engine.kv_connector.stats import KVConnectorStats
from pagedserve.engine.outputs import RequestMetrics

MAX_PENDING_SAMPLES = 1 << 16  # per-step samples kept between two drains


@dataclass(frozen=True)
class FinishedRequestStats:
    """Latencies (seconds) of one finished request; None where the request never got there."""

    request_id: str
    finish_reason: str | None
    num_prompt_tokens: int
    num_generation_tokens: int
    queue_time: float | None
    time_to_first_token: float | None
    time_per_output_token: float | None
    e2e_latency: float | None
    prefill_time: float | None = None  # first scheduled -> first token
    decode_time: float | None = None  # first token -> last token
    inference_time: float | None = None  # first scheduled -> last token


@dataclass
class EngineStats:
    """A snapshot for /metrics. Gauges are as of the last step; counters are cumulative."""

    num_running: int = 0
    num_waiting: int = 0
    # of those waiting, the ones held back by a passing condition rather than by the cache's or
    # the batch's capacity (a grammar still compiling, an adapter without a slot): vLLM's
    # "deferred" reason of num_requests_waiting_by_reason, the rest being its "capacity"
    num_waiting_deferred: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # images the vision encoder ran on, and images found already encoded (encoder cache)
    encoder_cache_encoded: int = 0
    encoder_cache_hits: int = 0
    num_preemptions: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_requests_finished: int = 0
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    # per-step samples since the last drain, for histograms: tokens computed by each step, and
    # the intervals between a request's consecutive tokens
    iteration_tokens: list[int] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)

    # speculative decoding (vLLM's names): verify steps' sequences, proposals, accepted ones
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_emitted_tokens: int = 0
    spec_decode_accepted_per_position: list[int] = field(default_factory=list)

    # LoRA (vLLM's lora_requests_info): adapter names of the running and the waiting requests
    max_lora: int = 0
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()

    # a KV connector's counters (hits per tier, bytes moved, load time); None without one
    kv_connector: KVConnectorStats | None = None

    @property
    def spec_decode_acceptance_rate(self) -> float:
        """Accepted proposals / proposals verified (0 before any)."""
        proposed = self.spec_decode_num_draft_tokens
        return self.spec_decode_num_accepted_tokens / proposed if proposed else 0.0

    @property
    def spec_decode_mean_acceptance_length(self) -> float:
        """Tokens a verify step emits per sequence on average: accepted proposals + 1."""
        drafts = self.spec_decode_num_drafts
        return self.spec_decode_num_emitted_tokens / drafts if drafts else 0.0


def finished_request_stats(
    request_id: str,
    finish_reason: str | None,
    num_prompt_tokens: int,
    num_generation_tokens: int,
    metrics: RequestMetrics,
) -> FinishedRequestStats:
    """Derive a finished request's latencies from its timestamps."""
    tpot = None
    if (
        metrics.first_token_time is not None
        and metrics.last_token_time is not None
        and num_generation_tokens > 1
    ):
        tpot = (metrics.last_token_time - metrics.first_token_time) / (num_generation_tokens - 1)
    e2e = None if metrics.finished_time is None else metrics.finished_time - metrics.arrival_time
    scheduled, first, last = (
        metrics.first_scheduled_time,
        metrics.first_token_time,
        metrics.last_token_time,
    )
    return FinishedRequestStats(
        request_id=request_id,
        finish_reason=finish_reason,
        num_prompt_tokens=num_prompt_tokens,
        num_generation_tokens=num_generation_tokens,
        queue_time=metrics.time_in_queue,
        time_to_first_token=metrics.time_to_first_token,
        time_per_output_token=tpot,
        e2e_latency=e2e,
        prefill_time=None if scheduled is None or first is None else first - scheduled,
        decode_time=None if first is None or last is None else last - first,
        inference_time=None if scheduled is None or last is None else last - scheduled,
    )


class StatsCollector:
    """Thread-safe accumulator: the engine thread writes, any thread takes snapshots."""

    def __init__(self, kv_connector=None) -> None:
        self._lock = threading.Lock()
        self._stats = EngineStats()
        self._kv_connector = kv_connector  # its counters are read at each snapshot

    def record_step(
        self,
        scheduler_stats,
        kv_cache_manager,
        tokens,
        num_waiting_deferred: int = 0,
        is_step: bool = False,
    ) -> None:
        """The gauges and cumulative totals as the scheduler (``SchedulerStats``) and the block
        manager report them, and a step's tokens (``StepTokens``). A step's sample for the
        per-step histogram is, as vLLM counts it, the prompt tokens of the requests that got
        their first token in it plus the tokens generated in it (0 included); not ``is_step``:
        no step ran, only the gauges changed. ``num_waiting_deferred``: of the waiting
        requests, those held for their grammar."""
        kv, new_tokens = kv_cache_manager, tokens.num_prompt_tokens + tokens.num_generation_tokens
        with self._lock:
            s = self._stats
            s.num_running, s.num_waiting = scheduler_stats.num_running, scheduler_stats.num_waiting
            s.num_waiting_deferred, s.kv_cache_usage = num_waiting_deferred, kv.usage()
            s.prefix_cache_queries = kv.prefix_cache_stats.queries
            s.prefix_cache_hits = kv.prefix_cache_stats.hits
            s.num_preemptions = scheduler_stats.num_preemptions
            s.encoder_cache_encoded = scheduler_stats.encoder_cache_encoded
            s.encoder_cache_hits = scheduler_stats.encoder_cache_hits
            s.prompt_tokens_total += tokens.num_prompt_tokens
            s.generation_tokens_total += tokens.num_generation_tokens
            # bounded: with nobody draining (offline use), samples must not pile up forever
            if is_step and len(s.iteration_tokens) < MAX_PENDING_SAMPLES:
                s.iteration_tokens.append(new_tokens)
            latencies = tokens.inter_token_latencies
            if latencies and len(s.inter_token_latencies) < MAX_PENDING_SAMPLES:
                s.inter_token_latencies.extend(latencies)

    def record_spec_decode(self, counts) -> None:
        """One verify step's ``VerifyCounts`` (spec_decode/verify.py) into the totals."""
        with self._lock:
            s = self._stats
            s.spec_decode_num_drafts += counts.num_drafts
            s.spec_decode_num_draft_tokens += counts.num_draft_tokens
            s.spec_decode_num_accepted_tokens += counts.num_accepted_tokens
            s.spec_decode_num_emitted_tokens += counts.num_accepted_tokens + counts.num_drafts
            per_position = s.spec_decode_accepted_per_position
            for j, n in enumerate(counts.accepted_per_position):
                if j == len(per_position):
                    per_position.append(0)
                per_position[j] += n

    def record_lora(self, max_lora: int, running: tuple[str, ...], waiting: tuple[str, ...]):
        with self._lock:
            s = self._stats
            s.max_lora, s.running_lora_adapters, s.waiting_lora_adapters = (
                max_lora,
                running,
                waiting,
            )

    def record_finished(self, finished: FinishedRequestStats) -> None:
        with self._lock:
            self._stats.num_requests_finished += 1
            self._stats.finished_requests.append(finished)

    def snapshot(self, drain: bool = True) -> EngineStats:
        """A copy of the current stats; with ``drain`` the finished-request list starts over."""
        with self._lock:
            s = self._stats
            snap = replace(
                s,
                finished_requests=list(s.finished_requests),
                iteration_tokens=list(s.iteration_tokens),
                inter_token_latencies=list(s.inter_token_latencies),
                spec_decode_accepted_per_position=list(s.spec_decode_accepted_per_position),
            )
            if self._kv_connector is not None:
                snap.kv_connector = self._kv_connector.snapshot_stats()
            if drain:
                s.finished_requests.clear()
                s.iteration_tokens.clear()
                s.inter_token_latencies.clear()
            return snap
