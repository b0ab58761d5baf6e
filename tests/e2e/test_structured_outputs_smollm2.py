"""Structured outputs and tool calls on SmolLM2 through the official openai client.

``chat.completions.parse`` with pydantic models returns parsed objects; 200 samples at
temperature 1.0 across four schemas all validate with jsonschema; regex and choice samples all
match; and a tool round trip (call -> tool result -> answer) agrees streamed and not streamed.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from enum import StrEnum
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from starlette.testclient import TestClient

from pagedserve.server.app import build_app
from pagedserve.server.config import ServerConfig
from pagedserve.server.testing import make_engine

MODEL = "smollm2"


@pytest.fixture(scope="module")
def app(default_model_path):
    engine = make_engine(
        default_model_path, max_model_len=1024, num_gpu_blocks_override=1024, max_num_seqs=64
    )
    yield build_app(engine, ServerConfig(), MODEL)
    asyncio.run(engine.shutdown())


@pytest.fixture(scope="module")
def client(app):
    http = TestClient(app, raise_server_exceptions=False)
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http)


class Genre(StrEnum):
    drama = "drama"
    comedy = "comedy"
    horror = "horror"


class Actor(BaseModel):
    name: str
    lead: bool


class Film(BaseModel):
    title: str
    year: int = Field(ge=1900, le=2030)
    genre: Genre
    cast: list[Actor] = Field(max_length=3)
    rating: float = Field(ge=0, le=10)
    sequel: str | None = None


class Address(BaseModel):
    city: str
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str
    age: int = Field(ge=0, le=120)
    address: Address
    role: Literal["admin", "user", "guest"]
    nickname: str | None


class Recipe(BaseModel):
    dish: str
    ingredients: list[str] = Field(min_length=1, max_length=4)
    minutes: int = Field(gt=0, le=600)
    vegetarian: bool


PARSED = [
    (Film, "Describe a film as JSON."),
    (Person, "Describe a person who lives in Paris as JSON."),
    (Recipe, "Give a short pancake recipe as JSON."),
]


async def _concurrently(app, method: str, requests: list[dict]):
    """Every request at once through the async openai client (``method``: "create" or
    "parse"), so that they share the engine's batches."""
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
        client = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="x", http_client=http)
        call = getattr(client.chat.completions, method)
        return await asyncio.gather(*(call(**request) for request in requests))


@pytest.mark.slow
def test_parse_returns_the_pydantic_objects(app):
    """Nested objects, enums, arrays, bounded numbers, a pattern, required and optional fields;
    the three requests run concurrently (one batch)."""
    requests = [
        dict(
            model=MODEL,
            messages=[{"role": "user", "content": ask}],
            response_format=model,
            max_tokens=200,
            temperature=0,
        )
        for model, ask in PARSED
    ]
    for (model, _), completion in zip(PARSED, asyncio.run(_concurrently(app, "parse", requests))):
        choice = completion.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, model)  # validated by pydantic, bounds included


# Schemas for sampling: every string and array bounded, integers only, so that any path through
# the grammar closes within max_tokens.
SAMPLED_SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user", "guest"]},
        },
        "required": ["name", "age", "role"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "minLength": 1, "maxLength": 10},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            "tags": {"type": "array", "items": {"enum": ["old", "new", "big"]}, "maxItems": 3},
        },
        "required": ["city", "zip"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "dish": {"type": "string", "maxLength": 10},
            "steps": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "n": {"type": "integer", "minimum": 1, "maximum": 9},
                        "hot": {"type": "boolean"},
                    },
                    "required": ["n", "hot"],
                    "additionalProperties": False,
                },
                "minItems": 1,
                "maxItems": 2,
            },
        },
        "required": ["dish", "steps"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "answer": {"type": "boolean"},
            "confidence": {"type": "integer", "minimum": -10, "maximum": 10},
            "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 8}]},
        },
        "required": ["answer", "confidence", "note"],
        "additionalProperties": False,
    },
]
# The issue's 200 samples (50 per schema) take about 160 s on two shared cores: the suite draws
# 10 per schema; `python tools/check_structured_sampling.py` runs this test with all 200.
SAMPLES_PER_SCHEMA = int(os.environ.get("PAGEDSERVE_STRUCTURED_SAMPLES_PER_SCHEMA", "10"))


def _request(seed: int, **fields) -> dict:
    request = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Reply with the JSON asked for."}],
        temperature=1.0,
        n=10,
        seed=seed,
        max_tokens=120,
    )
    return {**request, **fields}


@pytest.mark.slow
def test_sampled_outputs_validate_and_regex_and_choice_hold(app):
    requests, expected = [], []
    for index, schema in enumerate(SAMPLED_SCHEMAS):
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{index}", "schema": schema}}
        for k in range(SAMPLES_PER_SCHEMA // 10):
            requests.append(_request(100 * index + k, response_format=fmt))
            expected.append(("json", schema))
    regex = r"[A-Z][a-z]{1,8} [0-9]{2}"
    choices = ["red", "green", "blue", "dark blue"]
    requests.append(_request(7, extra_body={"guided_regex": regex}, max_tokens=30))
    expected.append(("regex", regex))
    requests.append(_request(8, extra_body={"guided_choice": choices}, max_tokens=10))
    expected.append(("choice", choices))
    responses = asyncio.run(_concurrently(app, "create", requests))
    counts = {"json": 0, "regex": 0, "choice": 0}
    for response, (kind, constraint) in zip(responses, expected):
        for choice in response.choices:
            text = choice.message.content
            assert choice.finish_reason == "stop", text
            if kind == "json":
                jsonschema.validate(json.loads(text), constraint)
            elif kind == "regex":
                assert re.fullmatch(constraint, text), text
            else:
                assert text in constraint, text
            counts[kind] += 1
    assert counts == {"json": 4 * SAMPLES_PER_SCHEMA, "regex": 10, "choice": 10}


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current temperature in a city, in Celsius",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def _round_trip(client, stream: bool):
    messages = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    common = dict(model=MODEL, temperature=0, max_tokens=80, tools=[WEATHER])
    first = _complete(
        client,
        stream,
        messages=messages,
        tool_choice="required",
        parallel_tool_calls=False,
        **common,
    )
    calls, finish = first["tool_calls"], first["finish_reason"]
    assert finish == "tool_calls" and len(calls) >= 1
    call = calls[0]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(
        json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"]
    )
    messages += [
        {"role": "assistant", "content": None, "tool_calls": calls[:1]},
        {"role": "tool", "tool_call_id": call["id"], "content": '{"temperature": 21}'},
    ]
    answer = _complete(
        client, stream, messages=messages, tool_choice="none", **{**common, "max_tokens": 24}
    )
    assert answer["content"] and answer["finish_reason"] in ("stop", "length")
    return call["function"], answer["content"]


def _complete(client, stream: bool, **request) -> dict:
    """One chat completion as {content, tool_calls, finish_reason}, streamed or not."""
    if not stream:
        choice = client.chat.completions.create(**request).choices[0]
        calls = [c.model_dump() for c in choice.message.tool_calls or []]
        return dict(
            content=choice.message.content, tool_calls=calls, finish_reason=choice.finish_reason
        )
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **request):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or []:
            call = calls.setdefault(
                part.index,
                {"id": part.id, "type": "function", "function": {"name": "", "arguments": ""}},
            )
            call["function"]["name"] += part.function.name or ""
            call["function"]["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return dict(content=content or None, tool_calls=list(calls.values()), finish_reason=finish)


@pytest.mark.slow
def test_tool_round_trip_streamed_and_not_agree(client):
    assert _round_trip(client, stream=False) == _round_trip(client, stream=True)


@pytest.mark.slow
def test_greedy_is_unchanged_where_it_already_satisfies_the_constraint(app):
    """The free greedy answer as one of the choices, or inside a character class that covers
    it: the constrained greedy run writes exactly the same tokens (the grammar lets through the
    tokens the model wanted, and EOS where the answer ended)."""
    asks = ["What is the capital of France? Answer in one word.", "Say hello to Ana in five words."]
    base = [
        dict(
            model=MODEL,
            messages=[{"role": "user", "content": a}],
            temperature=0,
            max_tokens=24,
            logprobs=True,  # for the tokens themselves, not only the text
        )
        for a in asks
    ]
    free = [r.choices[0] for r in asyncio.run(_concurrently(app, "create", base))]
    assert all(c.finish_reason == "stop" for c in free)  # whole answers, ended by EOS
    word, sentence = (c.message.content for c in free)
    charset = "".join(sorted({re.escape(ch) for ch in sentence}))
    held = [
        {**base[0], "extra_body": {"guided_choice": ["London", word, word + "!"]}},
        {**base[1], "extra_body": {"guided_regex": f"[{charset}]+"}},
    ]
    constrained = [r.choices[0] for r in asyncio.run(_concurrently(app, "create", held))]
    assert [c.message.content for c in constrained] == [word, sentence]
    for a, b in zip(free, constrained):
        assert [t.token for t in a.logprobs.content] == [t.token for t in b.logprobs.content]
    assert all(c.finish_reason == "stop" for c in constrained)
