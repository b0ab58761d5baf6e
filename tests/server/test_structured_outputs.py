"""Structured outputs and tools over HTTP on the tiny model: every request shape reaches the
grammar, every bad one is a 400 naming the field, and a bad one leaves the others unharmed.

The tiny model has random weights: it never writes a regex match or JSON by chance, so each
output that holds, holds because the constraint was applied."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from pagedserve.server.testing import TINY_MODEL_NAME as MODEL


@pytest.fixture(scope="module")
def engine(roomy_engine):
    return roomy_engine


SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["n", "ok"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "hello"}]
BASE = dict(model=MODEL, max_tokens=40, temperature=1.0, n=4)


def chat(client, **fields):
    return client.post("/v1/chat/completions", json={**BASE, "messages": MESSAGES, **fields})


def texts(response) -> list[str]:
    assert response.status_code == 200, response.text
    body = response.json()
    if "message" in body["choices"][0]:
        return [c["message"]["content"] for c in body["choices"]]
    return [c["text"] for c in body["choices"]]


@pytest.mark.parametrize(
    "fields",
    [
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": SCHEMA},
            }
        },
        {"structured_outputs": {"json": SCHEMA}},
        {"guided_json": SCHEMA},
    ],
    ids=["response_format", "structured_outputs", "guided_json"],
)
def test_json_schema_in_each_shape(client, fields):
    for text in texts(chat(client, **fields)):
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_and_text_formats(client):
    response = chat(client, response_format={"type": "json_object"}, max_tokens=120)
    for choice in response.json()["choices"]:
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(choice["message"]["content"]), dict)
    plain = chat(client, response_format={"type": "text"}, n=1, max_tokens=3, temperature=0)
    assert plain.status_code == 200


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_regex_choice_and_grammar_fields(client, endpoint):
    def post(**fields):
        if endpoint == "chat":
            return chat(client, **fields)
        body = {**BASE, "prompt": "hi", **fields}
        return client.post("/v1/completions", json=body)

    for text in texts(post(guided_regex=r"[0-9]{2,4}x")):
        assert re.fullmatch(r"[0-9]{2,4}x", text)
    for text in texts(post(guided_choice=["left", "right"])):
        assert text in ("left", "right")
    for text in texts(post(structured_outputs={"choice": ["up", "down"]})):
        assert text in ("up", "down")
    for text in texts(post(guided_grammar='root ::= "<" [ab]{1,3} ">"')):
        assert re.fullmatch(r"<[ab]{1,3}>", text)


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"guided_json": {"type": "strnig"}}, "guided_json", "not a valid JSON schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"not": {}}}}},
            "response_format",
            "'not'",
        ),
        ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex", "parenthesis"),
        ({"guided_regex": "[z-a]"}, "guided_regex", "does not compile"),
        ({"guided_grammar": 'root ::= "a" |'}, "guided_grammar", "does not compile"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "conflicts"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "one of"),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs", "jsn"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "schema"),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(client, fields, param, words):
    response = chat(client, **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param or (param in error["param"]), error
    assert words in error["message"], error


def test_a_bad_constraint_does_not_disturb_requests_in_flight(client):
    results = {}

    def good(i):
        results[i] = chat(client, guided_regex=r"[a-c]{5}", max_tokens=12, n=2, seed=i)

    threads = [threading.Thread(target=good, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    bad = chat(client, guided_grammar="root ::= missing")
    for t in threads:
        t.join()
    assert bad.status_code == 400
    for response in results.values():
        assert all(re.fullmatch(r"[a-c]{5}", t) for t in texts(response))


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]


def test_required_and_named_tool_calls_follow_their_schemas(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        response = chat(client, tools=TOOLS, tool_choice=choice, max_tokens=60, n=3)
        assert response.status_code == 200, response.text
        for c in response.json()["choices"]:
            if c["finish_reason"] == "length":
                continue
            assert c["finish_reason"] == "tool_calls"
            for call in c["message"]["tool_calls"]:
                assert call["id"].startswith("call_") and call["type"] == "function"
                arguments = json.loads(call["function"]["arguments"])
                if call["function"]["name"] == "get_weather":
                    jsonschema.validate(arguments, TOOLS[0]["function"]["parameters"])
                else:
                    assert call["function"]["name"] == "get_time" and choice == "required"


def test_a_cut_off_required_list_is_reported_as_cut(client):
    """A "required" list cut by max_tokens is never "tool_calls": its complete calls (if any)
    stay calls, the unfinished rest is content, and finish_reason says it was cut. The same
    streamed."""
    fields = dict(tools=TOOLS, tool_choice="required", max_tokens=12, n=1, temperature=0)
    whole = chat(client, **fields)
    (choice,) = whole.json()["choices"]
    assert choice["finish_reason"] == "length"
    text = choice["message"]["content"]
    assert text and not text.startswith("[")  # the unfinished call, as written
    complete = choice["message"].get("tool_calls", [])
    streamed = chat(client, stream=True, **fields).text.splitlines()
    chunks = [json.loads(line[6:]) for line in streamed if line.startswith("data: {")]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    calls = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls") or []]
    assert content == text and len(calls) == len(complete)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


STRICT_TOOL = {"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}


def test_a_strict_tool_under_auto_runs_through_the_grammar(client):
    """Its grammar is walked in test_strict_tools.py; here the request runs end to end and the
    random model's free text comes back as content."""
    response = chat(client, tools=[STRICT_TOOL], max_tokens=8, n=2)
    for c in response.json()["choices"]:
        assert c["finish_reason"] == "length" and c["message"]["content"], response.text


def test_parallel_tool_calls_false_makes_one_call(client):
    response = chat(
        client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=60
    )
    for c in response.json()["choices"]:
        if c["finish_reason"] == "tool_calls":
            assert len(c["message"]["tool_calls"]) == 1


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools[0]"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
        ({"tools": [STRICT_TOOL], "guided_regex": "a"}, "tool_choice"),  # strict under auto
        ({"continue_final_message": True}, "continue_final_message"),
    ],
)
def test_bad_tool_requests_are_400s(client, fields, param):
    response = chat(client, **fields)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_tool_messages_and_assistant_tool_calls_are_accepted(client):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "what time is it?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    body = {**BASE, "n": 1, "messages": messages, "tools": TOOLS, "max_tokens": 4}
    assert client.post("/v1/chat/completions", json=body).status_code == 200


def test_truncate_prompt_tokens_keeps_the_last_tokens(client):
    long = {"model": MODEL, "prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 3, "temperature": 0}
    short = {**long, "prompt": [9, 10]}
    truncated = client.post("/v1/completions", json={**long, "truncate_prompt_tokens": 2})
    expected = client.post("/v1/completions", json=short)
    assert truncated.json()["usage"]["prompt_tokens"] == 2
    assert truncated.json()["choices"][0]["text"] == expected.json()["choices"][0]["text"]


def test_continue_final_message_continues_the_assistant_turn(client, engine):
    messages = [
        {"role": "user", "content": "count"},
        {"role": "assistant", "content": "one two"},
    ]
    body = {"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0}
    response = client.post("/v1/chat/completions", json={**body, "continue_final_message": True})
    expected = engine.tokenizer.apply_chat_template(
        messages, continue_final_message=True, tokenize=True
    )
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert response.json()["usage"]["prompt_tokens"] == len(expected)
    new_turn = client.post("/v1/chat/completions", json=body).json()["usage"]["prompt_tokens"]
    assert new_turn > len(expected)  # a new turn closes the message and opens another


TOOL_TEMPLATE = (
    "{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] or '' }}{% endfor %}<assistant>"
)


def test_a_chat_template_that_takes_tools_renders_them_itself(engine):
    from starlette.testclient import TestClient

    from pagedserve.server.app import build_app
    from pagedserve.server.config import ServerConfig

    app = build_app(engine, ServerConfig(chat_template=TOOL_TEMPLATE), MODEL)
    client = TestClient(app, raise_server_exceptions=False)
    body = {**BASE, "n": 1, "messages": MESSAGES, "tools": TOOLS[:1], "max_tokens": 2}
    usage = client.post("/v1/chat/completions", json=body).json()["usage"]
    tools = [{"type": "function", "function": TOOLS[0]["function"]}]
    expected = engine.tokenizer.apply_chat_template(
        MESSAGES, chat_template=TOOL_TEMPLATE, tools=tools, tokenize=True
    )
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert usage["prompt_tokens"] == len(expected)  # the template's own rendering, no default


def test_a_named_call_streams_its_arguments_as_they_are_written(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = {**BASE, "n": 1, "messages": MESSAGES, "tools": TOOLS, "tool_choice": named}
    body.update(stream=True, max_tokens=60, seed=3)
    chunks = []
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[len("data: ") :]))
    parts = [c["choices"][0]["delta"].get("tool_calls") for c in chunks if c["choices"]]
    parts = [p[0] for p in parts if p]
    assert len(parts) > 2  # the arguments come in pieces, not in one chunk at the end
    assert parts[0]["id"].startswith("call_") and parts[0]["function"]["name"] == "get_weather"
    assert all(p.get("id") is None for p in parts[1:])
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
    if finish == "tool_calls":
        arguments = json.loads("".join(p["function"]["arguments"] or "" for p in parts))
        jsonschema.validate(arguments, TOOLS[0]["function"]["parameters"])
    else:
        assert finish == "length"
