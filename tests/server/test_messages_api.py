"""Anthropic's Messages API through the official anthropic client (sync, async, the streaming
helper), against a real uvicorn serving the app: the answer is the chat route's answer to the
same conversation; a tool-use round trip; stop sequences; thinking blocks from the reasoning
parser; count_tokens; and errors in Anthropic's shape, which the client raises as its own typed
exceptions."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import jsonschema
import pytest

from pagedserve.server.app import build_app
from pagedserve.server.config import ServerConfig
from pagedserve.server.testing import TINY_MODEL_NAME as MODEL
from pagedserve.server.testing import uvicorn_in_thread

KEY = "sk-messages"
SYSTEM = "Answer briefly."
ASK = [{"role": "user", "content": "Why are KV caches paged?"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"name": "get_weather", "description": "The weather in a city.", "input_schema": WEATHER},
    {"name": "get_time", "input_schema": {"type": "object", "properties": {}}},
]


@pytest.fixture(scope="module")
def engine(roomy_engine):
    return roomy_engine


@pytest.fixture(scope="module")
def url(engine, tmp_path_factory):
    config = ServerConfig(api_key=KEY, responses_store="off")
    with uvicorn_in_thread(build_app(engine, config, MODEL)) as base:
        yield base


@pytest.fixture(scope="module")
def claude(url):
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)


def chat(url, messages, **fields) -> dict:
    body = {"model": MODEL, "messages": messages, "temperature": 0, **fields}
    headers = {"authorization": f"Bearer {KEY}"}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=60).json()


def test_a_message_is_the_chat_answer(claude, url):
    message = claude.messages.create(
        model=MODEL, system=SYSTEM, messages=ASK, max_tokens=8, extra_body={"temperature": 0}
    )
    expected = chat(url, [{"role": "system", "content": SYSTEM}, *ASK], max_tokens=8)
    assert message.id.startswith("msg") and message.role == "assistant"
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == expected["choices"][0]["message"]["content"]
    assert message.usage.input_tokens == expected["usage"]["prompt_tokens"]
    assert message.usage.output_tokens == expected["usage"]["completion_tokens"]
    reason = expected["choices"][0]["finish_reason"]
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[reason]
    assert message.model == MODEL


def test_system_blocks_and_the_async_client(url):
    async def ask():
        client = anthropic.AsyncAnthropic(base_url=url, api_key=KEY, max_retries=0)
        return await client.messages.create(
            model=MODEL,
            system=[{"type": "text", "text": SYSTEM}],
            messages=[{"role": "user", "content": [{"type": "text", "text": ASK[0]["content"]}]}],
            max_tokens=6,
            extra_body={"temperature": 0},
        )

    message = asyncio.run(ask())
    expected = chat(url, [{"role": "system", "content": SYSTEM}, *ASK], max_tokens=6)
    assert message.content[0].text == expected["choices"][0]["message"]["content"]


def test_the_streaming_helper_adds_up_to_the_message(claude):
    params = dict(model=MODEL, messages=ASK, max_tokens=10, extra_body={"temperature": 0})
    whole = claude.messages.create(**params)
    with claude.messages.stream(**params) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == 10
    events = [e.type for e in claude.messages.create(stream=True, **params)]
    assert events[:2] == ["message_start", "content_block_start"]
    assert set(events[2:-3]) == {"content_block_delta"}
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_a_stop_sequence_ends_the_message_and_is_named(claude):
    params = dict(model=MODEL, messages=ASK, max_tokens=12, extra_body={"temperature": 0})
    text = claude.messages.create(**params).content[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    message = claude.messages.create(stop_sequences=[stop], **params)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == text[: text.index(stop)]


def test_a_tool_use_round_trip(claude, url):
    used = claude.messages.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
        max_tokens=60,
        extra_body={"temperature": 0},
    )
    assert used.stop_reason == "tool_use"
    (call,) = [block for block in used.content if block.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER)
    conversation = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": [call.model_dump(exclude_none=True)]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny"}],
        },
    ]
    answer = claude.messages.create(
        model=MODEL, messages=conversation, tools=TOOLS, max_tokens=6, extra_body={"temperature": 0}
    )
    tools = [
        {"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"]}}
        for t in TOOLS
    ]
    tools[0]["function"]["description"] = TOOLS[0]["description"]
    chat_call = {"id": call.id, "type": "function", "function": {"name": call.name}}
    chat_call["function"]["arguments"] = json.dumps(call.input)
    expected = chat(
        url,
        [
            conversation[0],
            {"role": "assistant", "content": "", "tool_calls": [chat_call]},
            {"role": "tool", "tool_call_id": call.id, "content": "Sunny"},
        ],
        tools=tools,
        max_tokens=6,
    )
    assert answer.usage.input_tokens == expected["usage"]["prompt_tokens"]
    assert answer.content[0].text == expected["choices"][0]["message"]["content"]
    counted = claude.messages.count_tokens(model=MODEL, messages=conversation, tools=TOOLS)
    assert counted.input_tokens == answer.usage.input_tokens


def test_tool_use_streams_its_input_json(claude):
    params = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=TOOLS,
        tool_choice={"type": "any"},
        max_tokens=80,
        extra_body={"temperature": 0},
    )
    whole = claude.messages.create(**params)
    with claude.messages.stream(**params) as stream:
        final = stream.get_final_message()
    calls = [(b.name, b.input) for b in whole.content if b.type == "tool_use"]
    assert calls and [(b.name, b.input) for b in final.content if b.type == "tool_use"] == calls
    assert whole.stop_reason == final.stop_reason == "tool_use"


def test_a_prefill_is_continued(claude, url):
    prefill = [*ASK, {"role": "assistant", "content": "Because"}]
    message = claude.messages.create(
        model=MODEL, messages=prefill, max_tokens=5, extra_body={"temperature": 0}
    )
    expected = chat(
        url, prefill, max_tokens=5, continue_final_message=True, add_generation_prompt=False
    )
    assert message.content[0].text == expected["choices"][0]["message"]["content"]


@pytest.mark.parametrize(
    "fields, error, status",
    [
        ({"max_tokens": 0}, anthropic.BadRequestError, 400),
        ({"model": "claude-unknown"}, anthropic.NotFoundError, 404),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            anthropic.BadRequestError,
            400,
        ),
        (
            {"tools": [{"type": "web_search_20250305", "name": "web_search", "input_schema": {}}]},
            anthropic.BadRequestError,
            400,
        ),
        (
            {"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 2048},
            anthropic.BadRequestError,
            400,
        ),
        ({"mcp_servers": [{"type": "url", "url": "http://x"}]}, anthropic.BadRequestError, 400),
    ],
    ids=["zero_max_tokens", "unknown_model", "image", "server_tool", "thinking_budget", "mcp"],
)
def test_errors_have_anthropics_shape(url, fields, error, status):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 4, **fields}
    raw = httpx.post(url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
    assert raw.status_code == status
    assert raw.json()["type"] == "error" and set(raw.json()["error"]) == {"type", "message"}
    client = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)
    required = {k: body.pop(k) for k in ("model", "messages", "max_tokens")}
    with pytest.raises(error):
        client.messages.create(**required, extra_body=body)


def test_a_wrong_key_is_anthropics_authentication_error(url):
    client = anthropic.Anthropic(base_url=url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as raised:
        client.messages.create(model=MODEL, messages=ASK, max_tokens=1)
    assert raised.value.body["error"]["type"] == "authentication_error"


QWEN3_LIKE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}<|im_end|>\n"
    "{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def thinker(engine):
    config = ServerConfig(reasoning_parser="qwen3", chat_template=QWEN3_LIKE, responses_store="off")
    with uvicorn_in_thread(build_app(engine, config, MODEL)) as base:
        yield anthropic.Anthropic(base_url=base, api_key="x", max_retries=0)


def test_thinking_comes_back_as_a_thinking_block(thinker):
    """The tiny model never closes its thinking: the whole reply is one thinking block; with
    thinking disabled it is one text block, of the same model's words for that prompt."""
    params = dict(model=MODEL, messages=ASK, max_tokens=10, extra_body={"temperature": 0})
    thought = thinker.messages.create(**params)
    assert [b.type for b in thought.content] == ["thinking"] and thought.content[0].thinking
    with thinker.messages.stream(**params) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].thinking == thought.content[0].thinking
    plain = thinker.messages.create(thinking={"type": "disabled"}, **params)
    assert [b.type for b in plain.content] == ["text"]
    hidden = thinker.messages.create(thinking={"type": "adaptive", "display": "omitted"}, **params)
    assert hidden.content == []
    budget = thinker.messages.create(thinking={"type": "enabled", "budget_tokens": 10}, **params)
    assert budget.content[0].thinking == thought.content[0].thinking  # a budget that cannot bind
