"""The tool-call parsers against hand-written replies in each model family's format."""

from __future__ import annotations

import json

from pagedserve.server.tool_parsers import parse_hermes, parse_llama3_json


def test_hermes_calls_and_content():
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    content, calls = parse_hermes(text)
    assert content == "Let me check."
    assert [(n, json.loads(a)) for n, a in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]


def test_hermes_unclosed_last_call_and_plain_text():
    assert parse_hermes('<tool_call>{"name": "f", "arguments": {"x": 1}}')[1] == [("f", '{"x": 1}')]
    assert parse_hermes("no calls here") == ("no calls here", [])
    broken = '<tool_call>{"name": "f", "arguments": {"x": </tool_call>'
    assert parse_hermes(broken) == (broken, [])  # a broken call stays text


def test_llama3_json_one_or_several_calls():
    content, calls = parse_llama3_json('{"name": "f", "parameters": {"a": "b"}}')
    assert content is None and calls == [("f", '{"a": "b"}')]
    _, calls = parse_llama3_json(
        '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"x": 2}}'
    )
    assert [n for n, _ in calls] == ["f", "g"]
    assert parse_llama3_json("The answer is 4.") == ("The answer is 4.", [])
    assert parse_llama3_json('{"title": "not a call"}') == ('{"title": "not a call"}', [])
