"""LLMEngine: the step loop that ties scheduler, model runner and output processor together.

``add_request`` validates and queues; ``step`` runs one iteration:

    scheduler.schedule() -> SchedulerOutput
    runner.execute(...) -> ModelRunnerOutput          forward and sampling, by request id
    scheduler.update(...) -> updated sequences         append tokens, stop, free
    output_processor.process(...) -> RequestOutputs    detokenize, stop strings, forks, outputs

and returns a RequestOutput for every request that advanced (cumulative, a delta, or none until
it finishes, as its ``output_kind`` asks). A pipeline of P stages keeps up to P steps in flight:
``step`` schedules and hands over steps (``runner.submit``) until P are in the pipeline, then
takes the oldest one's result (``runner.collect``) and updates from it; one process has one
step in flight, so it schedules, runs and updates one step per call (``_next_result``).
Offline ``LLM`` and online ``AsyncLLM`` both drive this loop. Beam search is the one step that
decides between execute and update: its groups choose their beams' tokens from the runner's
log-probabilities (``step_beams``).

The scheduler sees sequences; the engine groups them into requests (sequence_group.py): a request
with ``n > 1`` forks into n sequences at its first sample, and a beam-search request keeps its
live beams as sequences that fork and drop each step (beam_search.py).

Why one file: ``LLMEngine`` is one class whose intake (``add_request``, checked by
validation.py, multimodal.py and pooling.py) and step loop read and change the same state (the
scheduler, the groups of the output processor, the runner's input batch); what needs none of
that state already lives beside it.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections import deque

import torch

from pagedserve.engine.beam_search import BeamSearchGroup
from pagedserve.engine.config import EngineArgs
from pagedserve.engine.cpu_threads import adaptive_cpu_threads, set_cpu_threads
from pagedserve.engine.errors import EngineError, InvalidRequestError, RequestRejectedError
from pagedserve.engine.executor import create_runner
from pagedserve.engine.gc_tuning import raise_gc_threshold
from pagedserve.engine.input_batch import SamplingState
from pagedserve.engine.kv_cache import kv_cache_manager_for
from pagedserve.engine.kv_connector import create_kv_connector
from pagedserve.engine.logits_processors import bad_words_token_ids
from pagedserve.engine.lora import LoRAManager, LoRARequest
from pagedserve.engine.lora.manager import require_lora
from pagedserve.engine.metrics import EngineStats, StatsCollector, finished_request_stats
from pagedserve.engine.multimodal import image_processor_for, prompt_with_images
from pagedserve.engine.output_processor import OutputProcessor, StepTokens
from pagedserve.engine.outputs import (
    ModelRunnerOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
from pagedserve.engine.pooling import add_to_scheduler, pooling_request
from pagedserve.engine.pooling_params import PoolingParams
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.sequence_group import SequenceGroup
from pagedserve.engine.spec_decode.speculator import Speculator
from pagedserve.engine.structured_output.manager import StructuredOutputManager
from pagedserve.engine.structured_output.xgrammar_backend import XgrammarBackend
from pagedserve.engine.validation import (
    check_kv_transfer_params,
    check_logprobs,
    check_token_ids,
    resolve_max_tokens,
)
from pagedserve.models import load_tokenizer
from pagedserve.scheduler import Request, RequestStatus, Scheduler, SchedulerOutput

logger = logging.getLogger("pagedserve.engine")


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.model_config, self.cache_config, self.scheduler_config = args.create_configs()
        set_cpu_threads(args.num_cpu_threads)
        on_cpu = self.model_config.torch_device.type == "cpu"
        self.cpu_threads = adaptive_cpu_threads(args.num_cpu_threads) if on_cpu else None
        raise_gc_threshold(self.scheduler_config.max_num_seqs)  # gc_tuning.py says why
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
        drafter = self.speculator.draft if self.speculator else None
        self.image_processor = image_processor_for(
            args, self.model_config, self.tokenizer, self.scheduler_config, self.speculator
        )
        profile_images = (  # what a GPU's memory profile runs through the vision tower
            self.image_processor.take_profile_images(self.scheduler_config)
            if self.image_processor
            else ()
        )
        self.runner = create_runner(
            args, self.model_config, self.cache_config, draft_bytes, drafter, profile_images
        )
        if self.speculator is not None:  # a draft model's cache: the same blocks
            self.speculator.allocate_kv_caches(self.runner.num_blocks, block_size)
        # a KV connector (offloading, transfer) names blocks by prefix hash from its own root
        connector = self.runner.kv_connector = create_kv_connector(
            args, self.model_config, self.runner
        )
        self.kv_cache_manager = kv_cache_manager_for(
            self.model_config, self.cache_config, self.runner.num_blocks, connector
        )
        self.scheduler = Scheduler(self.scheduler_config, self.kv_cache_manager, connector)
        self.lora_manager: LoRAManager | None = getattr(self.runner, "lora_manager", None)
        self.eos_token_ids = self._eos_token_ids()
        logger.info(
            "stop ids %s; %s",
            sorted(self.eos_token_ids),
            self.model_config.generation_defaults.describe(),
        )
        self._seed_source = torch.Generator().manual_seed(args.seed)
        self._ids = itertools.count()
        self.output_processor = OutputProcessor(
            self.scheduler, self.runner.input_batch, self.tokenizer, self._record_finished
        )
        self._never_scheduled: set[str] = set()  # requests whose first_scheduled_time is unset
        self.stats = StatsCollector(connector)
        self.structured_output = StructuredOutputManager(self._grammar_backend)
        self._request_errors: list[tuple[str, BaseException]] = []
        self._in_flight: deque[tuple[SchedulerOutput, object]] = deque()  # submitted steps
        # a speculator proposes for every running request after each step, from its newest
        # token: a pipeline runs one step at a time with it
        self.max_steps_in_flight = 1 if self.speculator else self.runner.max_steps_in_flight

    @property
    def max_steps_in_flight(self) -> int:
        """How many steps the engine hands over before it takes the oldest one's result back:
        one per pipeline stage, one for one process (module docstring). Settable: 1 runs a
        pipeline one step at a time."""
        return self.scheduler.pipeline_depth

    @max_steps_in_flight.setter
    def max_steps_in_flight(self, value: int) -> None:
        if value < 1:
            raise ValueError(f"max_steps_in_flight must be >= 1, got {value}")
        self.scheduler.pipeline_depth = value  # a step's share of the requests follows it

    @property
    def image_placeholder(self) -> str | None:
        """The text that stands for one image in a prompt (None: the model takes no images)."""
        return self.image_processor.placeholder if self.image_processor else None

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
        params: SamplingParams | PoolingParams,
        prompt: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        token_type_ids: list[int] | None = None,
        multi_modal_data: dict | None = None,
        images: tuple = (),
    ) -> None:
        """Queue a request (its first sequence), or refuse it with ``InvalidRequestError``
        naming the field at fault (validation.py; the scheduler's refusals too). A refused
        request leaves no trace: no group, no seed drawn. ``lora_request`` (None: the base
        model) is registered if it is new, its files read and checked now. ``PoolingParams``
        make a pooling request (pooling.py; ``token_type_ids``: a pair's segments).
        ``multi_modal_data`` (``{"image": [PIL images]}``) are the images of a prompt that
        holds one image placeholder per image (multimodal.py expands them); ``images``, those
        of a prompt already expanded (``prompt_with_images``: AsyncLLM runs it off the engine
        thread)."""
        if request_id in self.output_processor.groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if isinstance(params, PoolingParams) or self.model_config.runner_type == "pooling":
            if multi_modal_data:
                raise InvalidRequestError("pooling requests take no images", "multi_modal_data")
            args = (prompt, arrival_time, priority, token_type_ids)
            return self._add_pooling_request(request_id, prompt_token_ids, params, *args)
        check_token_ids(prompt_token_ids, params, self.model_config.vocab_size)
        if not images:
            prompt_token_ids, images = prompt_with_images(
                self.image_processor, self.args.model, prompt_token_ids, multi_modal_data
            )
        if params.use_beam_search and self.speculator is not None:
            raise InvalidRequestError(
                "beam search cannot run with speculative decoding (its beams fork and drop "
                "every step); start an engine without speculative_config for it",
                "use_beam_search",
            )
        check_logprobs(params, self.args.max_logprobs, self.model_config.vocab_size)
        lora_int_id = self._lora_id(lora_request)
        max_len = self.scheduler_config.max_model_len
        max_tokens = resolve_max_tokens(len(prompt_token_ids), params, max_len)
        now = arrival_time if arrival_time is not None else time.monotonic()
        request = self._new_request(
            request_id, list(prompt_token_ids), params, max_tokens, priority, now, lora_int_id
        )
        request.images = images
        try:
            self.scheduler.add_request(request)
        except RequestRejectedError as e:
            raise InvalidRequestError(str(e), e.param) from e
        self._start_group(request, params, prompt, now, max_tokens)
        self._never_scheduled.add(request_id)
        if params.structured_outputs is not None:
            self.structured_output.hold(request, params.structured_outputs)

    def _new_request(
        self, request_id, prompt_ids, params, max_tokens, priority, now, lora_int_id
    ) -> Request:
        """The scheduler's request for a new generation: its stop ids, and a cache salt of
        its own when the prompt's logprobs are asked for."""
        stop_ids = set(params.stop_token_ids or [])
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        return Request(
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
            kv_transfer_params=check_kv_transfer_params(params, self.runner.kv_connector),
        )

    def _add_pooling_request(
        self, request_id, prompt_token_ids, params, prompt, arrival_time, priority, token_types
    ) -> None:
        """A pooling request (pooling.py): its request, runner state and group registered."""
        request, state, group = pooling_request(
            request_id, prompt_token_ids, params, self.model_config,
            getattr(self.runner, "pooler", None),  # a generative runner has none: refused
            prompt=prompt, priority=priority, token_type_ids=token_types,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
        )  # fmt: skip
        add_to_scheduler(self.scheduler, request)
        self.runner.input_batch.add_pooling(state)
        self.output_processor.groups[request_id] = group
        self._never_scheduled.add(request_id)

    def _start_group(self, request: Request, params, prompt, now, max_tokens) -> None:
        """The request's group and its first sequence's state, registered with the runner and
        the output processor. Sequence i draws from a generator seeded ``seed + i``: with
        ``n > 1`` the other sequences (forks) draw their first token from the first one's row
        at its first sample, and start then."""
        group = self._new_group(
            request.request_id, list(request.prompt_token_ids), params, prompt, now, max_tokens
        )
        num_generators = 1 if params.use_beam_search else params.n
        generators = [self._generator(group.seed + i) for i in range(num_generators)]
        forks = [(group.child_request_id(i), generators[i]) for i in range(1, num_generators)]
        bad_words = bad_words_token_ids(params.bad_words or (), self.tokenizer)
        sampling = SamplingState(
            request,
            params,
            generators[0],
            forks=forks,
            beam=params.use_beam_search,
            bad_words_token_ids=bad_words,
        )
        request.payload = group.sequence_state(0, sampling, self.tokenizer)
        group.sequences.append(request)
        self.runner.input_batch.add(sampling)
        self.output_processor.add(group, forks)

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
            request.payload.group.compiled_grammar = grammar
            request.payload.sampling.grammar_matcher = grammar.matcher()
        for request, error in failed:
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_ABORTED)
            self.output_processor.forget(request.request_id)
            self._never_scheduled.discard(request.request_id)
            self._request_errors.append((request.request_id, error))

    def _generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.runner.device).manual_seed(seed % 2**64)

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
        """Release what outlives the engine object: tensor-parallel worker processes (once
        the steps in flight are back: the workers are in the middle of them)."""
        self.structured_output.shutdown()
        self._drain()
        if self.runner.kv_connector is not None:
            self.runner.kv_connector.shutdown()
        stop_workers = getattr(self.runner, "shutdown", None)
        if stop_workers is not None:
            stop_workers()

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Abort requests wherever they are (blocks freed at once); unknown ids are ignored.

        Returns the final output (finish_reason "abort") of each request that was still live.
        """
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outputs = self.output_processor.abort(ids, time.monotonic())
        if outputs:
            self._record_step(StepTokens())  # the gauges (running, waiting, KV usage) changed
        return outputs

    def unfinished_request_ids(self) -> list[str]:
        return list(self.output_processor.groups)

    def has_unfinished_requests(self) -> bool:
        """Requests to serve, or steps in flight to take back (even if every request in them
        was aborted: the pipeline's ranks are inside them)."""
        groups, scheduler = self.output_processor.groups, self.scheduler
        return bool(groups) or scheduler.has_unfinished_requests() or bool(self._in_flight)

    def get_stats(self, drain: bool = True) -> EngineStats:
        """Gauges, counters and finished-request latencies; safe to call from any thread."""
        return self.stats.snapshot(drain)

    # ---- one step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule -> execute -> update -> outputs (module docstring)."""
        if self.cpu_threads is not None:  # as many threads as other processes leave cores
            self.cpu_threads.before_step()
        if self.structured_output.num_held:
            self._release_grammars()
        scheduled, output = self._next_result()
        if output.finished_kv_loads:  # a KV connector's blocks arrived: they may be admitted
            self.scheduler.finish_kv_loads(output.finished_kv_loads)
        if scheduled.is_empty:
            if self.structured_output.num_held:  # only compiles to wait for: wait, not spin
                self._release_grammars(timeout=0.05)
            return []
        processor = self.output_processor
        processor.step_beams(output)
        updated = self.scheduler.update(scheduled, output.sampled_token_ids)
        outputs, tokens = processor.process(updated, output, time.monotonic())
        if output.spec_decode is not None:
            self.stats.record_spec_decode(output.spec_decode)
        self._record_step(tokens, is_step=True)
        self._release_removed_loras()
        if self.speculator is not None:  # proposals for the next step's decodes
            self.speculator.propose(self.scheduler.running)
        return outputs

    def _next_result(self) -> tuple[SchedulerOutput, ModelRunnerOutput]:
        """Schedule and submit steps until ``max_steps_in_flight`` are in flight, then collect
        the oldest. An empty step (nothing runnable: it only forgets what finished) is run at
        once when another is in flight, and ends the filling."""
        queue, runner = self._in_flight, self.runner
        while len(queue) < self.max_steps_in_flight:
            scheduled = self.scheduler.schedule()
            if self._never_scheduled and not scheduled.is_empty:  # only then can one be new
                self._stamp_first_scheduled(scheduled)
            if scheduled.is_empty and queue:
                runner.collect(runner.submit(scheduled))
                break
            queue.append((scheduled, runner.submit(scheduled)))
            if scheduled.is_empty:
                break
        scheduled, submitted = queue.popleft()
        return scheduled, runner.collect(submitted)

    def _drain(self) -> None:
        """Take back the steps in flight, dropping their results (shutting down)."""
        while self._in_flight:
            scheduled, submitted = self._in_flight.popleft()
            try:
                self.runner.collect(submitted)
            except EngineError:  # the group failed: the workers are killed anyway
                self._in_flight.clear()

    def _stamp_first_scheduled(self, scheduled: SchedulerOutput) -> None:
        now = time.monotonic()
        never = self._never_scheduled
        for request in scheduled.requests:
            group = request.payload.group
            if group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = now
                never.discard(group.request_id)

    # ---- outputs and metrics -------------------------------------------------------------

    def _record_finished(self, group: SequenceGroup, output: RequestOutput, now: float) -> None:
        """A request has left the engine with ``output``: its latencies, once."""
        self._never_scheduled.discard(group.request_id)
        group.metrics.finished_time = now
        pooled = isinstance(output, PoolingRequestOutput)  # prefill only: it "stops" there
        self.stats.record_finished(
            finished_request_stats(
                group.request_id,
                "abort" if group.aborted else "stop" if pooled else output.outputs[0].finish_reason,
                len(group.prompt_token_ids),
                group.num_output_tokens(output),
                group.metrics,
            )
        )

    def _record_step(self, tokens: StepTokens, is_step: bool = False) -> None:
        """The gauges, and a step's tokens (``StatsCollector.record_step``)."""
        held = self.structured_output.num_held  # waiting for their grammar: "deferred"
        self.stats.record_step(self.scheduler.stats, self.kv_cache_manager, tokens, held, is_step)

    # ---- LoRA adapters (vLLM's add_lora / remove_lora / list_loras) -----------------------

    def _lora_id(self, lora_request: LoRARequest | None) -> int:
        if lora_request is None:
            return 0
        return require_lora(self.lora_manager).check_request(lora_request)

    def add_lora(self, lora_request: LoRARequest, weights=None) -> None:
        """Register an adapter (``weights``: what ``lora_manager.read`` gave, if read already)."""
        require_lora(self.lora_manager).add_lora(lora_request, weights)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unregister an adapter: its running and waiting requests finish with it first."""
        removed = self.lora_manager is not None and self.lora_manager.remove_lora(lora_int_id)
        self._release_removed_loras()
        return removed

    def list_loras(self) -> list[LoRARequest]:
        return [] if self.lora_manager is None else list(self.lora_manager.registered.values())

    def _release_removed_loras(self) -> None:
        """Free removed adapters whose last request is gone; record the adapters in use."""
        if (manager := self.lora_manager) is not None:
            manager.release_removed(self.scheduler.requests.values())
            self.stats.record_lora(*manager.adapters_in_use(self.scheduler.requests.values()))
