"""The iteration-level scheduler.

There is no prefill phase and no decode phase. Every request knows how many of its tokens are
computed; every step gives each running request its next token or its next prefill chunk, then
admits waiting requests, all under one token budget (``max_num_batched_tokens``) and one sequence
cap (``max_num_seqs``). A long prompt is read in chunks, so it never stalls the decodes.

When a running request cannot get a block, the running request that matters least (the newest
under FCFS, the lowest priority under the priority policy) is preempted: its blocks are freed and
it goes back to the waiting queue, ahead of later arrivals, to be recomputed when it returns. The
prefix cache usually still holds most of its blocks, and recomputing the same tokens gives the
same keys and values, so its output continues exactly as if it had never been preempted.

Invariants, after every call:
- ``running`` is in policy order (admission order for FCFS, ``policy_key`` for priority), so the
  preemption victim is always ``running[-1]``: a request that has not been scheduled in this
  step yet, or the request that needs the block itself. (When that request's step is still in
  flight in a pipeline, nobody is preempted: in_flight.py.)
- Every request in ``requests`` is either in ``running`` or in ``waiting``; a finished or aborted
  request is in neither and holds no block.

With a KV connector (kv_connector.py), admission also asks it for the tokens after the prefix
cache's hit that it can supply (offloaded or transferred blocks), loaded in the step itself or
later (the request waits, holding its blocks, until ``finish_kv_loads``).

``update`` takes the step's sampled tokens back: it appends them, meets the stop rules, rolls
a speculative decode back past its rejected proposals, and frees what finished. A pooling
request (prefill only: embeddings, scores) finishes at the step that computed its last prompt
token, and holds no block after it.

The scheduler decides; it does not compute. It never imports torch.

Why one file: scheduling and updating read and change the same state (``running``, the block
manager, each request's computed count) at every step, so they are one class rather than two
halves joined by inheritance. What reads that state without changing it lives beside it:
admission checks and the size of the next chunk (admission.py), the waiting queue (queue.py),
background work (background.py); and the images' bookkeeping (encoder_cache.py).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Mapping, Sequence

from pagedserve.blockmgr import KVCacheManager
from pagedserve.scheduler import background
from pagedserve.scheduler.admission import (
    blocks_to_admit,
    check_fits,
    check_fork,
    check_not_overloaded,
    next_chunk,
)
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.encoder_cache import EncoderCacheManager
from pagedserve.scheduler.in_flight import StepsInFlight
from pagedserve.scheduler.kv_connector import KVConnectorScheduler, release_loaded_blocks
from pagedserve.scheduler.output import SchedulerOutput, SchedulerStats
from pagedserve.scheduler.queue import make_waiting_queue, policy_key
from pagedserve.scheduler.request import _FINISHED_VALUES, Request, RequestStatus


class Scheduler:
    """Continuous batching under one token budget, with chunked prefill, preemption and
    admission control."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        kv_connector: KVConnectorScheduler | None = None,
    ) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.kv_connector = kv_connector
        self.encoder = EncoderCacheManager(config.encoder_cache_size)
        self.waiting = make_waiting_queue(config.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._num_preemptions = 0
        self._num_steps = 0
        self._total_scheduled_tokens = 0
        self._last_step = (0, 0)  # scheduled tokens, scheduled sequences
        self._finished: list[Request] = []  # since the last step: reported in its output
        self.steps_in_flight = StepsInFlight()  # scheduled, not yet updated (in_flight.py)
        self.pipeline_depth = 1  # the steps the engine keeps in flight (LLMEngine sets it)
        self._in_flight: frozenset[int] | None = None  # during schedule(): ids() to skip
        self._seqs_per_step = config.max_num_seqs  # during schedule(): its sequence cap

    # ---- admission -----------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request, or refuse it at once.

        Raises ``RequestRejectedError`` (a ValueError naming the field at fault) when it can
        never run: an empty prompt, a prompt that leaves no room under ``max_model_len``,
        ``max_tokens`` < 1, prompt + max_tokens over ``max_model_len``, or more blocks than the
        KV cache can give one request. Raises ``SchedulerOverloadedError`` when the waiting
        queue is full. Raises ValueError when the request id is already in use.
        """
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        check_fits(request, self.config, self.kv)
        check_not_overloaded(request, self.config, self.waiting)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.arrival_order = next(self._arrivals)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def add_forked_request(self, parent_request_id: str, child: Request) -> None:
        """Run ``child`` beside a running parent whose tokens it extends (n > 1, beam search).

        The child shares every block of the parent (``kv.fork``: reference counts + 1); the first
        write into a shared, partly filled block copies it first (copy-on-write). The child has
        computed what the parent has computed, and takes the parent's place in the policy order:
        it goes right after the parent and the parent's earlier children in ``running``, with
        the parent's priority and arrival.
        """
        parent = check_fork(self.requests, parent_request_id, child)
        computed = parent.num_computed_tokens
        self.kv.fork(parent.request_id, child.request_id)
        child.num_computed_tokens = computed
        child.num_cached_tokens = parent.num_cached_tokens
        child.priority = parent.priority
        child.arrival_time = parent.arrival_time
        child.arrival_order = parent.arrival_order
        child.status = RequestStatus.RUNNING
        self.requests[child.request_id] = child
        index = self.running.index(parent) + 1
        while (
            index < len(self.running) and self.running[index].arrival_order == child.arrival_order
        ):
            index += 1
        self.running.insert(index, child)

    # ---- queries -------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_waiting_tokens=self.waiting.num_tokens,
            num_preemptions=self._num_preemptions,
            num_steps=self._num_steps,
            total_scheduled_tokens=self._total_scheduled_tokens,
            num_scheduled_tokens=self._last_step[0],
            num_scheduled_seqs=self._last_step[1],
            encoder_cache_encoded=self.encoder.num_encoded,
            encoder_cache_hits=self.encoder.num_hits,
        )

    # ---- finishing from outside ----------------------------------------------------------

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish (abort, or stop on a stop string) requests wherever they are, mid-prefill
        included; their blocks are freed at once. Unknown or finished ids are ignored (an abort
        may race with the request's own end)."""
        if not status.is_finished:
            raise ValueError(f"finish_requests needs a finished status, got {status}")
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            finished.append(request)
        return finished

    def finish_request(
        self, request: Request, status: RequestStatus, stop_reason: int | str | None = None
    ) -> None:
        """End ``request`` with ``status`` (and ``stop_reason``, when given).

        A live request leaves its queue and frees its blocks at once. One that holds no blocks
        only takes the status: a fork that was never added (it ended at its first token, or
        found the queue full), or a request that finished at this very token and whose reason
        the engine overrules (a stop string in the text outranks the length limit).
        """
        if not status.is_finished:
            raise ValueError(f"finish_request needs a finished status, got {status}")
        if stop_reason is not None:
            request.stop_reason = stop_reason
        if self.requests.get(request.request_id) is request and not request.is_finished:
            self.finish_requests([request.request_id], status)
        else:
            request.status = status

    def rewind(self, request_id: str, num_tokens: int) -> None:
        """Un-compute the last ``num_tokens`` computed tokens of a running request: the next
        step computes them again (a beam waiting for its siblings; rejected speculative tokens).

        The tokens themselves stay, so every block the request holds is still needed (it is
        recomputed into); none is given back. Blocks already registered in the prefix cache
        stay valid: recomputing the same tokens writes the same keys and values.
        """
        request = self.requests.get(request_id)
        if request is None or request.status is not RequestStatus.RUNNING:
            raise ValueError(f"request {request_id!r} is not running: it cannot be rewound")
        if not 0 <= num_tokens <= request.num_computed_tokens:
            raise ValueError(
                f"cannot rewind {request_id!r} by {num_tokens} tokens: it has computed "
                f"{request.num_computed_tokens}"
            )
        request.num_computed_tokens -= num_tokens

    # ---- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide one step: running requests first, then admissions, under one token budget.

        No request is admitted in a step whose running requests had to preempt one: the cache
        has just run dry, and a new request would only take the blocks that the preempted one
        needs to return. (Under the priority policy a more important waiting request may first
        preempt less important running ones to make its own room: ``_make_room_for_priority``.)
        With ``pipeline_depth`` steps in flight (in_flight.py) a step takes at most its share
        of the live requests: a step that took them all would leave the next one empty, and
        the pipeline's stages idle.
        """
        output = SchedulerOutput()
        live = len(self.running) + len(self.waiting)
        share = max(1, -(-live // self.pipeline_depth))
        self._seqs_per_step = min(self.config.max_num_seqs, share)
        self._in_flight = in_flight = self.steps_in_flight.request_ids()
        output.finished, self._finished = StepsInFlight.split_finished(self._finished, in_flight)
        self.encoder.begin_step()
        if self.config.policy == "priority" and self.waiting and self.running:
            self._make_room_for_priority(output)
        made_room = len(output.preempted)
        num_runnable = background.num_runnable(
            self.running, self.waiting, self.config.background_priority, self._adapter_fits
        )
        budget = self._schedule_running(output, self.config.max_num_batched_tokens, 0, num_runnable)
        if len(output.preempted) == made_room:  # the running requests found their blocks
            num_running = len(self.running)
            budget = self._schedule_waiting(output, budget)
            if num_runnable < num_running == len(self.running) and not background.reads_a_prompt(
                output, self.config.background_priority
            ):  # the prompt that background work yielded to could not start: it runs after all
                self._schedule_running(output, budget, num_runnable, num_running)
        output.blocks_to_copy = self.kv.take_blocks_to_copy()
        output.encoder_cache_freed = self.encoder.take_freed()
        if self.kv_connector is not None:
            output.kv_connector_metadata = self.kv_connector.build_connector_meta(output)
        num_tokens = output.num_scheduled_tokens
        self._last_step = (num_tokens, output.num_scheduled_seqs)
        self._num_steps += 1
        self._total_scheduled_tokens += num_tokens
        self.steps_in_flight.add(output)
        return output

    def update(
        self, output: SchedulerOutput, sampled_token_ids: Mapping[str, int | Sequence[int]]
    ) -> list[Request]:
        """Advance computed counts, append sampled tokens, and finish requests that stop.

        ``sampled_token_ids`` maps request id -> its new token (an int), for the requests whose
        chunk reached their last known token, or a list of tokens (a speculative decode's
        accepted proposals and then the target's own token). Each token meets the stop rules (EOS, stop
        ids after ``min_tokens``, ``max_tokens``) in order, so a stop inside a run ends the
        output there. A request finished between ``schedule`` and here (an abort, a stop
        string) is skipped. Returns the requests that got new tokens, finished ones included;
        those have already freed their blocks.
        """
        self.steps_in_flight.returned(output)
        updated: list[Request] = []
        stopped = False
        spec, finished = output.spec_token_ids, _FINISHED_VALUES
        for request, num_new in zip(output.requests, output.num_new_tokens):
            if request.status._value_ in finished:  # request.is_finished, without the call
                continue
            num_computed = request.num_computed_tokens = request.num_computed_tokens + num_new
            if request.images:
                self.encoder.release_consumed(request)
            tokens = sampled_token_ids.get(request.request_id)
            output_ids = request.output_token_ids
            if tokens is None and request.pooling:
                if num_computed == len(request.prompt_token_ids):  # its last chunk: done
                    self._finish(request, RequestStatus.FINISHED_STOPPED)
                    updated.append(request)
                    stopped = True
                continue
            if tokens is None or num_computed < len(request.prompt_token_ids) + len(output_ids):
                continue  # a prefill chunk short of the last known token: nothing sampled
            updated.append(request)
            if type(tokens) is int:  # one new token: nearly every request, every step
                output_ids.append(tokens)
                stop = request.check_stop()
                if stop is not None:
                    self._finish(request, stop)
                    stopped = True
                continue
            for token in tokens:
                output_ids.append(token)
                stop = request.check_stop()
                if stop is not None:
                    self._finish(request, stop)
                    stopped = True
                    break
            else:
                if spec and request.request_id in spec:
                    self._roll_back(request, len(spec[request.request_id]) - (len(tokens) - 1))
        if stopped:
            self.running = [r for r in self.running if not r.is_finished]
        return updated

    def _roll_back(self, request: Request, num_rejected: int) -> None:
        """After a verify step: the rejected proposals' keys and values are garbage, so the
        request is rewound past them and the blocks that only they used go back to the pool."""
        self.rewind(request.request_id, num_rejected)
        self.kv.free_blocks_beyond(request.request_id, request.num_computed_tokens)

    # ---- internals -----------------------------------------------------------------------

    def _schedule_running(self, output: SchedulerOutput, budget: int, start: int, stop: int) -> int:
        """The next chunk of each of the running requests from ``start`` to ``stop``, in order,
        preempting from the tail as needed; returns the budget left. Runs of decodes go through
        ``_schedule_decodes``; the first request it does not take goes through
        ``_schedule_chunk``, and so on."""
        max_seqs, running, requests = self._seqs_per_step, self.running, output.requests
        in_flight, index = self._in_flight, start
        while budget > 0 and len(requests) < max_seqs:
            end = min(stop, len(running))  # a preemption shortens ``running``
            if index >= end:
                break
            if in_flight is not None and id(running[index]) in in_flight:
                index += 1  # its last step is still in the pipeline
                continue
            num_decodes = self._schedule_decodes(
                output, index, index + min(budget, max_seqs - len(requests), end - index)
            )
            if num_decodes:  # then the request after them, back at the loop's checks
                index, budget = index + num_decodes, budget - num_decodes
                continue
            num_new = self._schedule_chunk(running[index], budget, output)
            if num_new == 0:
                break  # the request was the last one running, and preempted itself
            budget -= num_new or 0  # None: it waits (for the encoder cache, for a step in flight)
            index += 1
        return budget

    def _schedule_decodes(self, output: SchedulerOutput, start: int, stop: int) -> int:
        """How many running requests in a row, from ``start`` (and before ``stop``, which keeps
        them within the budget and the sequence cap), are decodes that ``allocate_decode_slot``
        serves at once: their one last known token, no proposals. Nearly every running request
        of a busy server is one, and its token nearly always lands in its own last block, which
        the block manager answers in O(1); so this is the scheduler's tight loop, and every
        other request (a prefill chunk, proposals, a decode that needs a preemption) is left to
        ``_schedule_chunk``."""
        allocate = self.kv.allocate_decode_slot
        requests, starts = output.requests, output.num_computed_tokens
        counts, tables, fed = output.num_new_tokens, output.block_ids, output.decode_token_ids
        count, in_flight = 0, self._in_flight
        for request in self.running[start:stop]:
            if in_flight is not None and id(request) in in_flight:
                break
            num_computed = request.num_computed_tokens
            prompt_ids, output_ids = request.prompt_token_ids, request.output_token_ids
            if request.spec_token_ids or num_computed + 1 != len(prompt_ids) + len(output_ids):
                break
            table = allocate(
                request.request_id,
                request.all_token_ids,
                num_computed,
                request.cache_salt,
                request.lora_int_id,
            )
            if table is None:
                break
            requests.append(request)  # the columns of output.add, written out, with the token
            starts.append(num_computed)
            counts.append(1)
            tables.append(table)
            fed.append(output_ids[-1] if output_ids else prompt_ids[-1])
            count += 1
        output.num_scheduled_tokens += count
        return count

    def _schedule_chunk(self, request: Request, budget: int, output: SchedulerOutput) -> int | None:
        """One running request's next chunk (a decode takes its one token and any proposals,
        as far as the budget goes; a prefill the chunking rules), allocated, preempting from
        the tail as needed. Returns its token count: 0 when ``request`` itself had to go, None
        when its next tokens are an image the encoder cache has no room for in this step."""
        num_computed = request.num_computed_tokens
        spec = request.spec_token_ids
        if num_computed + 1 == len(request.prompt_token_ids) + len(request.output_token_ids):
            num_new = 1  # a decode: what next_chunk gives it under any budget left (> 0)
            if spec:  # verify the proposals too, as far as the budget goes
                spec, request.spec_token_ids = spec[: budget - 1], []
                num_new += len(spec)
                if not self._allocate(request, num_computed, num_new):
                    spec, num_new = [], 1  # proposals never cost another request its place
        else:
            num_new = next_chunk(request, num_computed, budget, self.config, self.encoder)
            if num_new == 0:
                return None
        if not spec and not (allocated := self._allocate_or_preempt(request, num_new, output)):
            return None if allocated is None else 0
        self._add_to_step(request, num_computed, num_new, output)
        if spec:
            output.spec_token_ids[request.request_id] = spec
        return num_new

    def _allocate_or_preempt(
        self, request: Request, num_new: int, output: SchedulerOutput
    ) -> bool | None:
        """Get ``request`` the slots for its chunk, preempting from the tail of ``running`` until
        the pool can give them. False when ``request`` itself had to go; None when the tail's
        step is in flight (it is no victim: ``request`` waits for a step)."""
        while not self._allocate(request, request.num_computed_tokens, num_new):
            if self._tail_in_flight():
                return None
            victim = self.running.pop()
            self._preempt(victim)
            output.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _allocate(
        self, request: Request, num_computed: int, num_new: int, hits=(), delay_caching=False
    ) -> bool:
        """``allocate_slots`` for ``request``, its blocks hashed with its salt and adapter."""
        return self.kv.allocate_slots(
            request.request_id,
            request.all_token_ids,
            num_computed,
            num_new,
            computed_blocks=hits,
            cache_salt=request.cache_salt,
            lora_int_id=request.lora_int_id,
            delay_caching=delay_caching,
            images=request.images,
        )

    def _add_to_step(
        self, request: Request, num_computed: int, num_new: int, output: SchedulerOutput
    ) -> None:
        """Put a request's chunk into the step, with the images it needs encoded."""
        output.add(request, num_computed, num_new, self.kv.block_ids(request.request_id))
        if request.images:
            end = num_computed + num_new
            for index in self.encoder.schedule(request, num_computed, end):
                output.encoder_inputs.append((request, index))

    def _adapter_fits(self, request: Request) -> bool:
        """Admitting ``request`` keeps the running requests within ``max_loras`` adapters (so
        every step's adapters have slots). One that does not fit waits at the head: the running
        adapters' requests finish, and it is next, so it never starves."""
        if not request.lora_int_id or not self.config.max_loras:
            return True
        running = {r.lora_int_id for r in self.running if r.lora_int_id}
        return request.lora_int_id in running or len(running) < self.config.max_loras

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> int:
        """Admit waiting requests in policy order while the budget, the sequence cap and the
        pool allow; the first that cannot start stops admission. A request preempted in this
        very step (by ``_make_room_for_priority``) is not taken back: it would recompute from
        scratch the blocks it just gave up, so it waits for the next step like any victim. No
        background request is admitted in a step that reads a more important prompt."""
        max_seqs, lowest = self.config.max_num_seqs, self.config.background_priority
        step_seqs = self._seqs_per_step
        preempted_now = {id(r) for r in output.preempted}
        yields = None  # whether background work yields this step: asked at a background head
        while (
            self.waiting
            and budget > 0
            and len(self.running) < max_seqs
            and output.num_scheduled_seqs < step_seqs
        ):
            request = self.waiting.first_ready()
            if request is None:
                break  # every waiting request is held (its grammar, its KV blocks)
            if id(request) in preempted_now:
                break  # a victim of this step waits for the next one
            if lowest is not None and request.priority >= lowest:
                if yields is None:
                    yields = background.reads_a_prompt(output, lowest)
                if yields:
                    break  # background work yields to a prompt (all behind it is background)
            if not self._adapter_fits(request):
                break  # the head waits for an adapter slot; nothing behind it jumps the queue
            num_new = self._admit(request, budget, output)
            if num_new is None:
                break  # the head waits for blocks; nothing behind it jumps the queue
            budget -= num_new
        return budget

    def _admit(self, request: Request, budget: int, output: SchedulerOutput) -> int | None:
        """Admit the first ready waiting request: its prefix-cache hit, then what the KV
        connector supplies after it, then its first chunk. Returns the chunk's tokens (0: it
        now waits for the connector's asynchronous load, holding its blocks), or None when it
        must wait for room (nothing changed)."""
        hits, num_cached = self.kv.get_computed_blocks(
            request.all_token_ids, request.cache_salt, request.lora_int_id, request.images
        )
        num_external, load_async = self._external_tokens(request, num_cached)
        num_computed = num_cached + num_external
        num_new = (
            0
            if load_async
            else next_chunk(request, num_computed, budget, self.config, self.encoder)
        )
        if not load_async and (
            (not self.config.enable_chunked_prefill and num_computed + num_new < request.num_tokens)
            or num_new == 0  # its first image waits for room in the encoder cache
        ):
            return None  # the whole prompt must fit in this step's budget
        if not self._allocate(request, num_cached, num_external + num_new, hits, load_async):
            return None
        if num_external:
            block_ids = self.kv.block_ids(request.request_id)
            self.kv_connector.update_state_after_alloc(request, block_ids, num_external, load_async)
        if load_async:  # it stays in the queue, held (others pass it) until its blocks arrive
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            return 0
        request.num_computed_tokens = num_computed
        self.waiting.take(request)
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_computed
        request.status = RequestStatus.RUNNING
        self._add_running(request)
        self._add_to_step(request, num_computed, num_new, output)
        return num_new

    def _external_tokens(self, request: Request, num_cached: int) -> tuple[int, bool]:
        """The tokens after the prefix cache's hit that the KV connector can supply, and
        whether they arrive later (0 without a connector, and for a pooling request)."""
        if self.kv_connector is None or request.pooling:
            return 0, False
        num_external, load_async = self.kv_connector.get_num_new_matched_tokens(request, num_cached)
        return num_external, load_async and num_external > 0

    def finish_kv_loads(self, num_computed: Mapping[str, int]) -> None:
        """The KV connector's asynchronous loads that ended: request id -> tokens whose keys
        and values its blocks now hold. Each such request waits as any other, its blocks in the
        prefix cache (``kv_connector.release_loaded_blocks`` says why)."""
        release_loaded_blocks(self.kv, self.requests, num_computed)

    def _make_room_for_priority(self, output: SchedulerOutput) -> None:
        """The priority policy's admission: a waiting request that matters more than the
        running tail (a lower ``policy_key``) and finds no room (the sequence cap is reached,
        or the pool lacks the blocks of its first chunk) preempts from the tail, least
        important first, while the tail matters less than it. So a batch of low-priority work
        cannot keep an interactive request waiting for a whole generation. Done before any
        running request is scheduled, so no victim has slots in this step."""
        head = self.waiting.first_ready()
        if head is None:
            return
        key, max_seqs = policy_key(head), self.config.max_num_seqs
        while self.running and policy_key(self.running[-1]) > key and not self._tail_in_flight():
            needed = blocks_to_admit(head, self.kv, self.config, self.encoder)
            if len(self.running) < max_seqs and self.kv.num_free_blocks >= needed:
                return
            victim = self.running.pop()
            self._preempt(victim)
            output.preempted.append(victim)

    def _tail_in_flight(self) -> bool:
        return self._in_flight is not None and id(self.running[-1]) in self._in_flight

    def _add_running(self, request: Request) -> None:
        """Keep ``running`` in policy order, so that its tail is the next preemption victim."""
        if self.config.policy == "priority":
            bisect.insort_right(self.running, request, key=policy_key)
        else:
            self.running.append(request)

    def _preempt(self, request: Request) -> None:
        """Free a running request's blocks and send it back to wait, ahead of later arrivals."""
        self.kv.free(request.request_id)
        self.encoder.release(request)
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self._num_preemptions += 1
        self.waiting.add_preempted(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request.request_id)
        self.encoder.release(request)
        if self.kv_connector is not None:  # its answer replaces what the request brought
            request.kv_transfer_params = self.kv_connector.request_finished(request)
        del self.requests[request.request_id]
        self._finished.append(request)
