"""LLMEngine: the step loop that ties scheduler, model runner, sampler and detokenizer together.

``add_request`` validates and queues; ``step`` runs one iteration: schedule, forward, decide the
next tokens (sampling, n > 1 forks, beam steps), update (append tokens, stop, free), detokenize,
and returns a cumulative RequestOutput for every request that advanced. Offline ``LLM`` and
online ``AsyncLLM`` both drive this loop.

The scheduler sees sequences; the engine groups them into requests (sequence_group.py): a request
with ``n > 1`` forks into n sequences after its prompt is read, and a beam-search request keeps
its live beams as sequences that fork and drop each step (beam_search.py).
"""

from __future__ import annotations

import itertools
import secrets
import time
from dataclasses import dataclass, field

import torch

from pagedserve.blockmgr import KVCacheManager
from pagedserve.engine.beam_search import BeamDecisions, BeamSearchGroup
from pagedserve.engine.config import EngineArgs
from pagedserve.engine.detokenizer import find_stop_string
from pagedserve.engine.metrics import EngineStats, StatsCollector, finished_request_stats
from pagedserve.engine.model_runner import ModelRunner
from pagedserve.engine.outputs import RequestMetrics, RequestOutput
from pagedserve.engine.prompt_logprobs import record_prompt_logprobs
from pagedserve.engine.sampler import Sampler, SamplingMetadata, select_rows
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.sequence_group import SequenceGroup, SequenceState
from pagedserve.models import load_tokenizer
from pagedserve.scheduler import (
    Request,
    RequestRejectedError,
    RequestStatus,
    Scheduler,
    SchedulerOverloadedError,
)


class EngineError(RuntimeError):
    """The engine cannot go on (the step loop died); every pending request fails with it."""


@dataclass
class StepDecisions:
    """Everything one step decided before ``scheduler.update`` applies the sampled tokens."""

    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, dict[int, float]] = field(default_factory=dict)
    new_children: list[tuple[SequenceState, int, dict[int, float] | None]] = field(
        default_factory=list
    )
    beams: BeamDecisions = field(default_factory=BeamDecisions)


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.model_config, self.cache_config, self.scheduler_config = args.create_configs()
        self.tokenizer = load_tokenizer(args.tokenizer or args.model)
        if args.tensor_parallel_size == 1:
            self.runner = ModelRunner(
                self.model_config, self.cache_config, graph_config=args.cuda_graph_config()
            )
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
        self.groups: dict[str, SequenceGroup] = {}
        self.stats = StatsCollector()
        self._step_prompt_tokens = 0

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
        """Validate a request against the model and queue it (its first sequence)."""
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        max_len = self.scheduler_config.max_model_len
        if not prompt_token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        for name, ids in (
            ("logit_bias", params.logit_bias or {}),
            ("stop_token_ids", params.stop_token_ids),
        ):
            if any(t >= vocab for t in ids):
                raise ValueError(f"{name} token ids must be in [0, {vocab})")
        if len(prompt_token_ids) >= max_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens; max_model_len is {max_len}"
            )
        max_tokens = (
            params.max_tokens if params.max_tokens is not None else max_len - len(prompt_token_ids)
        )
        now = arrival_time if arrival_time is not None else time.monotonic()
        group = self._new_group(request_id, list(prompt_token_ids), params, prompt, now, max_tokens)
        state = group.new_state(0, self.tokenizer, self.runner.device)
        stop_ids = set(params.stop_token_ids or [])
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            max_tokens=max_tokens,
            min_tokens=params.min_tokens,
            stop_token_ids=frozenset() if params.use_beam_search else frozenset(stop_ids),
            priority=priority,
            arrival_time=now,
            # prompt logprobs need every prompt position computed: a salt of its own keeps the
            # prefix cache from serving this prompt's blocks
            cache_salt=secrets.token_hex(8) if params.prompt_logprobs is not None else None,
            payload=state,
        )
        self.scheduler.add_request(request)
        group.sequences.append(request)
        self.groups[request_id] = group

    def _new_group(self, request_id, prompt_ids, params, prompt, now, max_tokens) -> SequenceGroup:
        seed = (
            params.seed
            if params.seed is not None
            else int(torch.randint(2**62, (1,), generator=self._seed_source))
        )
        common = dict(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_ids,
            params=params,
            metrics=RequestMetrics(arrival_time=now),
            seed=seed,
        )
        if not params.use_beam_search:
            return SequenceGroup(**common)
        return BeamSearchGroup(
            **common,
            beam_width=params.best_of or params.n,
            eos_token_ids=frozenset(params.stop_token_ids or ())
            | (frozenset() if params.ignore_eos else frozenset(self.eos_token_ids)),
            max_tokens=max_tokens,
            tokenizer=self.tokenizer,
        )

    def shutdown(self) -> None:
        """Release what outlives the engine object: tensor-parallel worker processes."""
        stop_workers = getattr(self.runner, "shutdown", None)
        if stop_workers is not None:
            stop_workers()

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Abort requests wherever they are (blocks freed at once); unknown ids are ignored.

        Returns the final output (finish_reason "abort") of each request that was still live.
        """
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outputs = []
        for request_id in ids:
            group = self.groups.get(request_id)
            if group is None:
                continue
            live = [s.request_id for s in group.sequences if not s.is_finished]
            self.scheduler.finish_requests(live, RequestStatus.FINISHED_ABORTED)
            group.aborted = True
            outputs.append(self._group_output(group, time.monotonic()))
        if outputs:
            self._record_step(0)  # the gauges (running, waiting, KV usage) changed
        return outputs

    def unfinished_request_ids(self) -> list[str]:
        return list(self.groups)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups) or self.scheduler.has_unfinished_requests()

    def get_stats(self, drain: bool = True) -> EngineStats:
        """Gauges, counters and finished-request latencies; safe to call from any thread."""
        return self.stats.snapshot(drain)

    # ---- one step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            return []
        now = time.monotonic()
        for item in scheduled.scheduled:
            metrics = item.request.payload.group.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
        logits, seq_ids = self.runner.execute(scheduled)
        if len(logits) > len(seq_ids):
            record_prompt_logprobs(scheduled, logits[len(seq_ids) :])
        decisions = self._decide(logits, seq_ids)
        updated = self.scheduler.update(scheduled, decisions.sampled)
        for beam in decisions.beams.waiting:
            beam.num_computed_tokens -= 1  # recompute its last token when its siblings catch up
        touched: dict[str, SequenceGroup] = {}
        num_tokens = 0
        for request in updated:
            group = request.payload.group
            touched[group.request_id] = group
            num_tokens += 1
            if not isinstance(group, BeamSearchGroup):
                self._process_new_token(request, decisions.logprobs.get(request.request_id))
        for state, token, logprobs in decisions.new_children:
            self._start_child(state, token, logprobs)
            num_tokens += 1
        for group in decisions.beams.apply(self.scheduler, self.tokenizer, self.runner.device):
            touched[group.request_id] = group
            self._touch_metrics(group, time.monotonic())
        now = time.monotonic()
        outputs = [self._group_output(group, now) for group in touched.values()]
        self._record_step(num_tokens)
        return outputs

    def _decide(self, logits: torch.Tensor, seq_ids: list[str]) -> StepDecisions:
        """Sampled tokens (and forks) for sampling requests; beam steps for beam groups."""
        decisions = StepDecisions()
        rows: list[int] = []
        row_states: list[tuple[Request | None, SequenceState]] = []
        beam_rows: dict[str, list[tuple[Request, int]]] = {}
        for row, seq_id in enumerate(seq_ids):
            request = self.scheduler.requests[seq_id]
            state: SequenceState = request.payload
            group = state.group
            if isinstance(group, BeamSearchGroup):
                beam_rows.setdefault(group.request_id, []).append((request, row))
                continue
            rows.append(row)
            row_states.append((request, state))
            if group.needs_fork:
                group.forked = True
                for index in range(1, group.params.n):
                    rows.append(row)
                    row_states.append((None, group.new_state(index, self.tokenizer, logits.device)))
        if rows:
            self._sample(select_rows(logits, rows), row_states, decisions)
        for group_id, beams in beam_rows.items():
            decisions.beams.step_group(self.groups[group_id], beams, logits, decisions.sampled)
        return decisions

    def _sample(self, logits, row_states, decisions: StepDecisions) -> None:
        meta = SamplingMetadata(
            params=[s.params for _, s in row_states],
            generators=[s.generator for _, s in row_states],
            prompt_token_ids=[s.group.prompt_token_ids for _, s in row_states],
            output_token_ids=[r.output_token_ids if r else [] for r, _ in row_states],
            masked_token_ids=[
                self._masked_tokens(r or s.group.sequences[0]) for r, s in row_states
            ],
        )
        out = self.sampler(logits, meta)
        tokens = out.token_ids.tolist()
        for row, ((request, state), token) in enumerate(zip(row_states, tokens, strict=True)):
            logprobs = None
            if state.params.logprobs is not None:
                logprobs = out.row_logprobs(row, state.params.logprobs)
            if request is None:
                decisions.new_children.append((state, token, logprobs))
                continue
            decisions.sampled[request.request_id] = token
            if logprobs is not None:
                decisions.logprobs[request.request_id] = logprobs

    @staticmethod
    def _masked_tokens(request: Request) -> frozenset[int]:
        """Stop tokens may not be sampled before ``min_tokens`` tokens are out (vLLM's rule)."""
        if request.num_output_tokens < request.min_tokens:
            return request.stop_token_ids
        return frozenset()

    # ---- n > 1 and beams -----------------------------------------------------------------

    def _start_child(self, state: SequenceState, token: int, logprobs) -> None:
        """Sequence ``state.index`` of an n > 1 request: it forks the parent's blocks."""
        group = state.group
        parent = group.sequences[0]
        child = Request(
            request_id=group.child_request_id(state.index),
            prompt_token_ids=list(group.prompt_token_ids),
            max_tokens=parent.max_tokens,
            min_tokens=parent.min_tokens,
            stop_token_ids=parent.stop_token_ids,
            priority=parent.priority,
            arrival_time=parent.arrival_time,
            payload=state,
        )
        child.append_output_token(token)
        group.sequences.append(child)
        stop = child.check_stop()
        if stop is not None:
            child.status = stop  # done at its first token: it never needs a block
        elif parent.status is RequestStatus.RUNNING:
            self.scheduler.add_forked_request(parent.request_id, child)
        else:
            # The parent ended at its first token and freed its blocks; the child is queued
            # afresh and finds the prompt's blocks in the prefix cache.
            try:
                self.scheduler.add_request(child)
            except (RequestRejectedError, SchedulerOverloadedError):
                child.status = RequestStatus.FINISHED_ABORTED  # the queue is full right now
        self._process_new_token(child, logprobs)

    # ---- per token -----------------------------------------------------------------------

    def _touch_metrics(self, group: SequenceGroup, now: float) -> None:
        if group.metrics.first_token_time is None:
            group.metrics.first_token_time = now
            self._step_prompt_tokens += len(group.prompt_token_ids)
        group.metrics.last_token_time = now

    def _process_new_token(self, request: Request, logprobs: dict[int, float] | None) -> None:
        state: SequenceState = request.payload
        self._touch_metrics(state.group, time.monotonic())
        token = request.output_token_ids[-1]
        if logprobs is not None:
            state.record_logprobs(logprobs, token)
        hidden_stop = (
            request.status is RequestStatus.FINISHED_STOPPED and request.stop_reason == token
        )
        if not hidden_stop:
            state.detokenizer.add_token(token)
        if request.is_finished:
            state.detokenizer.flush()
        self._check_stop_strings(request, state)

    def _check_stop_strings(self, request: Request, state: SequenceState) -> None:
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

    # ---- outputs and metrics -------------------------------------------------------------

    def _group_output(self, group: SequenceGroup, now: float) -> RequestOutput:
        output = group.make_output()
        if group.is_finished and self.groups.pop(group.request_id, None) is not None:
            group.metrics.finished_time = now
            self.stats.record_finished(
                finished_request_stats(
                    group.request_id,
                    "abort" if group.aborted else output.outputs[0].finish_reason,
                    len(group.prompt_token_ids),
                    sum(len(o.token_ids) for o in output.outputs),
                    group.metrics,
                )
            )
        return output

    def _record_step(self, num_new_tokens: int) -> None:
        kv = self.kv_cache_manager
        stats = self.scheduler.stats
        self.stats.record_step(
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            kv_cache_usage=kv.usage(),
            prefix_cache_queries=kv.prefix_cache_stats.queries,
            prefix_cache_hits=kv.prefix_cache_stats.hits,
            num_preemptions=stats.num_preemptions,
            new_prompt_tokens=self._step_prompt_tokens,
            new_generation_tokens=num_new_tokens,
        )
        self._step_prompt_tokens = 0
