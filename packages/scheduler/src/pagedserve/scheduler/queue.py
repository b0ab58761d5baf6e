"""The waiting queue, in the order the scheduling policy admits requests.

``fcfs``: first come, first served. New requests join the back; a preempted request returns to
the front, ahead of everything that arrived after it (it was admitted before them).
``priority``: lower ``priority`` value first, then earlier arrival. A preempted request returns
to its place in that order.

Both keep a running count of the tokens they hold, for the waiting-token cap. A request does not
change while it waits, so adding its ``num_tokens`` on entry and subtracting it on exit is exact.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator

from pagedserve.scheduler.request import Request


def policy_key(request: Request) -> tuple[int, float, int]:
    """Order of the priority policy: lower priority value first, then arrival."""
    return (request.priority, request.arrival_time, request.arrival_order)


class WaitingQueue:
    """Base: the token count and what both policies share; subclasses decide where a request
    goes in (``add``, ``add_preempted``) and how the head comes out (``_pop_head``)."""

    def __init__(self, queue: deque[Request] | list[Request]) -> None:
        self._queue = queue
        self.num_tokens = 0

    def add(self, request: Request) -> None:
        """A new request joins the queue."""
        raise NotImplementedError

    def add_preempted(self, request: Request) -> None:
        """A preempted request returns to the queue, ahead of later arrivals."""
        raise NotImplementedError

    def _pop_head(self) -> Request:
        raise NotImplementedError

    def peek(self) -> Request:
        return self._queue[0]

    def first_ready(self) -> Request | None:
        """The first request, in policy order, that is not held (``Request.is_held``: its
        grammar compiling, its KV blocks arriving): a held request lets the ones behind it
        pass (vLLM's rule for both)."""
        head = self._queue[0]
        if not head.is_held:
            return head
        return next((r for r in self._queue if not r.is_held), None)

    def take(self, request: Request) -> None:
        """Remove ``request`` (the head, in the common case) as it is admitted."""
        if request is self._queue[0]:
            self.pop()
        else:
            self.remove(request)

    def pop(self) -> Request:
        request = self._pop_head()
        self.num_tokens -= request.num_tokens
        return request

    def remove(self, request: Request) -> None:
        self._queue.remove(request)
        self.num_tokens -= request.num_tokens

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def __bool__(self) -> bool:
        return len(self._queue) > 0


class FCFSQueue(WaitingQueue):
    def __init__(self) -> None:
        super().__init__(deque())

    def add(self, request: Request) -> None:
        self._queue.append(request)
        self.num_tokens += request.num_tokens

    def add_preempted(self, request: Request) -> None:
        self._queue.appendleft(request)
        self.num_tokens += request.num_tokens

    def _pop_head(self) -> Request:
        return self._queue.popleft()


class PriorityQueue(WaitingQueue):
    """A list kept sorted by ``policy_key``; the head is at index 0."""

    def __init__(self) -> None:
        super().__init__([])

    def add(self, request: Request) -> None:
        bisect.insort(self._queue, request, key=policy_key)
        self.num_tokens += request.num_tokens

    add_preempted = add

    def _pop_head(self) -> Request:
        return self._queue.pop(0)


def make_waiting_queue(policy: str) -> WaitingQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}: use 'fcfs' or 'priority'")
