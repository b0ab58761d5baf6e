"""Background work: requests that yield every step in which a more important prompt is read.

Under the priority policy, ``SchedulerConfig.background_priority`` marks the requests at that
priority value or above (the server's Batch API lines) as background work. A step in which a
request that matters more reads its prompt (it waits to be admitted, or its prefill is under
way) runs no background request and admits none, so an interactive request's first token is
computed beside interactive work only, never beside a step's budget of batch prompts and
decodes. The policy keeps ``running`` in priority order, so the background requests are its
tail and the step simply stops before them.

Whether the step will read such a prompt is known only once its admissions are tried:
``num_runnable`` predicts it (a more important request waits at the head, or is part-way
through its prompt), and when the waiting head then cannot start after all (the blocks it was
counted on went to a running request's decode first), the scheduler runs the background
requests it held back in the same step. So background work yields exactly to prompts that are
read, and a prompt that needs the blocks background work holds makes its room by preemption
(``Scheduler._make_room_for_priority``) instead of waiting for a background request that would
never run again.

One exception keeps this live too: an interactive request that waits for a LoRA adapter slot does
not hold background work back, since the background requests that hold the slot would then never
finish and free it.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable

from pagedserve.scheduler.output import SchedulerOutput
from pagedserve.scheduler.queue import WaitingQueue
from pagedserve.scheduler.request import Request


def num_runnable(
    running: list[Request],
    waiting: WaitingQueue,
    background: int | None,
    adapter_fits: Callable[[Request], bool],
) -> int:
    """How many of ``running`` (in policy order) run this step: all of them, or, while
    background work yields, those before the background ones. The scan for prompts runs only
    when background work runs."""
    if background is None or not running or running[-1].priority < background:
        return len(running)
    num_foreground = bisect.bisect_left(running, background, key=_priority)
    waiting_head = waiting.first_ready() if waiting else None
    if (
        waiting_head is not None
        and waiting_head.priority < background
        and adapter_fits(waiting_head)
    ) or any(
        reads_its_prompt(r, r.num_computed_tokens)
        for r in itertools.islice(running, num_foreground)
    ):
        return num_foreground
    return len(running)


def reads_a_prompt(output: SchedulerOutput, background: int) -> bool:
    """Whether the step so far reads the prompt of a request more important than background
    work (then no background request is admitted in it)."""
    return any(
        r.priority < background and reads_its_prompt(r, start)
        for r, start in zip(output.requests, output.num_computed_tokens)
    )


def reads_its_prompt(request: Request, start: int) -> bool:
    """A chunk from ``start`` computes more than the last known token: a prompt (or, after a
    preemption, its recomputation), not a decode."""
    return start + 1 < len(request.prompt_token_ids) + len(request.output_token_ids)


def _priority(request: Request) -> int:
    return request.priority
