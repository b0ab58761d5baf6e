"""How a request's outputs are made, as its ``SamplingParams.output_kind`` asks.

CUMULATIVE: each output is a snapshot of every sequence's whole text and tokens so far.
DELTA (vLLM's delta outputs): only what each sequence added since the request's last output.
FINAL_ONLY: none until the request finishes (``has_new_output``), then one snapshot. While a
sequence with stop strings runs, the text it may still cut is held back (``visible_text``), so
neither kind ever takes text back.

``make_output`` has a lean path for the common request at each decode step (one running
sequence, no logprobs, no stop strings): a SequenceGroup's outputs are made for every running
request at every step, so each microsecond here is a millisecond at a thousand requests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.engine.outputs import CompletionOutput, RequestOutput
from pagedserve.engine.sampling_params import RequestOutputKind
from pagedserve.scheduler import Request, RequestStatus

if TYPE_CHECKING:
    from pagedserve.engine.sequence_group import SequenceState

_RUNNING = RequestStatus.RUNNING
_DELTA = RequestOutputKind.DELTA
_FINAL_ONLY = RequestOutputKind.FINAL_ONLY


class GroupOutputs:
    """The output half of ``SequenceGroup`` (a mixin: it reads the group's fields)."""

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

    def stop_reason(self, request: Request) -> int | str | None:
        """The stop string or stop token id that ended ``request``; None when it ended on EOS
        (vLLM's rule: EOS is no stop_reason, a token of ``stop_token_ids`` is)."""
        reason = request.stop_reason
        if isinstance(reason, int) and reason not in self.params.stop_token_ids:
            return None
        return reason

    def make_output(self) -> RequestOutput:
        """Every sequence's output: a snapshot of its whole text and tokens so far, or with
        ``output_kind`` DELTA what it added since the request's last output."""
        sequences = self.sequences
        first = sequences[0]
        state: SequenceState = first.payload
        if (
            len(sequences) == 1
            and state.plain
            and first.status is _RUNNING
            and self.prompt_logprobs is None
            and state.lean_path_enabled
        ):
            return self._running_plain_output(first, state)
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
        )

    def _running_plain_output(self, request: Request, state: SequenceState) -> RequestOutput:
        """``make_output``'s lean path, for the common request at each decode step: one
        running sequence (so the request is unfinished: no finish or stop reason), no
        logprobs, no stop strings (all its text is visible). Gives what the general path
        gives (tests/engine/test_lean_paths.py runs both)."""
        text = state.detokenizer.text
        tokens = request.output_token_ids
        if self.output_kind is _DELTA:
            text_sent, tokens_sent = state.text_sent, state.tokens_sent
            state.text_sent, state.tokens_sent = len(text), len(tokens)
            completion = CompletionOutput(
                state.index, text[text_sent:], tokens[tokens_sent:], None, None, None, None
            )
        else:
            completion = CompletionOutput(state.index, text, tokens.copy(), None, None, None, None)
        cached = request.num_cached_tokens  # -1 until its first admission
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            [completion],
            False,
            cached if cached > 0 else 0,
            self.metrics,
        )
