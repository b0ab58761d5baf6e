"""What every kind of request answers at each step: decide from this step's logits, then apply.

``LLMEngine.step`` does not know what kind of request it runs. It hands each group (sampling,
n > 1 forks, beam search: sequence_group.py, beam_search.py) the rows of the step's logits that
belong to it; the group returns a ``StepDecision``. Sampling rows are not drawn one group at a
time: each group adds its rows to one ``SamplingBatch``, which the engine draws in a single
sampler call before any decision is read. ``scheduler.update`` then appends each decision's
tokens, and each decision applies the rest (detokenize, stop strings, forks, dropped beams)
through a ``StepContext``, which also tallies the step's tokens for the metrics.

The plain path: most requests are one sequence drawn greedily or at a plain temperature, with
no penalty, bias, mask, grammar or logprobs. ``PlainRequests`` marks them once, when they are
added (vLLM's persistent batch keeps per-request sampling state across steps the same way,
instead of rebuilding it each step); their rows skip the per-group decisions and the per-row
metadata (``SamplingBatch.add_plain``), are drawn in one pass over the logits without a copy,
and their tokens are processed straight from ``scheduler.update``'s list. Every other request
takes the general path, and a step may mix both: each row's draw depends on its own logits
and generator only, so which pass draws a row does not change its token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from pagedserve.engine.sampler import (
    PlainSamplingMetadata,
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    select_rows,
)
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.structured_output.manager import grammar_bitmask
from pagedserve.kernels.sampling import GREEDY_TEMPERATURE
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

    ``add_plain`` takes a plain request's row instead (``PlainRequests``): no slot, no
    decision; after ``sample``, ``plain_tokens`` maps each plain request id to its token. The
    plain rows are drawn in one pass over the first ``num_rows`` rows of ``logits`` (a view,
    not a copy; a general row among them is drawn greedily there too and its token dropped),
    the general rows by the general path in the same sampler call, and every token comes to
    the host in one transfer.
    """

    logits: torch.Tensor
    num_rows: int = 0  # rows of ``logits`` that sample a next token (the plain pass's view)
    _rows: list[int] = field(default_factory=list)
    _states: list[SequenceState] = field(default_factory=list)
    _requests: list[Request | None] = field(default_factory=list)
    _output: SamplerOutput | None = None
    _token_ids: list[int] = field(default_factory=list)
    plain_ids: list[str] = field(default_factory=list)
    plain_rows: list[int] = field(default_factory=list)
    plain_states: list[SequenceState] = field(default_factory=list)
    plain_random: bool = False  # some plain row samples at a temperature
    plain_tokens: dict[str, int] = field(default_factory=dict)

    def add(self, row: int, state: SequenceState, request: Request | None) -> int:
        self._rows.append(row)
        self._states.append(state)
        self._requests.append(request)
        return len(self._rows) - 1

    def add_plain(self, row: int, request_id: str, state: SequenceState, random: bool) -> None:
        self.plain_rows.append(row)
        self.plain_ids.append(request_id)
        self.plain_states.append(state)
        self.plain_random |= random

    def sample(self, sampler: Sampler) -> None:
        if self.plain_ids:
            meta = self._plain_metadata()
            if self._rows:
                meta.general_rows, meta.general = self._rows, self._metadata()
            output = sampler(self.logits[: self.num_rows], meta)
        elif self._rows:
            output = sampler(select_rows(self.logits, self._rows), self._metadata())
        else:
            return
        self._output = output
        plain = output.plain_token_ids
        # one device-to-host transfer of the step's tokens
        tokens = (
            output.token_ids if plain is None else torch.cat([plain, output.token_ids])
        ).tolist()
        if not self.plain_ids:
            self._token_ids = tokens
        elif not self._rows:  # every row is plain: rows 0..n-1 in order
            self.plain_tokens = dict(zip(self.plain_ids, tokens))
        else:
            self._token_ids = tokens[self.num_rows :]
            self.plain_tokens = {i: tokens[r] for i, r in zip(self.plain_ids, self.plain_rows)}

    def _plain_metadata(self) -> PlainSamplingMetadata:
        """Per row of the view: its temperature and generator (a general row: greedy)."""
        if not self.plain_random:
            return PlainSamplingMetadata()
        temperature = [0.0] * self.num_rows
        generators: list[torch.Generator | None] = [None] * self.num_rows
        for row, state in zip(self.plain_rows, self.plain_states):
            temperature[row] = state.group.params.temperature
            generators[row] = state.generator
        return PlainSamplingMetadata(temperature, generators)

    def _metadata(self) -> SamplingMetadata:
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
        return meta

    def token(self, slot: int) -> int:
        return self._token_ids[slot]

    def logprobs(self, slot: int) -> dict[int, float] | None:
        num = self._states[slot].params.logprobs
        if num is None or self._output is None:
            return None
        return self._output.row_logprobs(slot, num)

    def apply_plain(self, updated: list[Request], ctx: StepContext) -> None:
        """The plain requests' new tokens, after ``scheduler.update`` appended them (a plain
        request that was not updated, finished before the update, has nothing to process)."""
        if len(self.plain_ids) == len(updated) and not self._rows:
            for request in updated:  # every updated request is plain: no lookups
                request.payload.process_new_token(request, None, ctx)
            return
        plain = self.plain_tokens
        for request in updated:
            if request.request_id in plain:
                request.payload.process_new_token(request, None, ctx)


def group_decisions(
    seq_ids: list[str],
    requests: dict[str, Request],
    batch: SamplingBatch,
    plain: PlainRequests,
    proposals: dict | None = None,
    verify=None,
) -> list[StepDecision]:
    """The general path: each row to its speculative verify (``proposals``: request id ->
    (drafts, draft rows), ``verify``: spec_decode/verify.py), to the plain pass (when enough
    rows are plain for it to pay) or to its group, which decides from all its rows. The
    speculative decisions come first."""
    proposals = proposals or {}
    spec_decisions: list[StepDecision] = []
    rows: dict[SequenceGroup, list[tuple[Request, int]]] = {}
    split = not proposals and plain.states and plain.worth_splitting(seq_ids)
    for row, seq_id in enumerate(seq_ids):
        if split and plain.add_row(batch, row, seq_id):
            continue
        request = requests[seq_id]
        if seq_id in proposals:
            drafts, draft_rows = proposals[seq_id]
            spec_decisions.append(verify.add(request, drafts, [*draft_rows, row]))
            continue
        group = request.payload.group
        if group in rows:
            rows[group].append((request, row))
        else:
            rows[group] = [(request, row)]
    return spec_decisions + [group.decide(group_rows, batch) for group, group_rows in rows.items()]


def sampled_tokens(
    batch: SamplingBatch, decisions: list[StepDecision]
) -> dict[str, int | list[int]]:
    """Request id -> next token(s) for ``scheduler.update``: the plain rows' map as it is,
    then each decision's."""
    if not decisions:
        return batch.plain_tokens
    sampled: dict[str, int | list[int]] = dict(batch.plain_tokens)
    for decision in decisions:
        sampled.update(decision.sampled_tokens())
    return sampled


def is_plain_sampling(params: SamplingParams) -> bool:
    """True when every draw of the request is one argmax or one temperature draw from its own
    generator: one sequence, nothing that reads its history or changes its logits (penalties,
    logit_bias, min_tokens, a grammar), top-k/top-p/min-p off, and no logprobs to report."""
    return (
        params.n == 1
        and not params.use_beam_search
        and params.logprobs is None
        and params.structured_outputs is None
        and params.min_tokens == 0
        and not params.logit_bias
        and params.repetition_penalty == 1.0
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
        and params.top_k == 0
        and params.top_p == 1.0
        and params.min_p == 0.0
    )


class PlainRequests:
    """The live requests whose rows take the plain path: request id -> sequence state.

    Registered once per request (``register``, at ``add_request``) and dropped when it leaves
    the engine, so a step finds its plain rows with one lookup each. ``enabled=False`` sends
    every request down the general path, the reference the plain path is tested against.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.states: dict[str, SequenceState] = {}
        self.random: set[str] = set()  # plain requests drawn at a temperature (not greedy)

    def register(self, request_id: str, state: SequenceState) -> None:
        self.discard(request_id)  # a reused id starts afresh
        params = state.group.params
        if self.enabled and is_plain_sampling(params):
            self.states[request_id] = state
            if params.temperature >= GREEDY_TEMPERATURE:
                self.random.add(request_id)

    def discard(self, request_id: str) -> None:
        if self.states.pop(request_id, None) is not None:
            self.random.discard(request_id)

    def add_all(self, batch: SamplingBatch, seq_ids: list[str]) -> bool:
        """Every row plain: add them all to ``batch`` (True), else add nothing (False)."""
        states = self.states
        if not all(map(states.__contains__, seq_ids)):
            return False
        batch.plain_ids = seq_ids
        batch.plain_rows = list(range(len(seq_ids)))
        batch.plain_states = [states[i] for i in seq_ids] if self.random else []
        batch.plain_random = bool(self.random) and any(map(self.random.__contains__, seq_ids))
        return True

    def add_row(self, batch: SamplingBatch, row: int, seq_id: str) -> bool:
        """Add ``seq_id``'s row to ``batch`` as a plain row when it is one (True)."""
        state = self.states.get(seq_id)
        if state is None:
            return False
        batch.add_plain(row, seq_id, state, seq_id in self.random)
        return True

    def worth_splitting(self, seq_ids: list[str]) -> bool:
        """A mixed step takes the plain pass when at least half its rows are plain: the pass
        reads every row, and below that the general path alone does less work."""
        return 2 * sum(map(self.states.__contains__, seq_ids)) >= len(seq_ids)


def masked_tokens(request: Request) -> frozenset[int]:
    """Stop tokens may not be sampled before ``min_tokens`` tokens are out (vLLM's rule)."""
    if request.num_output_tokens < request.min_tokens:
        return request.stop_token_ids
    return frozenset()
