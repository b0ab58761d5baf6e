"""The scheduler's refusals, raised by ``Scheduler.add_request`` so a request never waits forever.

``RequestRejectedError`` means the request can never run as asked (too long for the model, or more
KV blocks than the whole cache holds): retrying will not help, the server answers 400.
``SchedulerOverloadedError`` means the waiting queue is full right now: retrying later may help,
the server answers 503.
"""

from __future__ import annotations


class RequestRejectedError(ValueError):
    """The request can never be scheduled: it exceeds ``max_model_len`` or the whole KV cache.

    ``param`` names the request field at fault (``prompt`` or ``max_tokens``), so that the engine
    can tell its caller which field to change.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class SchedulerOverloadedError(RuntimeError):
    """The waiting queue is full (``max_num_waiting`` requests or ``max_num_waiting_tokens``)."""
