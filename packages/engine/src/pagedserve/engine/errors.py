"""Every error the engine raises to its callers, in one module that imports nothing of the engine.

Two kinds, and a caller (the server) needs to tell them apart:

- the request is at fault: ``InvalidRequestError`` (a ValueError) names the field at fault in
  ``param``, so the server can answer a 400 in OpenAI's shape. SamplingParams raises it for its
  own fields, ``LLMEngine.add_request`` for what only the model can judge (vocabulary, context
  length). ``SchedulerOverloadedError`` (from the scheduler, re-exported here) means the waiting
  queue is full right now: retrying later may help, a 503.
- the engine is at fault: ``EngineError`` and its kinds. The engine cannot go on, and every
  pending request fails with it.

Nothing here imports torch or the rest of the engine, so any module of the engine (the
distributed executor included) can import it without an import cycle.
"""

from __future__ import annotations

from pagedserve.scheduler import RequestRejectedError, SchedulerOverloadedError

__all__ = [
    "DistributedError",
    "EngineDeadError",
    "EngineError",
    "InvalidRequestError",
    "RequestRejectedError",
    "SchedulerOverloadedError",
]


class InvalidRequestError(ValueError):
    """The request can never be served as asked; ``param`` is the name of the field at fault.

    ``param`` uses the engine's names (SamplingParams's fields, ``prompt``); a server renames
    them to its API's where they differ (``logprobs`` -> ``top_logprobs`` in chat).
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineError(RuntimeError):
    """The engine cannot go on (the step loop died); every pending request fails with it."""


class EngineDeadError(EngineError):
    """The engine loop has stopped (it crashed, or was shut down); no request can be served."""


class DistributedError(EngineError):
    """A tensor- or pipeline-parallel rank died or stopped answering; the engine cannot go on."""
