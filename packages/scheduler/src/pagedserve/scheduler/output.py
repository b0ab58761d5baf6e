"""What one ``Scheduler.schedule`` call decides, and the counters it keeps (plain data).

A step is kept as columns, one entry per scheduled request in order (vLLM V1 keeps its cached
requests' data the same way): the model runner lays out the flat batch and ``Scheduler.update``
appends the sampled tokens by walking these lists, so a step of hundreds of decodes makes no
object per request. ``scheduled`` gives the same step as ``ScheduledRequest`` items, for
readers that want one object per request (the draft model, tools, tests).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
    block_table: Sequence[int]
    spec_token_ids: Sequence[int] = ()

    @property
    def needs_sample(self) -> bool:
        """True when this chunk reaches the last known token, whose logits give the next one."""
        end = self.num_computed_tokens + self.num_new_tokens
        return end == self.request.num_tokens + len(self.spec_token_ids)


class SchedulerOutput:
    """One step: what each scheduled request computes (the columns below, in order), the block
    copies to run first, the requests preempted while making room, and the sequences that
    finished since the last step (the runner forgets their sampling state).

    Entry i: ``requests[i]`` computes ``num_new_tokens[i]`` tokens from position
    ``num_computed_tokens[i]`` on, into the blocks ``block_ids[i]``. A speculative decode's
    proposals are in ``spec_token_ids`` under its request id (its entry counts them in its new
    tokens). ``block_ids[i]`` is the block manager's list, read-only: it is replaced, never
    changed in place, when the table changes. ``decode_token_ids[i]`` is the one token a decode
    feeds (its last known token, which the scheduler had in hand when it scheduled it), or -1 for
    any other entry, whose index is also in ``other_entries``: the model runner lays the runs of
    decodes between those out in bulk, without reading each request again. (An entry added
    through ``add`` is such an other entry even when it is a decode: the runner then reads the
    request, with the same result.)
    """

    def __init__(
        self,
        scheduled: Sequence[ScheduledRequest] = (),
        blocks_to_copy: list[tuple[int, int]] | None = None,
        preempted: list[Request] | None = None,
    ) -> None:
        self.requests: list[Request] = []
        self.num_computed_tokens: list[int] = []
        self.num_new_tokens: list[int] = []
        self.block_ids: list[Sequence[int]] = []
        self.decode_token_ids: list[int] = []
        self.other_entries: list[int] = []
        self.spec_token_ids: dict[str, list[int]] = {}
        self.blocks_to_copy = [] if blocks_to_copy is None else blocks_to_copy
        self.preempted = [] if preempted is None else preempted
        self.finished: list[Request] = []
        self.num_scheduled_tokens = 0
        # the KV connector's work in this step (kv_connector.py), for the model runner
        self.kv_connector_metadata: object | None = None
        # the images the runner encodes in this step, as (request, index in its images), and
        # the content hashes of the encoder cache's entries it drops first (encoder_cache.py)
        self.encoder_inputs: list[tuple[Request, int]] = []
        self.encoder_cache_freed: list[bytes] = []
        for item in scheduled:  # a hand-built step (tests, tools)
            self.add(item.request, item.num_computed_tokens, item.num_new_tokens, item.block_table)
            if item.spec_token_ids:
                self.spec_token_ids[item.request.request_id] = list(item.spec_token_ids)

    def add(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int, block_ids
    ) -> None:
        """Append one request's share of the step (its proposals go to ``spec_token_ids``)."""
        self.other_entries.append(len(self.requests))
        self.requests.append(request)
        self.num_computed_tokens.append(num_computed_tokens)
        self.num_new_tokens.append(num_new_tokens)
        self.block_ids.append(block_ids)
        self.decode_token_ids.append(-1)
        self.num_scheduled_tokens += num_new_tokens

    @property
    def scheduled(self) -> list[ScheduledRequest]:
        """The step as one item per request, in order (made on each read: a view)."""
        spec = self.spec_token_ids
        return [
            ScheduledRequest(request, start, count, ids, spec.get(request.request_id, ()))
            for request, start, count, ids in zip(
                self.requests, self.num_computed_tokens, self.num_new_tokens, self.block_ids
            )
        ]

    @property
    def num_scheduled_seqs(self) -> int:
        return len(self.requests)

    @property
    def num_spec_tokens(self) -> int:
        """Proposed tokens scheduled for verification in this step."""
        return sum(map(len, self.spec_token_ids.values()))

    @property
    def is_empty(self) -> bool:
        return not self.requests

    def __repr__(self) -> str:
        return (
            f"SchedulerOutput(scheduled={self.scheduled!r}, blocks_to_copy="
            f"{self.blocks_to_copy!r}, preempted={[r.request_id for r in self.preempted]!r})"
        )


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
    # cumulative: images the runner encoded, and images a request found already encoded
    encoder_cache_encoded: int = 0
    encoder_cache_hits: int = 0
