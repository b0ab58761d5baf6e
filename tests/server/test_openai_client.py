"""The official openai client, sync and async, streaming and not, against the app in-process."""

from __future__ import annotations

import httpx
import openai
import pytest

from pagedserve.server.testing import TINY_MODEL_NAME as MODEL_NAME

MESSAGES = [{"role": "user", "content": "What is a KV cache?"}]
SAMPLING = dict(max_tokens=16, temperature=0.7, seed=11)


@pytest.fixture(scope="module")
def sync_client(client):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client)


def test_sync_completions_and_chat(sync_client):
    whole = sync_client.completions.create(model=MODEL_NAME, prompt="Hello", **SAMPLING)
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.completion_tokens > 0
    stream = sync_client.completions.create(
        model=MODEL_NAME, prompt="Hello", stream=True, **SAMPLING
    )
    assert (
        "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == whole.choices[0].text
    )

    chat = sync_client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **SAMPLING)
    assert chat.choices[0].message.role == "assistant"
    chunks = list(
        sync_client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            stream=True,
            stream_options={"include_usage": True},
            **SAMPLING,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens


def test_sync_models_and_errors(sync_client):
    assert [m.id for m in sync_client.models.list()] == [MODEL_NAME]
    with pytest.raises(openai.BadRequestError) as bad:
        sync_client.completions.create(model=MODEL_NAME, prompt="x", temperature=-1)
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        sync_client.chat.completions.create(model="gpt-4", messages=MESSAGES)


@pytest.mark.anyio
async def test_async_completions_and_chat(app):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
        client = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="x", http_client=http)
        whole = await client.completions.create(model=MODEL_NAME, prompt="Hi there", **SAMPLING)
        stream = await client.completions.create(
            model=MODEL_NAME, prompt="Hi there", stream=True, **SAMPLING
        )
        text = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
        assert text == whole.choices[0].text

        chat = await client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=12, seed=5
        )
        stream = await client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=12, seed=5, stream=True
        )
        deltas = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        assert "".join(deltas) == chat.choices[0].message.content
