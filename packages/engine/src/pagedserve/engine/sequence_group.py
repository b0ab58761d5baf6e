"""A user's request as the engine keeps it: one or more sequences that share a prompt, and how
its outputs are made.

The scheduler sees sequences (``scheduler.Request``); a user sees requests. With ``n == 1`` a
request is one sequence under the request's own id. With ``n > 1`` the request starts as one
sequence; its first sample is drawn once per sequence (the runner draws its forks from the same
row, each with its own generator) and the other ``n - 1`` sequences start then, sharing the
prompt's blocks. Beam search (beam_search.py) is a group too, whose sequences are its live beams.

Each sequence carries a ``SequenceState`` in ``Request.payload``: what turns its tokens into
text (the detokenizer, the stop-string scan), its logprobs, and its ``SamplingState`` (the
runner's: params, generator, grammar matcher).

Outputs, as ``SamplingParams.output_kind`` asks: CUMULATIVE, each output a snapshot of every
sequence's whole text and tokens so far; DELTA (vLLM's delta outputs), only what each sequence
added since the request's last output; FINAL_ONLY, none until the request finishes, then one
snapshot. While a sequence with stop strings runs, the text it may still cut is held back
(``visible_text``), so no kind ever takes text back.

The common case at each decode step (a running sequence with no logprobs, grammar or stop
strings, one new token) is what a busy server does most: ``process_new_tokens`` then only
detokenizes, and ``make_output`` makes its output without the general checks (each
microsecond there is a millisecond at a thousand requests: docs/benchmarks.md, "Engine host
cost per step").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.engine.detokenizer import (
    ByteLevelDetokenizer,
    FinalTextDetokenizer,
    IncrementalDetokenizer,
    detokenizer_for,
    find_stop_string,
)
from pagedserve.engine.input_batch import SamplingState
from pagedserve.engine.outputs import CompletionOutput, Logprobs, RequestMetrics, RequestOutput
from pagedserve.engine.sampling_params import RequestOutputKind, SamplingParams
from pagedserve.engine.structured_output.backend import CompiledGrammar
from pagedserve.scheduler import Request, RequestStatus, Scheduler

_RUNNING = RequestStatus.RUNNING
_DELTA = RequestOutputKind.DELTA
_FINAL_ONLY = RequestOutputKind.FINAL_ONLY


@dataclass(eq=False, slots=True)
class SequenceState:
    """What the engine keeps per sequence beyond the scheduler's view (``Request.payload``).

    ``num_processed``: output tokens already detokenized and checked. ``text_sent`` /
    ``tokens_sent``: how much of the visible text and of the output tokens the request's DELTA
    outputs have carried already. ``plain``: no logprobs, grammar, stop strings or beams, so a
    running decode's new token only needs detokenizing.
    """

    group: SequenceGroup
    index: int
    sampling: SamplingState
    detokenizer: ByteLevelDetokenizer | FinalTextDetokenizer | IncrementalDetokenizer
    logprobs: list[Logprobs] | None = None
    cumulative_logprob: float = 0.0
    num_processed: int = 0
    text_checked: int = 0  # characters of text already searched for stop strings
    stop_string_hit: str | None = None
    text_sent: int = 0
    tokens_sent: int = 0
    plain: bool = False

    def __post_init__(self) -> None:
        params = self.group.params
        self.plain = (  # a grammar's matcher may come later (once it compiles): read params
            params.logprobs is None
            and params.structured_outputs is None
            and not params.stop_strings
            and not params.use_beam_search  # a beam's group makes its text from its token ids
        )

    @property
    def params(self) -> SamplingParams:
        return self.group.params

    def process_new_tokens(
        self, request: Request, logprobs: list[Logprobs] | None, scheduler: Scheduler
    ) -> int:
        """After ``scheduler.update`` appended tokens: logprobs, grammar, detokenize, stop
        strings, token by token (``logprobs``: one entry per new token). A stop string ends
        the output at the token that completes it (a speculative run is cut there). Returns
        how many tokens were processed. (The output processor detokenizes the common decode
        itself: a ``plain`` running sequence's one new token.)"""
        output = request.output_token_ids
        first = self.num_processed
        for index in range(first, len(output)):
            token = output[index]
            if logprobs is not None and self.logprobs is not None:
                self.logprobs.append(logprobs[index - first])
                self.cumulative_logprob += logprobs[index - first][token]
            self._process_token(request, token, index, scheduler)
            if self.stop_string_hit is not None:
                del output[index + 1 :]  # the request is finished: its blocks are freed
                break
        num = len(output) - first
        self.num_processed = len(output)
        return num

    def _process_token(self, request: Request, token: int, index: int, scheduler) -> None:
        """Output token ``index``: only the last one of a step can have ended the request."""
        last = index == len(request.output_token_ids) - 1
        matcher = self.sampling.grammar_matcher
        if matcher is not None:
            matcher.accept_token(token)
            if matcher.is_terminated() and not request.is_finished:
                # a grammar that has ended (its stop token taken) ends the request even where
                # the stop token does not (ignore_eos)
                scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED, stop_reason=token)
        hidden_stop = (
            last
            and request.status is RequestStatus.FINISHED_STOPPED
            and request.stop_reason == token
        )
        if not hidden_stop:
            self.detokenizer.add_token(token)
        if last and request.is_finished:
            self.detokenizer.flush()
        if self.params.stop_strings:
            self._check_stop_strings(request, scheduler, index + 1)

    def _check_stop_strings(self, request: Request, scheduler, num_output: int) -> None:
        """``num_output``: output tokens up to the one just processed."""
        stops = self.params.stop_strings
        text = self.detokenizer.text
        if self.stop_string_hit is not None:
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
        scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED, stop_reason=stop)


@dataclass(eq=False)
class SequenceGroup:
    """The sequences of one request. ``sequences[i]`` is the scheduler Request of output i.

    ``pending_forks``: the other sequences of an ``n > 1`` request until its first sample, as
    (index, generator); they start with the tokens the runner drew for them."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seed: int = 0
    output_kind: RequestOutputKind = field(init=False)
    sequences: list[Request[SequenceState]] = field(default_factory=list)
    pending_forks: dict[str, int] = field(default_factory=dict)
    aborted: bool = False
    compiled_grammar: CompiledGrammar | None = None  # set once a structured output compiled
    # [None, {token 1: logprob, top-N...}, ...]: the first prompt token has no logprob
    prompt_logprobs: list[Logprobs | None] | None = None

    def __post_init__(self) -> None:
        self.output_kind = self.params.output_kind
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]

    @property
    def is_finished(self) -> bool:
        if self.aborted:
            return True
        sequences = self.sequences
        if len(sequences) == 1:  # the common case, without a generator per request per step
            return sequences[0].is_finished and not self.pending_forks
        return not self.pending_forks and all(s.is_finished for s in sequences)

    def child_request_id(self, index: int) -> str:
        return self.request_id if index == 0 else f"{self.request_id}#{index}"

    def sequence_state(self, index: int, sampling: SamplingState, tokenizer) -> SequenceState:
        """The output side of sequence ``index``."""
        return SequenceState(
            group=self,
            index=index,
            sampling=sampling,
            detokenizer=detokenizer_for(
                tokenizer,
                self.prompt_token_ids,
                self.params.skip_special_tokens,
                # FINAL_ONLY without stop strings: no text is read before the request ends
                final_text=self.output_kind is _FINAL_ONLY and not self.params.stop_strings,
            ),
            logprobs=[] if self.params.logprobs is not None else None,
        )

    def record_prompt_logprobs(self, start: int, entries: list[Logprobs]) -> bool:
        """Append the prompt logprobs of positions ``start``... (the entry at position p scores
        token p + 1); a position already recorded (a chunk recomputed after preemption) is not
        recorded twice. True once every prompt position is recorded."""
        recorded = self.prompt_logprobs
        for position, entry in enumerate(entries, start):
            if position + 1 == len(recorded):
                recorded.append(entry)
        return len(recorded) == len(self.prompt_token_ids)

    # ---- outputs -------------------------------------------------------------------------

    @property
    def has_new_output(self) -> bool:
        """Whether a step that touched this request makes it an output: always, except a
        FINAL_ONLY request, which has none until it finishes (vLLM's FINAL_ONLY)."""
        return self.output_kind is not _FINAL_ONLY or self.is_finished

    def num_output_tokens(self, output: RequestOutput) -> int:
        """Tokens generated in all, for the finished-request stats: ``output``'s when it is a
        snapshot, the sequences' own when it is a delta."""
        if self.output_kind is _DELTA:
            return sum(len(s.output_token_ids) for s in self.sequences)
        return sum(len(o.token_ids) for o in output.outputs)

    def visible_text(self, request: Request) -> str:
        """The text a caller may see now. While a sequence with stop strings runs, its last
        ``max(len(stop)) - 1`` characters are held back: they may yet begin a stop string that
        will be cut, and streamed text cannot be taken back."""
        state: SequenceState = request.payload
        text = state.detokenizer.text
        stops = self.params.stop_strings
        if not stops or request.is_finished or self.params.include_stop_str_in_output:
            return text
        hold = max(len(s) for s in stops) - 1
        return text[: max(0, len(text) - hold)]

    def completion(self, request: Request) -> CompletionOutput:
        """The sequence's whole output so far (CUMULATIVE and FINAL_ONLY)."""
        state: SequenceState = request.payload
        logprobs = state.logprobs
        return CompletionOutput(  # positional: this runs for every request at every step
            state.index,
            self.visible_text(request) if self.params.stop_strings else state.detokenizer.text,
            request.output_token_ids.copy(),
            None if logprobs is None else state.cumulative_logprob,
            None if logprobs is None else logprobs.copy(),
            request.status.finish_reason,
            None if request.stop_reason is None else self.stop_reason(request),
        )

    def completion_delta(self, request: Request) -> CompletionOutput:
        """What the sequence added since its last output (DELTA, vLLM's delta outputs): the
        new visible text, token ids and logprobs; ``cumulative_logprob`` stays cumulative.
        Visible text only grows (``visible_text`` holds back what a stop string may cut), so
        a delta never has to take text back."""
        state: SequenceState = request.payload
        logprobs = state.logprobs
        text = self.visible_text(request) if self.params.stop_strings else state.detokenizer.text
        tokens = request.output_token_ids
        text_sent, tokens_sent = state.text_sent, state.tokens_sent
        state.text_sent, state.tokens_sent = len(text), len(tokens)
        return CompletionOutput(
            state.index,
            text[text_sent:],
            tokens[tokens_sent:],
            None if logprobs is None else state.cumulative_logprob,
            None if logprobs is None else logprobs[tokens_sent:],
            request.status.finish_reason,
            None if request.stop_reason is None else self.stop_reason(request),
        )

    def running_output(self, request: Request, state: SequenceState) -> RequestOutput:
        """``make_output`` of the common request at each decode step (``is_plain_running``,
        its one sequence running and plain: unfinished, so no finish or stop reason; no
        logprobs; no stop strings, so all its text is visible), without the general checks:
        each microsecond here is a millisecond a step at a thousand requests. The output
        processor calls it directly for a plain decode, having made those checks itself."""
        text, tokens = state.detokenizer.text, request.output_token_ids
        if self.output_kind is _DELTA:
            text_sent, tokens_sent = state.text_sent, state.tokens_sent
            state.text_sent, state.tokens_sent = len(text), len(tokens)
            text, tokens = text[text_sent:], tokens[tokens_sent:]
        else:
            tokens = tokens.copy()
        cached = request.num_cached_tokens  # -1 until its first admission
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            [CompletionOutput(state.index, text, tokens, None, None, None, None)],
            False,
            cached if cached > 0 else 0,
            self.metrics,
        )

    def stop_reason(self, request: Request) -> int | str | None:
        """The stop string or stop token id that ended ``request``; None when it ended on EOS
        (vLLM's rule: EOS is no stop_reason, a token of ``stop_token_ids`` is)."""
        reason = request.stop_reason
        if isinstance(reason, int) and reason not in self.params.stop_token_ids:
            return None
        return reason

    @property
    def is_plain_running(self) -> bool:
        """One sequence, no fork pending, no prompt logprobs: a request whose running plain
        sequence's output is ``running_output``."""
        return len(self.sequences) == 1 and not self.pending_forks and self.prompt_logprobs is None

    def make_output(self) -> RequestOutput:
        """Every sequence's output: a snapshot of its whole text and tokens so far, or with
        ``output_kind`` DELTA what it added since the request's last output."""
        sequences = self.sequences
        first = sequences[0]
        state: SequenceState = first.payload
        if self.is_plain_running and state.plain and first.status is _RUNNING:
            return self.running_output(first, state)
        completion = self.completion_delta if self.output_kind is _DELTA else self.completion
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            [completion(first)] if len(sequences) == 1 else [completion(s) for s in sequences],
            self.is_finished,
            max(first.num_cached_tokens, 0),
            self.metrics,
            None if self.prompt_logprobs is None else list(self.prompt_logprobs),
            first.kv_transfer_params if first.is_finished else None,
        )
