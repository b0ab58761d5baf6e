"""A user's request as the engine keeps it: one or more sequences that share a prompt.

The scheduler sees sequences (``scheduler.Request``); a user sees requests. With ``n == 1`` a
request is one sequence under the request's own id. With ``n > 1`` the request starts as one
sequence; when its prompt has been read (its first sample), it forks into ``n`` sequences that
share the prompt's blocks, each drawing its own first token from the same logits. Beam search
(beam_search.py) is a group too, whose sequences are its live beams.

Each sequence carries a ``SequenceState`` in ``Request.payload``: its generator, detokenizer,
stop-string scan and logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.scheduler import Request


@dataclass(eq=False)
class SequenceState:
    """What the engine keeps per sequence beyond the scheduler's view (``Request.payload``)."""

    group: SequenceGroup
    index: int
    generator: torch.Generator
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0
    text_checked: int = 0  # characters of text already searched for stop strings
    stop_string_hit: str | None = None

    @property
    def params(self) -> SamplingParams:
        return self.group.params

    @property
    def needs_prompt_logits(self) -> bool:
        """True while this request's prompt logprobs are incomplete (the model runner reads it
        to also compute the logits of prompt positions)."""
        group = self.group
        return (
            self.index == 0
            and group.prompt_logprobs is not None
            and len(group.prompt_logprobs) < len(group.prompt_token_ids)
        )

    def record_logprobs(self, token_logprobs: dict[int, float], token: int) -> None:
        if self.logprobs is not None:
            self.logprobs.append(token_logprobs)
            self.cumulative_logprob += token_logprobs[token]


@dataclass(eq=False)
class SequenceGroup:
    """The sequences of one request. ``sequences[i]`` is the scheduler Request of output i."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seed: int = 0
    sequences: list[Request] = field(default_factory=list)
    forked: bool = False
    aborted: bool = False
    # [None, {token 1: logprob, top-N...}, ...]: the first prompt token has no logprob
    prompt_logprobs: list[dict[int, float] | None] | None = None

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]

    @property
    def needs_fork(self) -> bool:
        """True until an ``n > 1`` request has split into its ``n`` sequences."""
        return self.params.n > 1 and not self.forked

    @property
    def is_finished(self) -> bool:
        return self.aborted or (not self.needs_fork and all(s.is_finished for s in self.sequences))

    def child_request_id(self, index: int) -> str:
        return self.request_id if index == 0 else f"{self.request_id}#{index}"

    def new_state(self, index: int, tokenizer, device: torch.device) -> SequenceState:
        """The state of sequence ``index``; sequence i draws from a generator seeded ``seed + i``."""
        return SequenceState(
            group=self,
            index=index,
            generator=torch.Generator(device=device).manual_seed((self.seed + index) % 2**64),
            detokenizer=IncrementalDetokenizer(
                tokenizer, self.prompt_token_ids, self.params.skip_special_tokens
            ),
            logprobs=[] if self.params.logprobs is not None else None,
        )

    def visible_text(self, request: Request) -> str:
        """The text a caller may see now. While a sequence with stop strings runs, its last
        ``max(len(stop)) - 1`` characters are held back: they may yet begin a stop string that
        will be cut, and streamed text cannot be taken back."""
        state: SequenceState = request.payload
        text = state.detokenizer.text
        stops = self.params.stop_strings
        if request.is_finished or not stops or self.params.include_stop_str_in_output:
            return text
        hold = max(len(s) for s in stops) - 1
        return text[: max(0, len(text) - hold)]

    def completion(self, request: Request) -> CompletionOutput:
        state: SequenceState = request.payload
        return CompletionOutput(
            index=state.index,
            text=self.visible_text(request),
            token_ids=list(request.output_token_ids),
            cumulative_logprob=state.cumulative_logprob if state.logprobs is not None else None,
            logprobs=list(state.logprobs) if state.logprobs is not None else None,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
        )

    def make_output(self) -> RequestOutput:
        """A cumulative snapshot: every sequence's whole text and tokens so far."""
        first = self.sequences[0]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[self.completion(s) for s in self.sequences],
            finished=self.is_finished,
            num_cached_tokens=max(first.num_cached_tokens, 0),
            metrics=self.metrics,
            prompt_logprobs=None if self.prompt_logprobs is None else list(self.prompt_logprobs),
        )
