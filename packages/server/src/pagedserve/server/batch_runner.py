"""Answering batch lines: each line's request goes to the server's own app, in process, as many
at once as a budget of engine sequences allows.

``LineRunner`` sends a line's body to the app's route through httpx's ASGI transport, so a batch
line is answered by exactly the code that answers the same request over HTTP (its checks, chat
template, defaults, errors), with nothing but the priority changed. A 503 is not an answer: the
server was overloaded or draining, so the line is sent again after the Retry-After the server
gave; once the engine is dead (503 ``engine_dead``) it raises ``EngineDeadError`` instead.

``SequenceBudget`` caps the sequences batch lines hold in the engine at once (``run-batch``:
enough to keep the engine full; the Batch API: a share of ``--max-num-seqs``, the rest left to
interactive requests). ``run_lines`` dispatches lines in file order under it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import httpx
from starlette.routing import Route

from pagedserve.engine import EngineDeadError
from pagedserve.server.batch_lines import BatchLine, error_record, response_record

BASE_URL = "http://pagedserve.batch"  # the in-process app's address (never on a network)


def served_post_paths(app) -> frozenset[str]:
    """The paths of the app's POST routes that its models serve: the urls a batch line may
    name. A route for one kind of model (``runner``: generate or pooling, set by
    ``body_route``) counts only when a served model is of that kind, so /v1/embeddings is
    not a batch url of a server of generative models."""
    kinds = {state.engine.model_config.runner_type for state in app.state.models.states()}
    return frozenset(
        route.path
        for route in app.routes
        if isinstance(route, Route)
        and "POST" in route.methods
        and getattr(route.endpoint, "runner", None) in (None, *kinds)
    )


@dataclass
class LineAnswer:
    """A line's output line (``record``): ``succeeded`` when the server answered 2xx."""

    line: BatchLine
    record: dict
    succeeded: bool
    completion_tokens: int = 0

    def json(self) -> str:
        return json.dumps(self.record, ensure_ascii=False)


class LineRunner:
    """Answers batch lines through ``app`` (the ASGI app of ``build_app``), in process.

    ``priority``: the priority every request runs at (the Batch API's), else each line's own.
    ``api_key``: the app's key, sent as a client would.
    """

    def __init__(self, app, api_key: str | None = None, priority: int | None = None) -> None:
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.priority = priority
        # an exception that escapes the app (a bug) is a 500 for its line, not the batch's end
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        self._client = httpx.AsyncClient(
            transport=transport, base_url=BASE_URL, headers=headers, timeout=None
        )

    async def answer(self, line: BatchLine) -> LineAnswer:
        if line.error is not None:
            return LineAnswer(line, error_record(line), succeeded=False)
        body = line.body if self.priority is None else {**line.body, "priority": self.priority}
        while True:
            response = await self._client.post(line.url, json=body)
            if response.status_code != 503:
                break
            retry_after = _refused_for_now(response)
            await asyncio.sleep(retry_after)
        try:
            payload = response.json()
        except ValueError:
            message = response.text or "internal server error"
            payload = {"error": {"message": message, "type": "internal_server_error"}}
        usage = payload.get("usage") if isinstance(payload, dict) else None
        tokens = usage.get("completion_tokens") or usage.get("output_tokens") if usage else 0
        ok = 200 <= response.status_code < 300
        record = response_record(line, response.status_code, payload)
        return LineAnswer(line, record, ok, tokens if isinstance(tokens, int) else 0)

    async def aclose(self) -> None:
        await self._client.aclose()


def _refused_for_now(response: httpx.Response) -> float:
    """Seconds to wait before sending a line again that got a 503; raises if the engine is
    dead (no wait helps)."""
    try:
        error = response.json().get("error") or {}
    except (ValueError, AttributeError):
        error = {}
    if error.get("code") == "engine_dead":
        raise EngineDeadError(error.get("message", "the engine is not running"))
    try:
        return max(0.05, float(response.headers.get("retry-after", "1")))
    except ValueError:
        return 1.0


class SequenceBudget:
    """At most ``capacity`` engine sequences held by batch lines at once.

    A line takes ``BatchLine.num_sequences`` (capped at the capacity, so that a line wider than
    the whole budget still runs, alone) for as long as it runs. ``release`` is synchronous, so a
    task's done callback gives back what it took however the task ended (even cancelled before
    it started).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.in_use = 0
        self._freed = asyncio.Event()

    async def acquire(self, sequences: int) -> int:
        """Wait until ``sequences`` fit; returns what was taken (give it back to ``release``)."""
        taken = min(max(sequences, 1), self.capacity)
        while self.in_use + taken > self.capacity:
            self._freed.clear()
            await self._freed.wait()
        self.in_use += taken
        return taken

    def release(self, taken: int) -> None:
        self.in_use -= taken
        self._freed.set()


async def run_lines(
    lines: Iterable[BatchLine],
    runner: LineRunner,
    budget: SequenceBudget,
    on_answer: Callable[[LineAnswer], Awaitable[None] | None],
) -> None:
    """Answer ``lines``, started in their order, as many at once as ``budget`` allows;
    ``on_answer`` gets each answer as it arrives (in the order they finish).

    Error lines take no budget. Cancelling the call cancels the lines in flight (their requests
    are aborted in the engine) and gives no answer for them; an error of ``runner`` or
    ``on_answer`` (the engine died, a full disk) cancels the rest the same way and raises.
    """
    in_flight: set[asyncio.Task] = set()
    failures: list[BaseException] = []

    async def run_one(line: BatchLine) -> None:
        try:
            answer = await runner.answer(line)
            handled = on_answer(answer)
            if handled is not None:
                await handled
        except Exception as error:  # raised by run_lines itself, below
            failures.append(error)

    try:
        for line in lines:
            if failures:
                break
            taken = 0 if line.error is not None else await budget.acquire(line.num_sequences)
            task = asyncio.create_task(run_one(line))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
            task.add_done_callback(lambda _, taken=taken: budget.release(taken))
        while in_flight and not failures:
            await asyncio.wait(set(in_flight), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in list(in_flight):
            task.cancel()
        if in_flight:
            await asyncio.gather(*in_flight, return_exceptions=True)
    if failures:
        raise failures[0]
