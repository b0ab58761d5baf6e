"""LLMEngine: the step loop that ties scheduler, model runner, sampler and detokenizer together.

``add_request`` validates and queues; ``step`` runs one iteration: schedule, forward, decide the
next tokens (sampling, n > 1 forks, beam steps), update (append tokens, stop, free), detokenize,
and returns a RequestOutput for every request that advanced (cumulative, a delta, or none until
it finishes, as its ``output_kind`` asks). Offline ``LLM`` and
online ``AsyncLLM`` both drive this loop.

The scheduler sees sequences; the engine groups them into requests (sequence_group.py): a request
with ``n > 1`` forks into n sequences after its prompt is read, and a beam-search request keeps
its live beams as sequences that fork and drop each step (beam_search.py).
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time

import torch

from pagedserve.blockmgr import KVCacheManager
from pagedserve.engine.beam_search import BeamSearchGroup
from pagedserve.engine.config import EngineArgs
from pagedserve.engine.cpu_threads import set_cpu_threads
from pagedserve.engine.decisions import (
    PlainRequests,
    SamplingBatch,
    StepContext,
    StepDecision,
    group_decisions,
    sampled_tokens,
)
from pagedserve.engine.errors import InvalidRequestError, RequestRejectedError
from pagedserve.engine.executor import create_runner
from pagedserve.engine.lora import LoRAManager, LoRARequest
from pagedserve.engine.lora.engine_mixin import LoRAEngineMixin
from pagedserve.engine.metrics import EngineStats, StatsCollector, finished_request_stats
from pagedserve.engine.output_processor import process_plain_step
from pagedserve.engine.outputs import RequestMetrics, RequestOutput
from pagedserve.engine.prompt_logprobs import record_prompt_logprobs
from pagedserve.engine.sampler import Sampler
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.sequence_group import SequenceGroup, SequenceState
from pagedserve.engine.spec_decode.speculator import Speculator
from pagedserve.engine.structured_output.manager import StructuredOutputManager
from pagedserve.engine.structured_output.xgrammar_backend import XgrammarBackend
from pagedserve.engine.validation import check_logprobs, check_token_ids, resolve_max_tokens
from pagedserve.models import load_tokenizer
from pagedserve.scheduler import Request, RequestStatus, Scheduler, SchedulerOutput

logger = logging.getLogger("pagedserve.engine")


class LLMEngine(LoRAEngineMixin):
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.model_config, self.cache_config, self.scheduler_config = args.create_configs()
        set_cpu_threads(args.num_cpu_threads)
        self.tokenizer = load_tokenizer(args.tokenizer or args.model)
        spec_config = args.create_speculative_config()  # checked before the model is loaded
        self.speculator = (
            Speculator(
                spec_config, self.model_config, self.tokenizer, self.cache_config.cache_dtype
            )
            if spec_config is not None
            else None
        )
        block_size = self.cache_config.block_size
        draft_bytes = self.speculator.kv_block_bytes(block_size) if self.speculator else 0
        self.runner = create_runner(args, self.model_config, self.cache_config, draft_bytes)
        if self.speculator is not None:  # a draft model's cache: the same blocks
            self.speculator.allocate_kv_caches(self.runner.num_blocks, block_size)
        self.kv_cache_manager = KVCacheManager(
            self.runner.num_blocks,
            self.cache_config.block_size,
            self.cache_config.enable_prefix_caching,
            self.cache_config.watermark,
            sliding_window=self.model_config.kv_cache_window,
        )
        self.scheduler = Scheduler(self.scheduler_config, self.kv_cache_manager)
        self.lora_manager: LoRAManager | None = getattr(self.runner, "lora_manager", None)
        self.sampler = Sampler()
        self.eos_token_ids = self._eos_token_ids()
        logger.info(
            "stop ids %s; %s",
            sorted(self.eos_token_ids),
            self.model_config.generation_defaults.describe(),
        )
        self._seed_source = torch.Generator().manual_seed(args.seed)
        self._ids = itertools.count()
        self.groups: dict[str, SequenceGroup] = {}
        self.plain_requests = PlainRequests()
        self.output_fast_path = True  # output_processor.py; False: the general path alone
        self._never_scheduled: set[str] = set()  # requests whose first_scheduled_time is unset
        self.stats = StatsCollector()
        self.structured_output = StructuredOutputManager(self._grammar_backend)
        self._request_errors: list[tuple[str, BaseException]] = []

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args)

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config defaults (vLLM's
        ``get_default_sampling_params``): what a request that sets nothing gets."""
        return SamplingParams(**self.model_config.generation_defaults.sampling)

    def _grammar_backend(self) -> XgrammarBackend:
        """Built in the compile pool, with a tokenizer of its own (the engine thread's is busy
        detokenizing)."""
        tokenizer = load_tokenizer(self.args.tokenizer or self.args.model)
        return XgrammarBackend(tokenizer, self.model_config.vocab_size, self.eos_token_ids)

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
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request (its first sequence), or refuse it with ``InvalidRequestError``
        naming the field at fault (validation.py; the scheduler's refusals too). A refused
        request leaves no trace: no group, no seed drawn. ``lora_request`` (None: the base
        model) is registered if it is new, its files read and checked now."""
        if request_id in self.groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        check_token_ids(prompt_token_ids, params, self.model_config.vocab_size)
        if params.use_beam_search and self.speculator is not None:
            raise InvalidRequestError(
                "beam search cannot run with speculative decoding (its beams fork and drop "
                "every step); start an engine without speculative_config for it",
                "use_beam_search",
            )
        check_logprobs(params, self.args.max_logprobs, self.model_config.vocab_size)
        lora_int_id = self._lora_id(lora_request)
        prompt_ids = list(prompt_token_ids)
        max_len = self.scheduler_config.max_model_len
        max_tokens = resolve_max_tokens(len(prompt_ids), params, max_len)
        now = arrival_time if arrival_time is not None else time.monotonic()
        stop_ids = set(params.stop_token_ids or [])
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            max_tokens=max_tokens,
            min_tokens=params.min_tokens,
            stop_token_ids=frozenset() if params.use_beam_search else frozenset(stop_ids),
            priority=priority,
            arrival_time=now,
            # prompt logprobs need every prompt position computed: a salt of its own keeps the
            # prefix cache from serving this prompt's blocks
            cache_salt=secrets.token_hex(8) if params.prompt_logprobs is not None else None,
            needs_prompt_logits=params.prompt_logprobs is not None,
            lora_int_id=lora_int_id,
        )
        try:
            self.scheduler.add_request(request)
        except RequestRejectedError as e:
            raise InvalidRequestError(str(e), e.param) from e
        group = self._new_group(request_id, list(prompt_ids), params, prompt, now, max_tokens)
        request.payload = group.new_state(0, self.tokenizer, self.runner.device)
        group.sequences.append(request)
        self.groups[request_id] = group
        self.plain_requests.register(request_id, request.payload)
        self._never_scheduled.add(request_id)
        if params.structured_outputs is not None:
            self.structured_output.hold(request, params.structured_outputs)

    def take_request_errors(self) -> list[tuple[str, BaseException]]:
        """Requests that failed since the last call, with their error (a constraint that did
        not compile: ``InvalidRequestError``). They have left the engine; the caller answers
        them with the error (AsyncLLM raises it in the request's stream)."""
        errors, self._request_errors = self._request_errors, []
        return errors

    def _release_grammars(self, timeout: float = 0.0) -> None:
        """Give each request whose grammar compiled its matcher (the scheduler may admit it
        now); fail each whose grammar did not, and only it."""
        ready, failed = self.structured_output.release(timeout)
        for request, grammar in ready:
            group = request.payload.group
            group.compiled_grammar = grammar
            request.payload.grammar_matcher = grammar.matcher()
        for request, error in failed:
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_ABORTED)
            self._forget(request.request_id)
            self._request_errors.append((request.request_id, error))

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
        self.structured_output.shutdown()
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
        """One iteration: schedule -> execute -> decide -> update -> outputs."""
        if self.structured_output.num_held:
            self._release_grammars()
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            if self.structured_output.num_held:  # only compiles to wait for: wait, not spin
                self._release_grammars(timeout=0.05)
            return []
        logits, seq_ids = self._execute(scheduled)
        batch, decisions = self._decide(scheduled, logits, seq_ids)
        updated = self.scheduler.update(scheduled, sampled_tokens(batch, decisions))
        outputs = self._apply(batch, decisions, updated, scheduled.num_scheduled_tokens)
        self._release_removed_loras()
        if self.speculator is not None:  # proposals for the next step's decodes
            self.speculator.propose(self.scheduler.running)
        return outputs

    def _execute(self, scheduled: SchedulerOutput) -> tuple[torch.Tensor, list[str]]:
        if self._never_scheduled:  # only then can a scheduled request be new
            self._stamp_first_scheduled(scheduled)
        if self.speculator is not None:  # a draft model proposes once the slots exist
            self.speculator.prepare_step(scheduled)
        return self.runner.execute(scheduled)

    def _stamp_first_scheduled(self, scheduled: SchedulerOutput) -> None:
        now = time.monotonic()
        never = self._never_scheduled
        for item in scheduled.scheduled:
            metrics = item.request.payload.group.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
                never.discard(item.request.payload.group.request_id)

    def _decide(
        self, scheduled: SchedulerOutput, logits: torch.Tensor, seq_ids: list[str]
    ) -> tuple[SamplingBatch, list[StepDecision]]:
        """Each group decides from its rows; every sampling row is drawn in one sampler call,
        every speculative decode's rows are verified in one pass (spec_decode/verify.py).

        A step whose rows are all plain (decisions.py) has no decisions at all: its rows go to
        the batch's plain pass as they are, with no Python per row."""
        verify, proposals = None, {}
        num_spec = scheduled.num_spec_tokens if self.speculator is not None else 0
        if num_spec:
            verify, proposals = self.speculator.verification_batch(scheduled, logits, num_spec)
            logits = logits[: len(logits) - num_spec]
        if len(logits) > len(seq_ids):
            record_prompt_logprobs(scheduled, logits[len(seq_ids) :])
        batch = SamplingBatch(logits, len(seq_ids))
        decisions = []
        if proposals or not self.plain_requests.add_all(batch, seq_ids):
            requests, plain = self.scheduler.requests, self.plain_requests
            decisions = group_decisions(seq_ids, requests, batch, plain, proposals, verify)
        batch.sample(self.sampler)
        if verify is not None:
            self.stats.record_spec_decode(verify.verify())
        return batch, decisions

    def _apply(
        self,
        batch: SamplingBatch,
        decisions: list[StepDecision],
        updated: list[Request],
        num_scheduled_tokens: int = 0,
    ) -> list[RequestOutput]:
        """Apply each decision after the update; one output per group that has news. A step
        with no decisions (every row plain: one sequence per request) is processed in one pass
        (output_processor.py) unless ``output_fast_path`` is off, the general path it is
        tested against."""
        updated_ids = {r.request_id for r in updated} if decisions else set()
        now = time.monotonic()  # every token of the step: one time
        ctx = StepContext(self.scheduler, self.tokenizer, self.runner.device, updated_ids, now=now)
        if not decisions and self.output_fast_path and SequenceState.lean_path_enabled:
            outputs = process_plain_step(updated, ctx, self._group_output)
        else:
            batch.apply_plain(updated, ctx)
            if decisions:
                touched = dict.fromkeys(r.payload.group for r in updated)
                for decision in decisions:
                    if decision.apply(ctx):
                        touched.setdefault(decision.group)
            else:
                touched = [r.payload.group for r in updated]
            outputs = [self._group_output(g, now) for g in touched if g.has_new_output]
        self._record_step(
            ctx.num_generation_tokens,
            ctx.num_prompt_tokens,
            iteration_tokens=num_scheduled_tokens,
            inter_token_latencies=ctx.inter_token_latencies,
        )
        return outputs

    # ---- outputs and metrics -------------------------------------------------------------

    def _group_output(self, group: SequenceGroup, now: float) -> RequestOutput:
        output = group.make_output()
        if output.finished and self._forget(group.request_id) is not None:
            group.metrics.finished_time = now
            self.stats.record_finished(
                finished_request_stats(
                    group.request_id,
                    "abort" if group.aborted else output.outputs[0].finish_reason,
                    len(group.prompt_token_ids),
                    group.num_output_tokens(output),
                    group.metrics,
                )
            )
        return output

    def _forget(self, request_id: str) -> SequenceGroup | None:
        """Drop a request that has left the engine; its group, if it was still known."""
        self.plain_requests.discard(request_id)
        self._never_scheduled.discard(request_id)
        return self.groups.pop(request_id, None)

    def _record_step(
        self, num_new_tokens: int, num_new_prompt_tokens: int = 0, **per_step_samples
    ) -> None:
        kv = self.kv_cache_manager
        stats = self.scheduler.stats
        self.stats.record_step(
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            kv_cache_usage=kv.usage(),
            prefix_cache_queries=kv.prefix_cache_stats.queries,
            prefix_cache_hits=kv.prefix_cache_stats.hits,
            num_preemptions=stats.num_preemptions,
            new_prompt_tokens=num_new_prompt_tokens,
            new_generation_tokens=num_new_tokens,
            **per_step_samples,
        )
