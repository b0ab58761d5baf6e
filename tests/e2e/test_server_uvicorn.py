"""A real uvicorn server on 127.0.0.1 (``pagedserve serve``, tiny model, with an API key): the
official openai client sync and async, streaming and not; the key holds over raw HTTP whatever
the path's spelling; and an abort storm of 200 requests cut at random points frees every block."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import time

import httpx
import openai
import pytest

from pagedserve.server.testing import live_server

pytestmark = pytest.mark.slow  # one real server for the module: ~10 s to start

NAME = "tiny"
KEY = "sk-e2e-secret"
MESSAGES = [{"role": "user", "content": "Explain paged attention."}]


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    args = ("--served-model-name", NAME, "--max-model-len", "512", "--kv-cache-memory", "4MiB")
    with live_server(path, *args, api_key=KEY) as live:
        yield live


def test_openai_client_sync(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list()] == [NAME]
    params = dict(max_tokens=20, temperature=0.9, seed=4)
    whole = client.completions.create(model=NAME, prompt="The cat", **params)
    stream = client.completions.create(model=NAME, prompt="The cat", stream=True, **params)
    assert "".join(c.choices[0].text for c in stream if c.choices) == whole.choices[0].text
    chat = client.chat.completions.create(model=NAME, messages=MESSAGES, **params)
    stream = client.chat.completions.create(model=NAME, messages=MESSAGES, stream=True, **params)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == chat.choices[0].message.content
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_openai_client_async(server):
    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        params = dict(max_tokens=16, temperature=0.5, seed=9, n=2)
        whole, chat = await asyncio.gather(
            client.completions.create(model=NAME, prompt="Once upon", **params),
            client.chat.completions.create(model=NAME, messages=MESSAGES, **params),
        )
        stream = await client.completions.create(
            model=NAME, prompt="Once upon", stream=True, **params
        )
        texts = {0: "", 1: ""}
        async for chunk in stream:
            for choice in chunk.choices:
                texts[choice.index] += choice.text
        assert texts == {c.index: c.text for c in whole.choices}
        stream = await client.chat.completions.create(
            model=NAME, messages=MESSAGES, stream=True, **params
        )
        texts = {0: "", 1: ""}
        async for chunk in stream:
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
        assert texts == {c.index: c.message.content for c in chat.choices}
        await client.close()

    asyncio.run(run())


def raw_get(port: int, target: str, key: str | None = None) -> int:
    """Send the request line exactly as written (no client-side path cleaning)."""
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    request = f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Connection: close\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request.encode())
        status_line = sock.makefile("rb").readline().decode()
    return int(status_line.split()[1])


@pytest.mark.parametrize(
    "target",
    [
        "/v1/models",
        "//v1/models",
        "/v1/%6Dodels",
        "/health/../v1/models",
        "/health/%2e%2e/v1/models",
        "/./v1/./models/",
        "/v1%2fmodels",
        "/version",
    ],
)
def test_key_holds_for_every_spelling(server, target):
    assert raw_get(server.port, target) == 401
    assert raw_get(server.port, target, KEY) == 200
    assert raw_get(server.port, "/health") == 200
    assert raw_get(server.port, "/metrics") == 200  # open to Prometheus, as vLLM keeps it


def raw_exchange(port: int, head: str, body: bytes = b"") -> tuple[int, dict]:
    """Send a request head (and the start of a body); return the status and the JSON error."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head.encode() + body)
        response = sock.makefile("rb")
        status = int(response.readline().split()[1])
        while response.readline().strip():
            pass  # headers
        return status, json.loads(response.read().decode())


def test_http_limits_over_the_wire(server):
    """Oversized headers and a declared 20 MB body are refused in OpenAI's shape, before the
    body is read, and the server goes on serving."""
    auth = f"Authorization: Bearer {KEY}\r\n"
    junk = "X-Junk: " + "a" * 40_000 + "\r\n"
    status, body = raw_exchange(
        server.port, f"GET /v1/models HTTP/1.1\r\nHost: x\r\n{auth}{junk}Connection: close\r\n\r\n"
    )
    assert status == 431 and "headers" in body["error"]["message"]
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
        f"Content-Length: {20 * 2**20}\r\nConnection: close\r\n\r\n"
    )
    status, body = raw_exchange(server.port, head, b'{"prompt": "' + b"a" * 65536)
    assert status == 413 and body["error"]["type"] == "invalid_request_error"
    assert raw_get(server.port, "/health") == 200


async def _consume(client: httpx.AsyncClient, path: str, body: dict, cut_after: int | None):
    async with client.stream("POST", path, json=body) as response:
        events = 0
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events += 1
                if cut_after is not None and events >= cut_after:
                    return  # leaving the block closes the connection mid-stream


async def _abort_storm(server, count: int, concurrency: int, seed: int) -> None:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)
    async with httpx.AsyncClient(
        base_url=server.url, headers=server.headers, timeout=60, limits=limits
    ) as client:
        gate = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            chat = i % 2 == 0
            body = {"model": NAME, "max_tokens": 300, "ignore_eos": True, "n": 1 + (i % 3 == 0)}
            body.update({"messages": MESSAGES} if chat else {"prompt": f"Request {i} says"})
            path = "/v1/chat/completions" if chat else "/v1/completions"
            async with gate:
                if rng.random() < 0.5:  # cut by a timer: before headers, mid-stream, anywhere
                    body["stream"] = rng.random() < 0.7
                    task = asyncio.create_task(_consume(client, path, body, None))
                    await asyncio.sleep(rng.uniform(0.0, 0.4))
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                else:  # cut after a random number of SSE events
                    body["stream"] = True
                    await _consume(client, path, body, rng.randint(1, 40))

        await asyncio.gather(*(one(i) for i in range(count)))


def _fresh_request(server) -> None:
    response = httpx.post(
        server.url + "/v1/completions",
        headers=server.headers,
        json={"model": NAME, "prompt": "Fresh", "max_tokens": 8, "ignore_eos": True},
        timeout=5.0,
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 8


def _engine_is_empty(server) -> bool:
    """The gauges are those of the engine's last step: after a fresh request, its own (it freed
    its blocks in that step). A block held by any cut request would still show here."""
    return (
        server.metric("num_requests_in_flight") == 0
        and server.metric("num_requests_running") == 0
        and server.metric("num_requests_waiting") == 0
        and server.metric("kv_cache_usage_perc") == 0.0
    )


def test_abort_storm_frees_every_block(server):
    asyncio.run(_abort_storm(server, count=200, concurrency=16, seed=1234))
    # A fresh request completes at once. The server may still be turning away the last cut
    # clients (bodies read, disconnects noticed), so the emptiness is polled, each round behind
    # a fresh request; a leaked block or request would keep it from ever holding.
    for _ in range(50):
        _fresh_request(server)
        if _engine_is_empty(server):
            break
        time.sleep(0.1)
    assert _engine_is_empty(server)
    assert server.process.poll() is None
