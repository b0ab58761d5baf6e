"""A streaming response aborts its engine requests however it ends — even when the client goes
away while a chunk is being sent, where Starlette leaves the body iterator unclosed."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import ClientDisconnect

from pagedserve.server.sse import EngineStreamingResponse


class FakeStreams:
    def __init__(self) -> None:
        self.cancelled = 0

    def cancel(self) -> None:
        self.cancelled += 1


async def endless_chunks():
    while True:
        yield "data: {}\n\n"
        await asyncio.sleep(0)


def run_response(spec_version: str, send) -> FakeStreams:
    streams = FakeStreams()
    response = EngineStreamingResponse(endless_chunks(), streams)
    scope = {"type": "http", "asgi": {"spec_version": spec_version}}

    async def receive():
        await asyncio.sleep(3600)  # the client never says goodbye in words

    async def main():
        await response(scope, receive, send)

    with pytest.raises(ClientDisconnect):
        asyncio.run(main())
    return streams


def test_disconnect_during_send_cancels_the_engine_requests():
    sent = []

    async def send(message):
        if message["type"] == "http.response.body" and len(sent) == 2:
            raise OSError("connection reset by peer")  # uvicorn: the socket is gone
        sent.append(message)

    streams = run_response("2.4", send)
    assert streams.cancelled == 1
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]


def test_completed_stream_also_cancels_once():
    async def finite():
        yield "data: [DONE]\n\n"

    streams = FakeStreams()
    response = EngineStreamingResponse(finite(), streams)

    async def send(message):
        return None

    async def receive():
        await asyncio.sleep(3600)

    async def main():
        await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)

    asyncio.run(main())
    assert streams.cancelled == 1  # cancel() on finished pumps is a no-op in EngineStreams
