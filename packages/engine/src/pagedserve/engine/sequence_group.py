"""A user's request as the engine keeps it: one or more sequences that share a prompt.

The scheduler sees sequences (``scheduler.Request``); a user sees requests. With ``n == 1`` a
request is one sequence under the request's own id. With ``n > 1`` the request starts as one
sequence; when its prompt has been read (its first sample), it forks into ``n`` sequences that
share the prompt's blocks, each drawing its own first token from the same logits. Beam search
(beam_search.py) is a group too, whose sequences are its live beams.

Each sequence carries a ``SequenceState`` in ``Request.payload``: its generator, detokenizer,
stop-string scan and logprobs. Each step a group decides from its rows of the logits
(``decide``, decisions.py): a sampling group adds them to the step's one sampler batch, and
after ``scheduler.update`` its decision detokenizes the new tokens, checks stop strings and
starts the forks of an ``n > 1`` request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedserve.engine.decisions import SamplingBatch, StepContext, StepDecision
from pagedserve.engine.detokenizer import (
    ByteLevelDetokenizer,
    FinalTextDetokenizer,
    IncrementalDetokenizer,
    detokenizer_for,
    find_stop_string,
)
from pagedserve.engine.group_outputs import GroupOutputs
from pagedserve.engine.outputs import RequestMetrics
from pagedserve.engine.sampling_params import RequestOutputKind, SamplingParams
from pagedserve.engine.structured_output.backend import CompiledGrammar, GrammarMatcher
from pagedserve.scheduler import (
    Request,
    RequestRejectedError,
    RequestStatus,
    SchedulerOverloadedError,
)

_RUNNING = RequestStatus.RUNNING


@dataclass(eq=False, slots=True)
class SequenceState:
    """What the engine keeps per sequence beyond the scheduler's view (``Request.payload``).

    ``grammar_matcher``: the sequence's place in its structured-output grammar (None when
    unconstrained, or while the grammar compiles); it fills the sequence's row of each step's
    bitmask and accepts each new token. Speculative decoding rolls it back with the scheduler's
    ``rewind`` (``grammar_matcher.rollback(n)``).

    ``text_sent``/``tokens_sent``: how much of the visible text and of the output tokens the
    request's DELTA outputs have carried already.

    ``plain``: no logprobs, no grammar, no stop strings, so a running decode's new token only
    needs detokenizing (``process_new_token``'s lean path, the common request's).
    """

    group: SequenceGroup
    index: int
    generator: torch.Generator
    detokenizer: ByteLevelDetokenizer | FinalTextDetokenizer | IncrementalDetokenizer
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0
    text_checked: int = 0  # characters of text already searched for stop strings
    stop_string_hit: str | None = None
    grammar_matcher: GrammarMatcher | None = None
    text_sent: int = 0
    tokens_sent: int = 0
    plain: bool = False
    lean_path_enabled = True  # a class switch, for the test that holds the two paths equal

    def __post_init__(self) -> None:
        params = self.group.params
        self.plain = (  # a grammar's matcher may come later (once it compiles): read params
            params.logprobs is None
            and params.structured_outputs is None
            and not params.stop_strings
        )

    @property
    def params(self) -> SamplingParams:
        return self.group.params

    def record_logprobs(self, token_logprobs: dict[int, float], token: int) -> None:
        if self.logprobs is not None:
            self.logprobs.append(token_logprobs)
            self.cumulative_logprob += token_logprobs[token]

    def process_new_token(
        self,
        request: Request,
        logprobs: dict[int, float] | None,
        ctx: StepContext,
        token_index: int = -1,
    ) -> None:
        """After ``scheduler.update`` appended a token: logprobs, detokenize, stop strings.

        ``token_index``: which output token, when a step appended several (speculative
        decoding's accepted run, processed in order); only the last one can have ended it."""
        ctx.record_token(self.group)
        ctx.num_generation_tokens += 1
        if (
            self.plain
            and token_index == -1
            and request.status is _RUNNING
            and self.lean_path_enabled
        ):  # the common decode: its token is not the last, and has no logprobs or stops
            self.detokenizer.add_token(request.output_token_ids[-1])
            return
        output = request.output_token_ids
        token = output[token_index]
        last = token_index == -1 or token_index == len(output) - 1
        if logprobs is not None:
            self.record_logprobs(logprobs, token)
        if self.grammar_matcher is not None:
            self._advance_grammar(request, token, ctx)
        hidden_stop = (
            last
            and request.status is RequestStatus.FINISHED_STOPPED
            and request.stop_reason == token
        )
        if not hidden_stop:
            self.detokenizer.add_token(token)
        if last and request.is_finished:
            self.detokenizer.flush()
        if self.group.params.stop_strings:
            self._check_stop_strings(request, ctx, len(output) if last else token_index + 1)

    def _advance_grammar(self, request: Request, token: int, ctx: StepContext) -> None:
        """Accept the token; a grammar that has ended (its stop token taken) ends the request
        even where the stop token does not (``ignore_eos``)."""
        self.grammar_matcher.accept_token(token)
        if self.grammar_matcher.is_terminated() and not request.is_finished:
            ctx.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED, stop_reason=token)

    def _check_stop_strings(self, request: Request, ctx: StepContext, num_output: int) -> None:
        """``num_output``: output tokens up to the one just processed."""
        stops = self.params.stop_strings
        text = self.detokenizer.text
        if not stops or self.stop_string_hit is not None:
            return
        if num_output < self.params.min_tokens:
            self.text_checked = len(text)  # as EOS: no stop string counts before min_tokens
            return
        hit = find_stop_string(text, len(text) - self.text_checked, stops)
        self.text_checked = len(text)
        if hit is None:
            return
        stop, index = hit
        end = index + len(stop) if self.params.include_stop_str_in_output else index
        self.detokenizer.text = text[:end]
        self.stop_string_hit = stop
        ctx.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED, stop_reason=stop)


@dataclass(eq=False)
class SequenceGroup(GroupOutputs):
    """The sequences of one request. ``sequences[i]`` is the scheduler Request of output i;
    its outputs are made as group_outputs.py says."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seed: int = 0
    output_kind: RequestOutputKind = field(init=False)
    sequences: list[Request[SequenceState]] = field(default_factory=list)
    forked: bool = False
    aborted: bool = False
    compiled_grammar: CompiledGrammar | None = None  # set once a structured output compiled
    # [None, {token 1: logprob, top-N...}, ...]: the first prompt token has no logprob
    prompt_logprobs: list[dict[int, float] | None] | None = None

    def __post_init__(self) -> None:
        self.output_kind = self.params.output_kind
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]

    @property
    def needs_fork(self) -> bool:
        """True until an ``n > 1`` request has split into its ``n`` sequences."""
        return self.params.n > 1 and not self.forked

    @property
    def is_finished(self) -> bool:
        if self.aborted:
            return True
        sequences = self.sequences
        if len(sequences) == 1:  # the common case, without a generator per request per step
            return sequences[0].is_finished and not self.needs_fork
        return not self.needs_fork and all(s.is_finished for s in sequences)

    def child_request_id(self, index: int) -> str:
        return self.request_id if index == 0 else f"{self.request_id}#{index}"

    def new_state(self, index: int, tokenizer, device: torch.device) -> SequenceState:
        """The state of sequence ``index``; sequence i draws from a generator seeded ``seed + i``."""
        return SequenceState(
            group=self,
            index=index,
            generator=torch.Generator(device=device).manual_seed((self.seed + index) % 2**64),
            detokenizer=detokenizer_for(
                tokenizer,
                self.prompt_token_ids,
                self.params.skip_special_tokens,
                # FINAL_ONLY without stop strings: no text is read before the request ends
                final_text=self.output_kind is RequestOutputKind.FINAL_ONLY
                and not self.params.stop_strings,
            ),
            logprobs=[] if self.params.logprobs is not None else None,
            grammar_matcher=None
            if self.compiled_grammar is None
            else self.compiled_grammar.matcher(),
        )

    # ---- one step ------------------------------------------------------------------------

    def decide(self, rows: list[tuple[Request, int]], batch: SamplingBatch) -> StepDecision:
        """Add this step's rows (request, logits row) to the sampler batch. The row of an
        ``n > 1`` request's first sample is added ``n`` times: once for each sequence it forks
        into, each drawing with its own generator."""
        decision = SamplingDecision(self, batch)
        for request, row in rows:
            state = request.payload
            decision.slots.append((request, state, batch.add(row, state, request)))
            if self.needs_fork:
                self.forked = True
                tokenizer = state.detokenizer.tokenizer
                for index in range(1, self.params.n):
                    child = self.new_state(index, tokenizer, batch.logits.device)
                    decision.slots.append((None, child, batch.add(row, child, None)))
        return decision

    def start_child(
        self, state: SequenceState, token: int, logprobs: dict[int, float] | None, ctx: StepContext
    ) -> None:
        """Sequence ``state.index`` of an n > 1 request, born with its first token: it forks
        the parent's blocks."""
        parent = self.sequences[0]
        child = Request(
            request_id=self.child_request_id(state.index),
            prompt_token_ids=list(self.prompt_token_ids),
            max_tokens=parent.max_tokens,
            min_tokens=parent.min_tokens,
            stop_token_ids=parent.stop_token_ids,
            priority=parent.priority,
            arrival_time=parent.arrival_time,
            lora_int_id=parent.lora_int_id,  # the parent's blocks were computed with it
            payload=state,
        )
        child.append_output_token(token)
        self.sequences.append(child)
        stop = child.check_stop()
        if stop is not None:
            ctx.scheduler.finish_request(child, stop)  # done at its first token: no block
        elif parent.status is RequestStatus.RUNNING:
            ctx.scheduler.add_forked_request(parent.request_id, child)
        else:
            # The parent ended at its first token and freed its blocks; the child is queued
            # afresh and finds the prompt's blocks in the prefix cache.
            try:
                ctx.scheduler.add_request(child)
            except (RequestRejectedError, SchedulerOverloadedError):
                ctx.scheduler.finish_request(child, RequestStatus.FINISHED_ABORTED)
        state.process_new_token(child, logprobs, ctx)


@dataclass
class SamplingDecision:
    """A sampling group's step: its slots in the sampler batch, applied after the update.

    A slot is (request, its state, batch slot); the request is None for a fork not yet born.
    """

    group: SequenceGroup
    batch: SamplingBatch
    slots: list[tuple[Request | None, SequenceState, int]] = field(default_factory=list)

    def sampled_tokens(self) -> dict[str, int]:
        if len(self.slots) == 1 and self.slots[0][0] is not None:
            request, _, slot = self.slots[0]
            return {request.request_id: self.batch.token(slot)}
        return {r.request_id: self.batch.token(slot) for r, _, slot in self.slots if r is not None}

    def apply(self, ctx: StepContext) -> bool:
        """Process the parents' new tokens, then start the forks, in slot order."""
        if len(self.slots) == 1 and self.slots[0][0] is not None:  # one sequence, no fork
            request, state, slot = self.slots[0]
            if request.request_id not in ctx.updated:
                return False
            state.process_new_token(request, self.batch.logprobs(slot), ctx)
            return True
        for request, state, slot in self.slots:
            if request is not None and request.request_id in ctx.updated:
                state.process_new_token(request, self.batch.logprobs(slot), ctx)
        for request, state, slot in self.slots:
            if request is None:
                self.group.start_child(
                    state, self.batch.token(slot), self.batch.logprobs(slot), ctx
                )
        return any(r is not None and r.request_id in ctx.updated for r, _, _ in self.slots)
