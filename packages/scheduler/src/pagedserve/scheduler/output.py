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
    V1's ``CachedRequestData``): ``requests[i]`` runs its one last known token, ``token_ids[i]``,
    at position ``num_computed_tokens[i]``, into the blocks ``block_ids[i]``. When they are every
    item of the step, the model runner builds the step's inputs and the scheduler's update
    appends the sampled tokens from these lists alone, and no ``ScheduledRequest`` is made."""

    requests: list[Request] = field(default_factory=list)
    req_ids: list[str] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    block_ids: list[list[int]] = field(default_factory=list)

    def item(self, index: int) -> ScheduledRequest:
        """Decode ``index`` as the item the general path would have made."""
        return ScheduledRequest(
            self.requests[index], self.num_computed_tokens[index], 1, self.block_ids[index]
        )

    def items(self, start: int) -> list[ScheduledRequest]:
        """The decodes from ``start`` on, as the items the general path would have made."""
        return [
            ScheduledRequest(request, num_computed, 1, ids)
            for request, num_computed, ids in zip(
                self.requests[start:], self.num_computed_tokens[start:], self.block_ids[start:]
            )
        ]


class SchedulerOutput:
    """One step: what each scheduled request computes (``scheduled``, in order), the block
    copies to run first, and the requests preempted while making room.

    The decode fast path records its items in ``decodes`` only; ``scheduled`` makes them into
    ``ScheduledRequest`` items when it is first read after them, so they keep their place in
    the order (the general path appends through it) and a pure-decode step that nobody reads
    item by item makes none (the runner and ``Scheduler.update`` read ``decodes`` then).

    The step's token counts are read several times a step (the engine, the metrics): the
    scheduler counts them while it schedules and records them with ``finish``; a hand-built
    output (tests) sums its requests on every read instead.
    """

    def __init__(
        self,
        scheduled: list[ScheduledRequest] | None = None,
        blocks_to_copy: list[tuple[int, int]] | None = None,
        preempted: list[Request] | None = None,
    ) -> None:
        self._scheduled = [] if scheduled is None else scheduled
        self.blocks_to_copy = [] if blocks_to_copy is None else blocks_to_copy
        self.preempted = [] if preempted is None else preempted
        self.decodes = ScheduledDecodes()
        self._num_listed = 0  # how many of ``decodes`` are in ``_scheduled`` already
        self._totals: tuple[int, int] | None = None

    @property
    def scheduled(self) -> list[ScheduledRequest]:
        """Every item of the step, in order (decodes not yet made into items are made now)."""
        num_decodes = len(self.decodes.requests)
        if self._num_listed < num_decodes:
            self._scheduled.extend(self.decodes.items(self._num_listed))
            self._num_listed = num_decodes
        return self._scheduled

    @property
    def num_scheduled_seqs(self) -> int:
        """How many items ``scheduled`` holds, without making any."""
        return len(self._scheduled) + len(self.decodes.requests) - self._num_listed

    @property
    def all_decodes(self) -> bool:
        """True when every item of a non-empty step is one of ``decodes``."""
        num_decodes = len(self.decodes.requests)
        return num_decodes > 0 and num_decodes == self.num_scheduled_seqs

    def __repr__(self) -> str:
        return (
            f"SchedulerOutput(scheduled={self.scheduled!r}, blocks_to_copy="
            f"{self.blocks_to_copy!r}, preempted={[r.request_id for r in self.preempted]!r})"
        )

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
        return not self.num_scheduled_seqs


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
