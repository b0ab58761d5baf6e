"""What one ``Scheduler.schedule`` call decides, and the counters it keeps (plain data)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedserve.scheduler.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: ``num_new_tokens`` tokens from ``num_computed_tokens`` on.

    A speculative decode runs its last known token and then ``spec_token_ids``, the proposals
    to verify (``num_new_tokens == 1 + len(spec_token_ids)``); their slots are allocated too.
    """

    request: Request
    num_computed_tokens: int
    num_new_tokens: int
    block_table: list[int]
    spec_token_ids: Sequence[int] = ()

    @property
    def needs_sample(self) -> bool:
        """True when this chunk reaches the last known token, whose logits give the next one."""
        end = self.num_computed_tokens + self.num_new_tokens
        return end == self.request.num_tokens + len(self.spec_token_ids)


@dataclass(slots=True)
class ScheduledDecodes:
    """The items of a step that the scheduler's decode fast path made, as parallel lists (vLLM
    V1's ``CachedRequestData``): each runs its one last known token, ``token_ids[i]``, at
    position ``num_computed_tokens[i]``, into the blocks ``block_ids[i]``. When they are every
    item of the step, the model runner builds the step's inputs from these lists alone, without
    reading each request again (``ModelRunner._prepare_decodes``)."""

    req_ids: list[str] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    block_ids: list[list[int]] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """One step: what each scheduled request computes, the block copies to run first, and the
    requests preempted while making room. ``decodes`` lists again, in order, the items that the
    decode fast path scheduled (empty for a hand-built output).

    The step's token counts are read several times a step (the engine, the metrics): the
    scheduler counts them while it schedules and records them with ``finish``; a hand-built
    output (tests) sums its requests on every read instead.
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    decodes: ScheduledDecodes = field(default_factory=ScheduledDecodes)
    _totals: tuple[int, int] | None = field(default=None, init=False, repr=False, compare=False)

    def finish(self, num_scheduled_tokens: int, num_spec_tokens: int) -> None:
        """Record the step's totals (the output is complete: nothing is scheduled after)."""
        self._totals = (num_scheduled_tokens, num_spec_tokens)

    @property
    def num_spec_tokens(self) -> int:
        """Proposed tokens scheduled for verification in this step."""
        if self._totals is not None:
            return self._totals[1]
        return sum(len(s.spec_token_ids) for s in self.scheduled)

    @property
    def num_scheduled_tokens(self) -> int:
        if self._totals is not None:
            return self._totals[0]
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    """A snapshot of the counters the engine exports as metrics.

    ``num_running``, ``num_waiting`` and ``num_waiting_tokens`` are current; ``num_preemptions``,
    ``num_steps`` and ``total_scheduled_tokens`` are cumulative; ``num_scheduled_tokens`` and
    ``num_scheduled_seqs`` describe the last step.
    """

    num_running: int = 0
    num_waiting: int = 0
    num_waiting_tokens: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    total_scheduled_tokens: int = 0
    num_scheduled_tokens: int = 0
    num_scheduled_seqs: int = 0
