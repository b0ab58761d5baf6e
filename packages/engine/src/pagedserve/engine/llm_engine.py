"""LLMEngine: the step loop that ties scheduler, model runner, sampler and detokenizer together.

``add_request`` validates and queues; ``step`` runs one iteration: schedule, forward, sample,
update (append tokens, stop, free), detokenize, and returns a RequestOutput for every request
that advanced. Offline ``LLM`` and online ``AsyncLLM`` both drive this loop.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from pagedserve.blockmgr import KVCacheManager
from pagedserve.engine.config import EngineArgs
from pagedserve.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from pagedserve.engine.metrics import EngineStats, StatsCollector, finished_request_stats
from pagedserve.engine.model_runner import ModelRunner
from pagedserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedserve.engine.sampler import Sampler
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.models import load_tokenizer
from pagedserve.scheduler import Request, RequestStatus, Scheduler


class EngineError(RuntimeError):
    """The engine cannot go on (the step loop died); every pending request fails with it."""


@dataclass
class RequestState:
    """What the engine keeps per request beyond the scheduler's view (``Request.payload``)."""

    params: SamplingParams
    prompt: str | None
    generator: torch.Generator
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    text_checked: int = 0  # characters of text already searched for stop strings
    stop_string_hit: str | None = None
    new_text: list[str] = field(default_factory=list)


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.model_config, self.cache_config, self.scheduler_config = args.create_configs()
        self.tokenizer = load_tokenizer(args.tokenizer or args.model)
        if args.tensor_parallel_size == 1:
            self.runner = ModelRunner(self.model_config, self.cache_config)
        else:  # rank 0 of a tensor-parallel group; same interface (lazy: it imports EngineError)
            from pagedserve.engine.distributed import TensorParallelExecutor

            self.runner = TensorParallelExecutor(
                self.model_config, self.cache_config, args.tensor_parallel_size
            )
        self.kv_cache_manager = KVCacheManager(
            self.runner.num_blocks,
            self.cache_config.block_size,
            self.cache_config.enable_prefix_caching,
            self.cache_config.watermark,
        )
        self.scheduler = Scheduler(self.scheduler_config, self.kv_cache_manager)
        self.sampler = Sampler()
        self.eos_token_ids = self._eos_token_ids()
        self._seed_source = torch.Generator().manual_seed(args.seed)
        self._ids = itertools.count()
        self.stats = StatsCollector()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args)

    def _eos_token_ids(self) -> set[int]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    # ---- requests ------------------------------------------------------------------------

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        """Validate a request against the model and queue it."""
        if params.n != 1 or params.use_beam_search:
            raise ValueError("n > 1 and beam search are not supported yet")
        max_len = self.scheduler_config.max_model_len
        if not prompt_token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(prompt_token_ids) >= max_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens; max_model_len is {max_len}"
            )
        max_tokens = (
            params.max_tokens if params.max_tokens is not None else max_len - len(prompt_token_ids)
        )
        if len(prompt_token_ids) + max_tokens > max_len:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({max_tokens}) exceeds max_model_len ({max_len})"
            )
        seed = (
            params.seed
            if params.seed is not None
            else int(torch.randint(2**62, (1,), generator=self._seed_source))
        )
        now = arrival_time if arrival_time is not None else time.monotonic()
        state = RequestState(
            params=params,
            prompt=prompt,
            generator=torch.Generator(device=self.runner.device).manual_seed(seed),
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, params.skip_special_tokens
            ),
            metrics=RequestMetrics(arrival_time=now),
        )
        stop_ids = set(params.stop_token_ids or [])
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            max_tokens=max_tokens,
            min_tokens=params.min_tokens,
            stop_token_ids=frozenset(stop_ids),
            priority=priority,
            arrival_time=now,
            payload=state,
        )
        self.scheduler.add_request(request)

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Abort requests wherever they are (blocks freed at once); unknown ids are ignored.

        Returns the final output (finish_reason "abort") of each request that was still live.
        """
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        aborted = self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        now = time.monotonic()
        outputs = []
        for request in aborted:
            request.payload.metrics.finished_time = now
            self._record_finished(request)
            outputs.append(self.make_output(request))
        if aborted:
            self._record_step([])  # the gauges (running, waiting, KV usage) changed
        return outputs

    def get_stats(self, drain: bool = True) -> EngineStats:
        """Gauges, counters and finished-request latencies; safe to call from any thread."""
        return self.stats.snapshot(drain)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- one step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            return []
        now = time.monotonic()
        for item in scheduled.scheduled:
            metrics = item.request.payload.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
        logits, request_ids = self.runner.execute(scheduled)
        sampled = self._sample(logits, request_ids)
        updated = self.scheduler.update(scheduled, sampled)
        outputs = [self._process_new_token(request) for request in updated]
        self._record_step(updated)
        return outputs

    def _record_step(self, updated: list[Request]) -> None:
        kv = self.kv_cache_manager
        self.stats.record_step(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=kv.usage(),
            prefix_cache_queries=kv.prefix_cache_stats.queries,
            prefix_cache_hits=kv.prefix_cache_stats.hits,
            num_preemptions=self.scheduler.stats.num_preemptions,
            new_prompt_tokens=sum(r.num_prompt_tokens for r in updated if r.num_output_tokens == 1),
            new_generation_tokens=len(updated),
        )

    def _record_finished(self, request: Request) -> None:
        self.stats.record_finished(
            finished_request_stats(
                request.request_id,
                request.status.finish_reason,
                request.num_prompt_tokens,
                request.num_output_tokens,
                request.payload.metrics,
            )
        )

    def _sample(self, logits: torch.Tensor, request_ids: list[str]) -> dict[str, int]:
        if not request_ids:
            return {}
        states = [self.scheduler.requests[r].payload for r in request_ids]
        tokens = self.sampler(logits, [s.params for s in states], [s.generator for s in states])
        return dict(zip(request_ids, tokens.tolist(), strict=True))

    def _process_new_token(self, request: Request) -> RequestOutput:
        state: RequestState = request.payload
        now = time.monotonic()
        if state.metrics.first_token_time is None:
            state.metrics.first_token_time = now
        state.metrics.last_token_time = now
        token = request.output_token_ids[-1]
        hidden_stop = (
            request.status is RequestStatus.FINISHED_STOPPED and request.stop_reason == token
        )
        if not hidden_stop:
            state.detokenizer.add_token(token)
        if request.is_finished:
            state.detokenizer.flush()
        self._check_stop_strings(request, state)
        if request.is_finished:
            state.metrics.finished_time = now
            self._record_finished(request)
        return self.make_output(request)

    def _check_stop_strings(self, request: Request, state: RequestState) -> None:
        stops = state.params.stop_strings
        text = state.detokenizer.text
        if not stops or state.stop_string_hit is not None:
            return
        hit = find_stop_string(text, len(text) - state.text_checked, stops)
        state.text_checked = len(text)
        if hit is None:
            return
        stop, index = hit
        end = index + len(stop) if state.params.include_stop_str_in_output else index
        state.detokenizer.text = text[:end]
        state.stop_string_hit = stop
        request.stop_reason = stop
        if not request.is_finished:
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
        request.status = RequestStatus.FINISHED_STOPPED

    def make_output(self, request: Request) -> RequestOutput:
        """A snapshot of a request: its whole text so far (``LLM``) — AsyncLLM derives deltas."""
        state: RequestState = request.payload
        completion = CompletionOutput(
            index=0,
            text=state.detokenizer.text,
            token_ids=list(request.output_token_ids),
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=state.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=request.is_finished,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            metrics=state.metrics,
        )
