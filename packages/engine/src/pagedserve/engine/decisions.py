"""What every kind of request answers at each step: decide from this step's logits, then apply.

``LLMEngine.step`` does not know what kind of request it runs. It hands each group (sampling,
n > 1 forks, beam search: sequence_group.py, beam_search.py) the rows of the step's logits that
belong to it; the group returns a ``StepDecision``. Sampling rows are not drawn one group at a
time: each group adds its rows to one ``SamplingBatch``, which the engine draws in a single
sampler call before any decision is read. ``scheduler.update`` then appends each decision's
tokens, and each decision applies the rest (detokenize, stop strings, forks, dropped beams)
through a ``StepContext``, which also tallies the step's tokens for the metrics.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from pagedserve.engine.sampler import Sampler, SamplerOutput, SamplingMetadata, select_rows
from pagedserve.engine.structured_output.manager import grammar_bitmask
from pagedserve.scheduler import Request, Scheduler

if TYPE_CHECKING:
    from pagedserve.engine.sequence_group import SequenceGroup, SequenceState


class StepDecision(Protocol):
    """One group's share of a step, between the sampler call and the outputs."""

    group: SequenceGroup

    def sampled_tokens(self) -> dict[str, int]:
        """Request id -> next token, for ``scheduler.update`` (read after the batch is drawn)."""
        ...

    def apply(self, ctx: StepContext) -> bool:
        """Everything after ``scheduler.update``; True when the group has news for its caller."""
        ...


@dataclass
class StepContext:
    """What a decision needs from the engine once the scheduler has appended the tokens."""

    scheduler: Scheduler
    tokenizer: object
    device: torch.device
    updated: set[str]  # ids of the requests that got a token from scheduler.update
    num_prompt_tokens: int = 0  # prompts of the requests that produced their first token now
    num_generation_tokens: int = 0
    now: float = field(default_factory=time.monotonic)  # every token of a step: one time
    inter_token_latencies: list[float] = field(default_factory=list)

    def record_token(self, group: SequenceGroup) -> None:
        """Stamp the group's token times; its prompt counts once, with its first token. The
        time since the group's previous token is an inter-token latency (a sibling's token in
        the same step is not a new interval)."""
        now = self.now
        metrics = group.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
            self.num_prompt_tokens += len(group.prompt_token_ids)
        elif now > metrics.last_token_time:
            self.inter_token_latencies.append(now - metrics.last_token_time)
        metrics.last_token_time = now


@dataclass
class SamplingBatch:
    """Every row that groups want sampled this step, drawn in one sampler call.

    ``add`` takes a row of ``logits``, the sequence state that samples it, and the request
    whose history the penalties read (None for a fork not yet born: its history is empty and
    its min_tokens rule is its parent's). It returns a slot; after ``sample``, ``token(slot)``
    and ``logprobs(slot)`` give that row's draw.
    """

    logits: torch.Tensor
    _rows: list[int] = field(default_factory=list)
    _states: list[SequenceState] = field(default_factory=list)
    _requests: list[Request | None] = field(default_factory=list)
    _output: SamplerOutput | None = None
    _token_ids: list[int] = field(default_factory=list)

    def add(self, row: int, state: SequenceState, request: Request | None) -> int:
        self._rows.append(row)
        self._states.append(state)
        self._requests.append(request)
        return len(self._rows) - 1

    def sample(self, sampler: Sampler) -> None:
        if not self._rows:
            return
        states, requests = self._states, self._requests
        groups = [s.group for s in states]
        meta = SamplingMetadata(
            params=[g.params for g in groups],
            generators=[s.generator for s in states],
            prompt_token_ids=[g.prompt_token_ids for g in groups],
            output_token_ids=[r.output_token_ids if r else [] for r in requests],
            masked_token_ids=[masked_tokens(r or g.sequences[0]) for r, g in zip(requests, groups)],
        )
        matchers = [s.grammar_matcher for s in states]
        if any(
            m is not None for m in matchers
        ):  # structured outputs: one bitmask for the constrained rows
            meta.allowed_token_mask, meta.allowed_token_rows = grammar_bitmask(
                matchers, self.logits.shape[-1]
            )
        self._output = sampler(select_rows(self.logits, self._rows), meta)
        self._token_ids = self._output.token_ids.tolist()

    def token(self, slot: int) -> int:
        return self._token_ids[slot]

    def logprobs(self, slot: int) -> dict[int, float] | None:
        num = self._states[slot].params.logprobs
        if num is None or self._output is None:
            return None
        return self._output.row_logprobs(slot, num)


def masked_tokens(request: Request) -> frozenset[int]:
    """Stop tokens may not be sampled before ``min_tokens`` tokens are out (vLLM's rule)."""
    if request.num_output_tokens < request.min_tokens:
        return request.stop_token_ids
    return frozenset()
