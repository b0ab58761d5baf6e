"""Server-sent events and the client going away: SSE framing, the streaming response that aborts
its engine requests however it ends, and waiting on work unless the client disconnects first.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pagedserve.server.errors import APIError
from pagedserve.server.streams import EngineStreams, final_outputs


class ClientDisconnected(Exception):
    """The client went away before its response was ready; its requests have been aborted."""


async def until_disconnected(request: Request) -> None:
    """Returns when the client hangs up (call only after the body has been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work):
    """Await ``work`` (a coroutine); if the client disconnects first, cancel it and raise."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    raise ClientDisconnected()


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def error_event(error: APIError) -> str:
    return sse(json.dumps(error.body()))


class EngineStreamingResponse(StreamingResponse):
    """An SSE response that aborts its engine requests however the response ends.

    When the client goes away while a chunk is being *sent* (not while the body iterator waits
    for the engine), Starlette stops without closing the body iterator, so the ``finally`` in
    ``EngineStreams.__aiter__`` would only run when the garbage collector gets to it; until then
    the requests would go on computing for nobody. Cancelling here, after the response, in every
    case (done, disconnected, failed), frees their blocks at once.
    """

    def __init__(self, content: AsyncIterator[str], streams: EngineStreams) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self.streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.streams.cancel()


async def answer(
    request: Request,
    streams: EngineStreams,
    chunks: Callable[[EngineStreams], AsyncIterator[str]],
    body: Callable[[dict], object],
    stream: bool,
) -> Response:
    """A generation route's reply once its requests are submitted: the ``chunks`` as SSE when
    ``stream``, else one JSON ``body`` built from every final output (index -> output; ``body``
    may be a coroutine function). A client that leaves before either is a 499, and its requests
    are aborted."""
    try:
        await unless_disconnected(request, streams.admitted())
        if stream:
            return EngineStreamingResponse(chunks(streams), streams)
        finals = await unless_disconnected(request, final_outputs(streams))
    except ClientDisconnected:
        streams.cancel()
        return Response(status_code=499)
    result = body(finals)
    if inspect.isawaitable(result):
        result = await result
    return JSONResponse(result.model_dump())
