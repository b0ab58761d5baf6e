"""From a step's runner output and the scheduler's update to the requests' outputs (vLLM's
``OutputProcessor``).

The engine's request groups live here (sequence_group.py, beam_search.py). Each step:

1. ``step_beams`` (before ``scheduler.update``): every beam-search group whose live beams all
   got their log-probabilities steps them at once, and its continuing beams' tokens join the
   runner output's sampled tokens; beams whose siblings are missing wait.
2. ``process`` (after the update appended the tokens): for each sequence that got tokens, in
   one loop, its token times (time to first token, inter-token latencies), its tokens
   detokenized with their logprobs, grammar and stop strings (``process_new_tokens``); its
   request's prompt logprobs; an ``n > 1`` request's other sequences started with the tokens
   the runner drew for them; beam groups' forks and drops applied; then one ``RequestOutput``
   per request with news, as its ``output_kind`` asks (none for an unfinished FINAL_ONLY one).

A pooling model's step carries pooled outputs instead of tokens (``pooler_output``): each
finished pooling request's group (pooling.py) takes its result and makes its one output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagedserve.engine.beam_search import BeamSearchGroup, BeamStep
from pagedserve.engine.input_batch import InputBatch, SamplingState
from pagedserve.engine.outputs import ModelRunnerOutput, RequestOutput
from pagedserve.engine.sampling_params import RequestOutputKind
from pagedserve.engine.sequence_group import SequenceGroup
from pagedserve.scheduler import (
    Request,
    RequestRejectedError,
    RequestStatus,
    Scheduler,
    SchedulerOverloadedError,
)

_FINAL_ONLY = RequestOutputKind.FINAL_ONLY
_RUNNING = RequestStatus.RUNNING


@dataclass
class StepTokens:
    """What a step produced, for the metrics."""

    num_generation_tokens: int = 0
    num_prompt_tokens: int = 0  # prompts of the requests that produced their first token now
    inter_token_latencies: list[float] = field(default_factory=list)


class OutputProcessor:
    """The live requests' groups and what turns each step into their outputs.

    ``on_finished(group, output, now)``: the engine's bookkeeping for a request that has just
    finished (its stats); called once per request, after which the group is forgotten.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        input_batch: InputBatch,
        tokenizer,
        on_finished: Callable[[SequenceGroup, RequestOutput, float], None],
    ) -> None:
        self.scheduler = scheduler
        self.input_batch = input_batch
        self.tokenizer = tokenizer
        self.on_finished = on_finished
        self.groups: dict[str, SequenceGroup] = {}
        self.beam_groups: dict[str, BeamSearchGroup] = {}
        self.forks: dict[str, tuple[SequenceGroup, int, torch.Generator]] = {}
        self._beam_steps: list[tuple[BeamSearchGroup, BeamStep]] = []
        self._waiting_beams: list[Request] = []

    def add(self, group: SequenceGroup, forks: list[tuple[str, torch.Generator]]) -> None:
        """A new request's group; ``forks``: its other sequences' ids and generators (n > 1)."""
        self.groups[group.request_id] = group
        if isinstance(group, BeamSearchGroup):
            self.beam_groups[group.request_id] = group
        for index, (child_id, generator) in enumerate(forks, 1):
            group.pending_forks[child_id] = index
            self.forks[child_id] = (group, index, generator)

    def forget(self, request_id: str) -> SequenceGroup | None:
        """Drop a request that has left the engine; its group, if it was still known."""
        group = self.groups.pop(request_id, None)
        if group is not None:
            self.beam_groups.pop(request_id, None)
            for child_id in group.pending_forks:
                self.forks.pop(child_id, None)
        return group

    # ---- one step ------------------------------------------------------------------------

    def step_beams(self, output: ModelRunnerOutput) -> None:
        """Before the update: each beam group that can step does, its tokens added to
        ``output.sampled_token_ids``."""
        self._beam_steps, self._waiting_beams = [], []
        if not output.beam_logprobs:
            return
        for group in self.beam_groups.values():
            if group.is_finished:
                continue
            stepped = group.step_beams(output.beam_logprobs)
            if isinstance(stepped, BeamStep):
                self._beam_steps.append((group, stepped))
                for beam_id, token in stepped.sampled.items():
                    output.sampled_token_ids[beam_id] = token
            else:
                self._waiting_beams.extend(stepped)

    def process(
        self, updated: list[Request], output: ModelRunnerOutput, now: float
    ) -> tuple[list[RequestOutput], StepTokens]:
        """After the update: every updated sequence's tokens, forks and beams, and the outputs.
        A request of one sequence (nearly every request) has its output made at once; one of
        several (an ``n > 1`` request, beams) once all its sequences are processed."""
        tokens = StepTokens()
        if output.pooler_output:  # a pooling model's step: its finished requests' results
            return self._pooled_outputs(output, tokens, now), tokens
        if output.prompt_logprobs:
            self._record_prompt_logprobs(output)
        outputs: list[RequestOutput] = []
        touched: dict[SequenceGroup, None] = {}  # the groups of several sequences
        logprobs, scheduler = output.logprobs, self.scheduler
        latencies = tokens.inter_token_latencies
        num_plain = 0  # plain decodes' tokens, counted once after the loop
        for request in updated:
            state = request.payload
            group = state.group
            # token times: the prompt counts once, with the first token; a sibling's token in
            # the same step is no new inter-token interval
            metrics = group.metrics
            last = metrics.last_token_time
            if last is None:
                metrics.first_token_time = now
                tokens.num_prompt_tokens += len(group.prompt_token_ids)
            elif now > last:
                latencies.append(now - last)
            metrics.last_token_time = now
            generated, plain = request.output_token_ids, state.plain and request.status is _RUNNING
            if plain and state.num_processed == len(generated) - 1:  # a plain sequence's 1 token
                state.num_processed += 1
                state.detokenizer.add_token(generated[-1])
                num_plain += 1
                if group.is_plain_running and group.output_kind is not _FINAL_ONLY:
                    outputs.append(group.running_output(request, state))  # make_output's
                    continue
            elif state.sampling.beam:  # its group makes its text from the token ids
                tokens.num_generation_tokens += 1
                touched[group] = None
                continue
            else:
                tokens.num_generation_tokens += state.process_new_tokens(
                    request, logprobs.get(request.request_id) if logprobs else None, scheduler
                )
            if len(group.sequences) > 1 or group.pending_forks:
                touched[group] = None
            elif group.output_kind is not _FINAL_ONLY or group.is_finished:  # has_new_output
                made = group.make_output()  # _output, written out
                if made.finished and self.forget(group.request_id) is not None:
                    self.on_finished(group, made, now)
                outputs.append(made)
        tokens.num_generation_tokens += num_plain
        if self.forks:
            self._start_forks(output, tokens, touched)
        if self._beam_steps or self._waiting_beams:
            self._apply_beam_steps(touched)
        if touched:
            outputs += [self._output(group, now) for group in touched if group.has_new_output]
        return outputs, tokens

    def abort(self, request_ids: list[str], now: float) -> list[RequestOutput]:
        """Abort requests wherever they are (blocks freed at once); unknown ids are ignored.
        The final output (finish_reason "abort") of each request that was still live."""
        outputs = []
        for request_id in request_ids:
            group = self.groups.get(request_id)
            if group is None:
                continue
            live = [s.request_id for s in group.sequences if not s.is_finished]
            self.scheduler.finish_requests(live, RequestStatus.FINISHED_ABORTED)
            group.aborted = True
            outputs.append(self._output(group, now))
        return outputs

    # ---- internals -----------------------------------------------------------------------

    def _pooled_outputs(
        self, output: ModelRunnerOutput, tokens: StepTokens, now: float
    ) -> list[RequestOutput]:
        """Each pooling request whose last chunk ran: its result, its one output (a pooling
        model's steps hold pooling requests only)."""
        touched: dict[SequenceGroup, None] = {}
        for request_id, data in output.pooler_output.items():
            group = self.groups.get(request_id)
            if group is None:  # aborted while its last chunk ran
                continue
            group.result = data
            group.metrics.first_token_time = group.metrics.last_token_time = now
            tokens.num_prompt_tokens += len(group.prompt_token_ids)
            touched[group] = None
        return [self._output(group, now) for group in touched if group.has_new_output]

    def _record_prompt_logprobs(self, output: ModelRunnerOutput) -> None:
        """Each request's prompt logprobs of this step (a request that asked is one sequence
        until its prompt is read, under the request's own id)."""
        for request_id, (start, entries) in output.prompt_logprobs.items():
            group = self.groups.get(request_id)
            if group is not None and group.record_prompt_logprobs(start, entries):
                group.sequences[0].needs_prompt_logits = False  # complete: a recompute needs none

    def _start_forks(
        self, output: ModelRunnerOutput, tokens: StepTokens, touched: dict[SequenceGroup, None]
    ) -> None:
        """The other sequences of each ``n > 1`` request whose first sample was drawn now."""
        sampled = output.sampled_token_ids
        for child_id in [c for c in self.forks if c in sampled]:
            group, index, generator = self.forks.pop(child_id)
            del group.pending_forks[child_id]
            if group.aborted:
                continue
            child = self._start_child(group, child_id, index, generator, sampled[child_id])
            tokens.num_generation_tokens += child.payload.process_new_tokens(
                child, output.logprobs.get(child_id), self.scheduler
            )
            touched[group] = None

    def _start_child(
        self, group: SequenceGroup, child_id: str, index: int, generator, token: int
    ) -> Request:
        """Sequence ``index`` of an n > 1 request, born with its first token: it forks the
        parent's blocks, or is queued afresh when the parent ended at its first token (and
        finds the prompt's blocks in the prefix cache), or ends at once."""
        parent = group.sequences[0]
        child = Request(
            request_id=child_id,
            prompt_token_ids=list(group.prompt_token_ids),
            max_tokens=parent.max_tokens,
            min_tokens=parent.min_tokens,
            stop_token_ids=parent.stop_token_ids,
            priority=parent.priority,
            arrival_time=parent.arrival_time,
            lora_int_id=parent.lora_int_id,  # the parent's blocks were computed with it
            images=parent.images,  # and with these images
        )
        matcher = None if group.compiled_grammar is None else group.compiled_grammar.matcher()
        bad_words = parent.payload.sampling.bad_words_token_ids
        sampling = SamplingState(
            child, group.params, generator, matcher, bad_words_token_ids=bad_words
        )
        child.payload = group.sequence_state(index, sampling, self.tokenizer)
        child.output_token_ids.append(token)
        group.sequences.append(child)
        scheduler = self.scheduler
        stop = child.check_stop()
        if stop is not None:
            scheduler.finish_request(child, stop)  # done at its first token: no block
            return child
        try:
            if parent.status is RequestStatus.RUNNING:
                scheduler.add_forked_request(parent.request_id, child)
            else:
                scheduler.add_request(child)
        except (RequestRejectedError, SchedulerOverloadedError):
            scheduler.finish_request(child, RequestStatus.FINISHED_ABORTED)
            return child
        self.input_batch.add(sampling)
        return child

    def _apply_beam_steps(self, touched: dict[SequenceGroup, None]) -> None:
        for beam in self._waiting_beams:
            self.scheduler.rewind(beam.request_id, 1)
        for group, plan in self._beam_steps:
            group.apply_step(plan, self.scheduler, self.input_batch)
            touched[group] = None

    def _output(self, group: SequenceGroup, now: float) -> RequestOutput:
        output = group.make_output()
        if output.finished and self.forget(group.request_id) is not None:
            self.on_finished(group, output, now)
        return output
