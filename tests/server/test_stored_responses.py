"""Stored responses through the openai client: a stored response is found again by GET until
DELETE; a missing one is a 404 in OpenAI's shape; ``previous_response_id`` continues the
conversation exactly as sending the whole history would (the chat route's prompt), and its
prompt is served from the prefix cache (the hit counter of /metrics moves by the earlier turn's
full blocks); the store keeps at most ``--responses-store-max`` responses."""

from __future__ import annotations

import re

import openai
import pytest
from starlette.testclient import TestClient

from pagedserve.server.app import build_app
from pagedserve.server.config import ServerConfig
from pagedserve.server.testing import TINY_MODEL_NAME as MODEL

BLOCK_SIZE = 16  # the engine's default block size


@pytest.fixture(scope="module")
def engine(roomy_engine):
    return roomy_engine


@pytest.fixture(scope="module")
def oai(client):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)


def test_a_stored_response_is_found_until_deleted(oai):
    response = oai.responses.create(model=MODEL, input="Name a cache.", max_output_tokens=4)
    assert response.store is True
    found = oai.responses.retrieve(response.id)
    assert found.model_dump() == response.model_dump()
    assert oai.responses.delete(response.id) is None
    with pytest.raises(openai.NotFoundError) as missing:
        oai.responses.retrieve(response.id)
    assert set(missing.value.body) == {"message", "type", "param", "code"}
    with pytest.raises(openai.NotFoundError):
        oai.responses.delete(response.id)


def test_store_false_keeps_nothing(oai):
    response = oai.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(response.id)


def prefix_cache_hits(client) -> float:
    text = client.get("/metrics").text
    return sum(
        map(float, re.findall(r"^pagedserve:prefix_cache_hits_total\{[^}]*\} (\S+)$", text, re.M))
    )


def test_previous_response_id_continues_the_conversation_from_the_prefix_cache(oai, client):
    first = oai.responses.create(
        model=MODEL,
        input="Why are KV caches paged? Explain blocks.",
        instructions="Answer briefly.",
        max_output_tokens=6,
        temperature=0,
    )
    hits = prefix_cache_hits(client)
    second = oai.responses.create(
        model=MODEL,
        input="And what is a block table?",
        instructions="Answer briefly.",
        previous_response_id=first.id,
        max_output_tokens=6,
        temperature=0,
    )
    chat = oai.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Why are KV caches paged? Explain blocks."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And what is a block table?"},
        ],
        max_tokens=6,
        temperature=0,
    )
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content
    # the first turn's prompt, in whole blocks, came from the cache
    reused = first.usage.input_tokens - first.usage.input_tokens % BLOCK_SIZE
    assert prefix_cache_hits(client) - hits >= reused > 0
    assert second.usage.input_tokens_details.cached_tokens >= reused


def test_a_chain_of_turns_is_the_whole_history(oai):
    history, turn = [], None
    for text in ("One.", "Two.", "Three."):
        turn = oai.responses.create(
            model=MODEL,
            input=text,
            previous_response_id=turn.id if turn else None,
            max_output_tokens=3,
            temperature=0,
        )
        history += [{"role": "user", "content": text}]
        history += [{"role": "assistant", "content": turn.output_text}]
    chat = oai.chat.completions.create(
        model=MODEL, messages=history[:-1], max_tokens=3, temperature=0
    )
    assert turn.usage.input_tokens == chat.usage.prompt_tokens
    assert turn.output_text == chat.choices[0].message.content


def test_the_store_keeps_the_newest_responses(engine, tmp_path):
    config = ServerConfig(responses_store=str(tmp_path / "r.sqlite3"), responses_store_max=2)
    client = TestClient(build_app(engine, config, MODEL), raise_server_exceptions=False)
    small = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)
    ids = [
        small.responses.create(model=MODEL, input="Hi", max_output_tokens=1).id for _ in range(3)
    ]
    with pytest.raises(openai.NotFoundError):
        small.responses.retrieve(ids[0])
    assert [small.responses.retrieve(i).id for i in ids[1:]] == ids[1:]


def test_without_a_store_store_true_is_refused(engine):
    client = TestClient(build_app(engine, ServerConfig(responses_store="off"), MODEL))
    small = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)
    assert small.responses.create(model=MODEL, input="Hi", max_output_tokens=1).store is False
    with pytest.raises(openai.BadRequestError) as error:
        small.responses.create(model=MODEL, input="Hi", max_output_tokens=1, store=True)
    assert error.value.body["param"] == "store"
