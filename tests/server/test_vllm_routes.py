"""vLLM's routes beyond OpenAI's: batched chat (one choice per conversation), SageMaker's
/invocations and /ping, and GET /load, which counts the generation requests being served."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from starlette.testclient import TestClient

from pagedserve.server.app import build_app
from pagedserve.server.config import ServerConfig
from pagedserve.server.testing import TINY_MODEL_NAME as MODEL

CONVERSATIONS = [
    [{"role": "user", "content": "Reply with exactly the word: alpha"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "And beta?"}],
    [{"role": "user", "content": "Count to three"}],
]
GREEDY = {"max_tokens": 5, "temperature": 0}


@pytest.fixture(scope="module")
def oai(client):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client)


def test_batched_chat_answers_each_conversation_as_the_chat_route_does(client, oai):
    """Choice i of the batch is what /v1/chat/completions answers conversation i (greedy)."""
    response = client.post(
        "/v1/chat/completions/batch",
        json={"model": MODEL, "messages": CONVERSATIONS, **GREEDY, "logprobs": True},
    )
    assert response.status_code == 200, response.text
    batch = response.json()
    assert batch["object"] == "chat.completion"
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2]
    singles = [
        oai.chat.completions.create(model=MODEL, messages=m, logprobs=True, **GREEDY)
        for m in CONVERSATIONS
    ]
    for choice, single in zip(batch["choices"], singles, strict=True):
        assert choice["message"]["content"] == single.choices[0].message.content
        assert choice["finish_reason"] == single.choices[0].finish_reason
        tokens = [t["token"] for t in choice["logprobs"]["content"]]
        assert tokens == [t.token for t in single.choices[0].logprobs.content]
    for field in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert batch["usage"][field] == sum(getattr(s.usage, field) for s in singles)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"stream": True}, "stream"),
        ({"n": 2}, "n"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"messages": []}, "messages"),
        ({"messages": [[]]}, "messages.0"),
        ({"messages": CONVERSATIONS * 6}, "messages"),  # past --max-prompts (16)
    ],
)
def test_batched_chat_refuses_what_it_does_not_do_by_name(client, extra, param):
    body = {"model": MODEL, "messages": CONVERSATIONS, **GREEDY, **extra}
    response = client.post("/v1/chat/completions/batch", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_invocations_answers_chat_and_completion_bodies_as_their_routes(client, oai):
    messages = CONVERSATIONS[0]
    chat = client.post("/invocations", json={"messages": messages, **GREEDY}).json()
    expected = oai.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["content"] == expected.choices[0].message.content
    completion = client.post("/invocations", json={"prompt": "Once upon", **GREEDY}).json()
    expected = oai.completions.create(model=MODEL, prompt="Once upon", **GREEDY)
    assert completion["object"] == "text_completion"
    assert completion["choices"][0]["text"] == expected.choices[0].text
    streamed = client.post("/invocations", json={"prompt": "Once upon", **GREEDY, "stream": True})
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.text.rstrip().endswith("data: [DONE]")
    neither = client.post("/invocations", json={"input": "hi"})
    assert neither.status_code == 400
    assert "Cannot find suitable handler for request" in neither.json()["error"]["message"]
    bad_chat = client.post("/invocations", json={"messages": "hi"})
    assert bad_chat.status_code == 400 and bad_chat.json()["error"]["param"] == "messages"


def test_ping_is_health_and_open_under_an_api_key(engine):
    http = TestClient(build_app(engine, ServerConfig(api_key="sk-k"), MODEL))
    assert http.get("/ping").json() == {"status": "ok"}
    assert http.post("/ping").status_code == 200
    assert http.get("/load").status_code == 401  # /load is guarded like /version


async def load_while_streaming(app) -> tuple[int, int]:
    """(GET /load while a streamed completion is held after its first chunk, after it ends).

    The stream is driven at the ASGI level, so the test holds it mid-response for as long as
    it likes: its ``send`` waits after the first chunk until /load has been read."""
    body = json.dumps({"prompt": "Hello", "max_tokens": 8, "stream": True}).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "server": ("testserver", 80),
        "client": ("127.0.0.1", 1234),
    }
    first_chunk, release = asyncio.Event(), asyncio.Event()
    requested = False

    async def receive():
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": body, "more_body": False}
        await release.wait()
        await asyncio.sleep(3600)  # the client stays connected

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            first_chunk.set()
            await release.wait()

    streaming = asyncio.create_task(app(scope, receive, send))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
        await asyncio.wait_for(first_chunk.wait(), 30)
        during = (await http.get("/load")).json()["server_load"]
        release.set()
        await asyncio.wait_for(streaming, 30)
        after = (await http.get("/load")).json()["server_load"]
    return during, after


@pytest.mark.anyio
@pytest.mark.parametrize("tracking", [True, False])
async def test_load_counts_the_generation_requests_being_served(engine, tracking):
    """With --enable-server-load-tracking a stream counts 1 until its last chunk is sent;
    without it /load reads 0 whatever is served."""
    app = build_app(engine, ServerConfig(enable_server_load_tracking=tracking), MODEL)
    assert await load_while_streaming(app) == (int(tracking), 0)
