"""Compilation off the engine step, and the one bitmask per step for the constrained rows.

A constrained request is queued at once but held in the scheduler's waiting queue
(``Request.waiting_for_grammar``) while its grammar compiles in a thread pool; the engine polls
the futures at the start of each step and releases what is ready (or fails the request whose
constraint does not compile, and only that one). Compiled grammars are cached by constraint, so
the thousandth request with the same schema is ready at once. The backend itself (reading the
tokenizer's vocabulary: about a second) is built in the pool too, on the first constrained
request, so an engine that never sees one never pays for it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from pagedserve.engine.structured_output.backend import (
    CompiledGrammar,
    GrammarMatcher,
    StructuredOutputBackend,
)
from pagedserve.engine.structured_output.params import StructuredOutputsParams
from pagedserve.scheduler import Request

MAX_CACHED_GRAMMARS = 512


class StructuredOutputManager:
    def __init__(
        self, backend_factory: Callable[[], StructuredOutputBackend], max_workers: int = 2
    ) -> None:
        self._backend_factory = backend_factory
        self._backend: StructuredOutputBackend | None = None
        self._backend_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._max_workers = max_workers
        self._cache: OrderedDict[tuple, Future[CompiledGrammar]] = OrderedDict()
        self._held: dict[str, tuple[Request, Future[CompiledGrammar]]] = {}

    def backend(self) -> StructuredOutputBackend:
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._backend_factory()
            return self._backend

    def submit(self, params: StructuredOutputsParams) -> Future[CompiledGrammar]:
        """The compiled grammar of ``params``, as a future (done at once on a cache hit). A
        constraint that does not compile ends its future with ``InvalidRequestError``."""
        key = params.cache_key()
        future = self._cache.get(key)
        if future is not None:
            self._cache.move_to_end(key)
            return future
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._max_workers, "pagedserve-grammar")
        future = self._pool.submit(lambda: self.backend().compile(params))
        self._cache[key] = future
        if len(self._cache) > MAX_CACHED_GRAMMARS:
            self._cache.popitem(last=False)
        return future

    @property
    def num_held(self) -> int:
        return len(self._held)

    def hold(self, request: Request, params: StructuredOutputsParams) -> None:
        """Start compiling ``request``'s grammar; it waits in the queue until it is ready."""
        request.waiting_for_grammar = True
        self._held[request.request_id] = (request, self.submit(params))

    def release(
        self, timeout: float = 0.0
    ) -> tuple[list[tuple[Request, CompiledGrammar]], list[tuple[Request, BaseException]]]:
        """The held requests whose compile has ended: (ready, grammar) and (failed, error).

        With ``timeout``, first wait that long for one to end (an engine with nothing else to
        run waits here rather than spinning). Requests that finished meanwhile (aborted) are
        dropped. A ready request is no longer held: the scheduler may admit it."""
        if timeout and self._held:
            wait([f for _, f in self._held.values()], timeout, return_when=FIRST_COMPLETED)
        ready, failed = [], []
        for request_id, (request, future) in list(self._held.items()):
            if not future.done() and not request.is_finished:
                continue
            del self._held[request_id]
            if request.is_finished:
                continue
            error = future.exception()
            if error is None:
                request.waiting_for_grammar = False
                ready.append((request, future.result()))
            else:
                failed.append((request, error))
        return ready, failed

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def grammar_bitmask(
    matchers: Sequence[GrammarMatcher | None], vocab_size: int
) -> tuple[torch.Tensor, list[int]] | None:
    """This step's packed bitmask ``[rows, ceil(vocab_size / 32)]`` (int32, on the CPU) and the
    rows it constrains; None when no row is constrained. Unconstrained rows are all ones."""
    rows = [row for row, matcher in enumerate(matchers) if matcher is not None]
    if not rows:
        return None
    bitmask = torch.full((len(matchers), -(-vocab_size // 32)), -1, dtype=torch.int32)
    for row in rows:
        matchers[row].fill_bitmask(bitmask, row)
    return bitmask, rows
