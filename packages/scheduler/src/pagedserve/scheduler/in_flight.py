"""The steps the scheduler has handed out whose results have not come back yet.

One process runs a step between ``schedule`` and ``update``, so nothing is ever in flight when
the next step is scheduled. A pipeline of P stages keeps up to P steps in flight (the engine
schedules step N+1 while the later stages still work on step N; engine/llm_engine.py): the
stages would otherwise wait for each other, each idle (P - 1) / P of the time. The scheduler
then must not give a request a second step while its last one is in the pipeline, since its
next token is not known yet and its computed count has not moved (``update`` moves it). So a
request in flight is skipped; it is never a preemption victim (its step reads and writes its
blocks, and its seeded generator would draw for a step whose result is thrown away); and when
it is aborted, the model runner hears of it (``SchedulerOutput.finished``) only once its step
is back, so that the step's sampling still finds the request's state.

Blocks are safe without more: the stages run steps in the order they were scheduled, so a
block that a step in flight writes (a prefix another request hits, a block that an abort gave
back and a later step reuses) is written at every stage before any later step reads it there.
"""

from __future__ import annotations

from collections import deque

from pagedserve.scheduler.output import SchedulerOutput
from pagedserve.scheduler.request import Request


class StepsInFlight:
    """The scheduled, not yet updated steps, oldest first."""

    def __init__(self) -> None:
        self._steps: deque[SchedulerOutput] = deque()

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, output: SchedulerOutput) -> None:
        if output.requests:
            self._steps.append(output)

    def returned(self, output: SchedulerOutput) -> None:
        """``output``'s results are back (a step never added, such as an empty one, is none)."""
        if output in self._steps:  # by identity: a step is no value
            self._steps.remove(output)

    def request_ids(self) -> frozenset[int] | None:
        """The ``id()`` of every request in a step in flight; None when none is (one process,
        or a pipeline whose steps have all returned): the scheduler then checks nothing."""
        if not self._steps:
            return None
        return frozenset(id(r) for step in self._steps for r in step.requests)

    @staticmethod
    def split_finished(
        finished: list[Request], in_flight: frozenset[int] | None
    ) -> tuple[list[Request], list[Request]]:
        """The finished requests the runner may forget now, and those whose step is still in
        flight (reported in a later step's output)."""
        if in_flight is None:
            return finished, []
        now: list[Request] = []
        later: list[Request] = []
        for request in finished:
            (later if id(request) in in_flight else now).append(request)
        return now, later
