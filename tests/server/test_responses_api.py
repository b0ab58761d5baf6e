"""POST /v1/responses through the openai client's ``client.responses.create``: the answer is
the chat route's answer to the same conversation (instructions as the system message), cut by
max_output_tokens as "incomplete"; streamed, OpenAI's typed events in order add up to it.

Function tools: a "required" or named tool_choice holds the tiny model's reply to a call (its
random weights never write one by chance), which comes back as a ``function_call`` item; sent
back with its ``function_call_output``, the conversation is the chat route's assistant
tool_calls and tool message; streamed, the typed function-call events add up to the same
items."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from pagedserve.server.testing import TINY_MODEL_NAME as MODEL

HISTORY = [
    {"role": "user", "content": "Name a cache."},
    {"role": "assistant", "content": [{"type": "output_text", "text": "The KV cache."}]},
    {"role": "user", "content": [{"type": "input_text", "text": "Why is it paged?"}]},
]
CHAT_HISTORY = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Name a cache."},
    {"role": "assistant", "content": "The KV cache."},
    {"role": "user", "content": "Why is it paged?"},
]


@pytest.fixture(scope="module")
def engine(roomy_engine):
    return roomy_engine


@pytest.fixture(scope="module")
def oai(client):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)


def test_text_input_equals_the_chat_answer(oai):
    response = oai.responses.create(
        model=MODEL, input="Hello there", max_output_tokens=6, temperature=0, store=False
    )
    chat = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=6,
        temperature=0,
    )
    assert response.object == "response" and response.id.startswith("resp")
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.store is False
    assert (response.output[0].type, response.output[0].role) == ("message", "assistant")
    if chat.choices[0].finish_reason == "length":
        assert response.status == "incomplete"
        assert response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed"


def test_messages_and_instructions_are_the_chat_conversation(oai):
    response = oai.responses.create(
        model=MODEL,
        input=HISTORY,
        instructions="Answer briefly.",
        max_output_tokens=5,
        temperature=0.8,
        top_p=0.9,
        extra_body={"ignore_eos": True},
    )
    chat = oai.chat.completions.create(
        model=MODEL, messages=CHAT_HISTORY, max_tokens=5, temperature=0.8, top_p=0.9
    )
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.instructions == "Answer briefly." and response.temperature == 0.8


def test_streamed_events_add_up_to_the_response(oai):
    params = dict(model=MODEL, input="Tell me more", max_output_tokens=8, temperature=0)
    whole = oai.responses.create(**params)
    events = list(oai.responses.create(stream=True, **params))
    kinds = [e.type for e in events]
    final = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    head = ["response.created", "response.in_progress", "response.output_item.added"]
    head.append("response.content_part.added")
    tail = ["response.output_text.done", "response.content_part.done"]
    tail += ["response.output_item.done", final]
    deltas = kinds[len(head) : len(kinds) - len(tail)]
    assert kinds[: len(head)] == head and kinds[len(kinds) - len(tail) :] == tail
    assert deltas and set(deltas) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-4].text == text


def test_refusals_name_the_responses_fields(oai):
    with pytest.raises(openai.BadRequestError) as error:
        oai.responses.create(model=MODEL, input="x", max_output_tokens=0)
    assert error.value.body["param"] == "max_output_tokens"
    with pytest.raises(openai.NotFoundError) as missing:
        oai.responses.create(model=MODEL, input="x", previous_response_id="resp_1")
    assert missing.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as error:
        oai.responses.create(model=MODEL, input=[{"role": "wizard", "content": "x"}])
    assert error.value.body["param"] == "input" and "list of messages" in error.value.message
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="gpt-5", input="x")


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True},
    {
        "type": "function",
        "name": "get_time",
        "description": "The time now.",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
]
CHAT_TOOLS = [
    {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS
]
NAMED = {"type": "function", "name": "get_weather"}
BASE = dict(model=MODEL, input="Weather in Oslo?", tools=TOOLS, max_output_tokens=60)


def calls_of(response) -> list:
    assert response.status == "completed", response
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and all(c.status == "completed" for c in calls)
    assert len({c.call_id for c in calls}) == len(calls)
    return calls


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_a_tool_call_is_a_function_call_item_following_its_schema(oai, choice):
    response = oai.responses.create(tool_choice=choice, temperature=0, **BASE)
    for call in calls_of(response):
        assert call.call_id.startswith("call_") and call.id.startswith("fc_")
        arguments = json.loads(call.arguments)
        if call.name == "get_weather":
            jsonschema.validate(arguments, WEATHER)
        else:
            assert call.name == "get_time" and choice == "required"
    assert response.tools[0].name == "get_weather" and response.tool_choice is not None


def test_parallel_tool_calls_false_makes_one_call(oai):
    response = oai.responses.create(
        tool_choice="required", parallel_tool_calls=False, temperature=0, **BASE
    )
    assert len(calls_of(response)) == 1 and response.parallel_tool_calls is False


def test_a_round_trip_is_the_chat_conversation_and_gets_a_text_answer(oai):
    (call,) = calls_of(oai.responses.create(tool_choice=NAMED, temperature=0, **BASE))
    history = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"},
    ]
    history[1]["arguments"] = call.arguments
    answer = oai.responses.create(
        model=MODEL, input=history, tools=TOOLS, max_output_tokens=6, temperature=0
    )
    chat_call = {"id": call.call_id, "type": "function", "function": {"name": call.name}}
    chat_call["function"]["arguments"] = call.arguments
    chat = oai.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [chat_call]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"},
        ],
        tools=CHAT_TOOLS,
        max_tokens=6,
        temperature=0,
    )
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    assert [item.type for item in answer.output] == ["message"]
    assert answer.output_text == chat.choices[0].message.content
    without = oai.responses.create(model=MODEL, input=history[:1], tools=TOOLS, max_output_tokens=1)
    assert answer.usage.input_tokens > without.usage.input_tokens  # the call and its output


def test_an_assistant_text_and_its_calls_are_one_chat_turn(oai):
    def call(n):
        return {"id": f"call_{n}", "type": "function", "function": {"name": "get_time"}}

    calls = [call(1), call(2)]
    for c in calls:
        c["function"]["arguments"] = "{}"
    items = [{"type": "function_call", "call_id": c["id"], "name": "get_time"} for c in calls]
    outputs = [
        {"type": "function_call_output", "call_id": c["id"], "output": "12:00"} for c in calls
    ]
    for item in items:
        item["arguments"] = "{}"
    said = {"role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]}
    asked = {"role": "user", "content": "What time is it here and there?"}
    answer = oai.responses.create(
        model=MODEL, input=[asked, said, *items, *outputs], tools=TOOLS, max_output_tokens=1
    )
    turn = {"role": "assistant", "content": "Let me look.", "tool_calls": calls}
    tool_messages = [{"role": "tool", "tool_call_id": c["id"], "content": "12:00"} for c in calls]
    chat = oai.chat.completions.create(
        model=MODEL,
        messages=[asked, turn, *tool_messages],
        tools=CHAT_TOOLS,
        max_tokens=1,
    )
    assert answer.usage.input_tokens == chat.usage.prompt_tokens


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_streamed_function_call_events_add_up_to_the_response(oai, choice):
    params = dict(tool_choice=choice, temperature=0, **BASE)
    whole = oai.responses.create(**params)
    events = list(oai.responses.create(stream=True, **params))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert events[-1].type == "response.completed"
    streamed, expected = calls_of(final), calls_of(whole)
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in expected]
    for index, call in enumerate(streamed):
        mine = [e for e in events if getattr(e, "output_index", None) == index]
        kinds = [e.type for e in mine]
        assert kinds[0] == "response.output_item.added" and mine[0].item.call_id == call.call_id
        assert kinds[-2:] == [
            "response.function_call_arguments.done",
            "response.output_item.done",
        ]
        assert set(kinds[1:-2]) == {"response.function_call_arguments.delta"}
        assert "".join(e.delta for e in mine[1:-2]) == mine[-2].arguments == call.arguments
        assert mine[-1].item.id == call.id and all(e.item_id == call.id for e in mine[1:-1])
    if choice == NAMED:  # the arguments stream as they are written, not in one piece at the end
        assert len([e for e in events if e.type.endswith("arguments.delta")]) > 2


def test_an_auto_reply_without_calls_streams_as_a_message_while_written(oai):
    params = dict(BASE, tool_choice="auto", temperature=0, max_output_tokens=8)
    whole = oai.responses.create(**params)
    events = list(oai.responses.create(stream=True, **params))
    kinds = [e.type for e in events]
    assert [item.type for item in whole.output] == ["message"]  # random weights write no call
    assert kinds[2:5] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1  # the text is sent as it is written, not at the end
    assert "".join(deltas) == whole.output_text == events[-1].response.output_text
    assert events[-1].response.output[0].id == events[2].item.id


def test_stream_helper_parses_the_function_call_events(oai):
    with oai.responses.stream(tool_choice=NAMED, temperature=0, **BASE) as stream:
        done = [e for e in stream if e.type == "response.function_call_arguments.done"]
        final = stream.get_final_response()
    (call,) = calls_of(final)
    assert [e.arguments for e in done] == [call.arguments]


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"tools": [*TOOLS, {"type": "file_search", "vector_store_ids": []}]}, "tools[2]"),
        ({"tools": [{"type": "function", "description": "no name"}]}, "tools[0]"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "max_output_tokens": 0}, "max_output_tokens"),
    ],
    ids=["web_search", "file_search", "no_name", "unknown_choice", "no_tools", "renamed"],
)
def test_bad_tool_requests_are_400s_naming_the_field(oai, fields, param):
    with pytest.raises(openai.BadRequestError) as error:
        oai.responses.create(**{"model": MODEL, "input": "x", **fields})
    assert error.value.body["param"] == param
