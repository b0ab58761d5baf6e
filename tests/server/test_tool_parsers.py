"""Every tool-call parser against replies written in its model family's documented format:
calls with nested JSON arguments, several calls, text before them; the same result streamed,
however the reply is cut into chunks (every two-piece cut, and one character at a time); a
malformed call is content, never an error."""

from __future__ import annotations

import json

import pytest

from pagedserve.server.reply import joined_calls
from pagedserve.server.tool_parsers import TOOL_CALL_PARSERS, detect_tool_parser

OPTIONS = {"units": ["C", "F"], "detail": {"hourly": True, "days": 3}}
WEATHER = ("get_weather", {"city": "Paris", "options": OPTIONS})
TIME = ("get_time", {})
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "options": {"type": "object"}},
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
ARGS = json.dumps(WEATHER[1])
DS = {k: f"<｜{k}｜>" for k in ("tool▁calls▁begin", "tool▁calls▁end", "tool▁call▁begin")}
DS_END, DS_SEP = "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"

# (parser, reply, expected content, expected calls)
FIXTURES = [
    (
        "hermes",
        f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        "Let me check.",
        [WEATHER, TIME],
    ),
    (
        "llama3_json",
        f'<|python_tag|>{{"name": "get_weather", "parameters": {ARGS}}}; '
        '{"name": "get_time", "parameters": {}}',
        None,
        [WEATHER, TIME],
    ),
    (
        "mistral",
        f"Sure.[TOOL_CALLS]get_weather[ARGS]{ARGS}[TOOL_CALLS]get_time[ARGS]{{}}",
        "Sure.",
        [WEATHER, TIME],
    ),
    (
        "mistral",
        f'Sure. [TOOL_CALLS] [{{"name": "get_weather", "arguments": {ARGS}}}, '
        '{"name": "get_time", "arguments": {}}]',
        "Sure.",
        [WEATHER, TIME],
    ),
    (
        "pythonic",
        '[get_weather(city="Paris", options={"units": ["C", "F"], "detail": '
        '{"hourly": True, "days": 3}}), get_time()]',
        None,
        [WEATHER, TIME],
    ),
    (
        "llama4_pythonic",
        "<|python_start|>[get_weather(city='Paris', options={'units': ['C', 'F'], "
        "'detail': {'hourly': True, 'days': 3}}), get_time()]<|python_end|>",
        None,
        [WEATHER, TIME],
    ),
    (
        "qwen3_coder",
        "I will look it up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        f"</parameter>\n<parameter=options>\n{json.dumps(OPTIONS)}\n</parameter>\n</function>\n"
        "</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
        "I will look it up.",
        [WEATHER, TIME],
    ),
    (
        "deepseek_v3",
        f"Checking.{DS['tool▁calls▁begin']}{DS['tool▁call▁begin']}function{DS_SEP}get_weather\n"
        f"```json\n{ARGS}\n```{DS_END}\n{DS['tool▁call▁begin']}function{DS_SEP}get_time\n"
        f"```json\n{{}}\n```{DS_END}{DS['tool▁calls▁end']}",
        "Checking.",
        [WEATHER, TIME],
    ),
    (
        "deepseek_v31",
        f"Checking.{DS['tool▁calls▁begin']}{DS['tool▁call▁begin']}get_weather{DS_SEP}{ARGS}"
        f"{DS_END}{DS['tool▁call▁begin']}get_time{DS_SEP}{{}}{DS_END}{DS['tool▁calls▁end']}",
        "Checking.",
        [WEATHER, TIME],
    ),
    (
        "granite",
        f'Sure.<tool_call>[{{"name": "get_weather", "arguments": {ARGS}}}, '
        '{"name": "get_time", "arguments": {}}]',
        "Sure.",
        [WEATHER, TIME],
    ),
    (
        "granite",
        f'<|tool_call|>[{{"name": "get_weather", "arguments": {ARGS}}}]',
        None,
        [WEATHER],
    ),
    (
        "internlm",
        f'Let me see.<|action_start|><|plugin|>\n{{"name": "get_weather", "parameters": {ARGS}}}'
        '<|action_end|><|action_start|><|plugin|>\n{"name": "get_time", "parameters": {}}'
        "<|action_end|>",
        "Let me see.",
        [WEATHER, TIME],
    ),
    (
        "glm45",
        "Sure.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        f"<arg_key>options</arg_key>\n<arg_value>{json.dumps(OPTIONS)}</arg_value>\n</tool_call>"
        "\n<tool_call>get_time\n</tool_call>",
        "Sure.",
        [WEATHER, TIME],
    ),
]
IDS = [f"{name}-{i}" for i, (name, *_) in enumerate(FIXTURES)]


def parse(name: str, pieces: list[str]):
    """Feed ``pieces`` in order; the joined content and the whole calls as (name, arguments)."""
    parser = TOOL_CALL_PARSERS[name](TOOLS)
    content, calls = "", []
    for piece in pieces:
        delta = parser.feed(piece)
        content, calls = content + delta.content, calls + delta.calls
    delta = parser.finish()
    content, calls = content + delta.content, calls + delta.calls
    whole = [(c.name, json.loads(c.arguments)) for c in joined_calls(calls)]
    return content or None, whole


@pytest.mark.parametrize("name, reply, content, calls", FIXTURES, ids=IDS)
def test_fixture_parses_to_its_calls(name, reply, content, calls):
    assert parse(name, [reply]) == (content, [(n, a) for n, a in calls])


@pytest.mark.parametrize("name, reply, content, calls", FIXTURES, ids=IDS)
def test_every_split_streams_the_same(name, reply, content, calls):
    whole = parse(name, [reply])
    for cut in range(len(reply) + 1):
        assert parse(name, [reply[:cut], reply[cut:]]) == whole, cut
    assert parse(name, list(reply)) == whole


def test_calls_stream_as_soon_as_each_is_complete():
    """The first call is sent before the second one is written: a stream does not wait for
    the end of the reply."""
    name, reply, _, _ = FIXTURES[0]
    parser = TOOL_CALL_PARSERS[name](TOOLS)
    first_end = reply.index("</tool_call>") + len("</tool_call>")
    delta = parser.feed(reply[:first_end])
    assert delta.content == "Let me check." and [c.name for c in delta.calls] == ["get_weather"]
    delta = parser.feed(reply[first_end:])
    assert [c.name for c in delta.calls] == ["get_time"] and delta.calls[0].index == 1


@pytest.mark.parametrize(
    "name, reply",
    [
        ("hermes", 'Try <tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'),
        ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),
        ("llama3_json", '{"title": "not a call"}'),
        ("mistral", "[TOOL_CALLS]get_weather[ARGS]{broken"),
        ("pythonic", "[get_weather(city=open('x'))]"),
        ("pythonic", "[this is not python"),
        ("qwen3_coder", "<tool_call>\n<parameter=city>\nParis\n</parameter>\n</tool_call>"),
        ("deepseek_v3", f"{DS['tool▁call▁begin']}function{DS_SEP}f\nno json{DS_END}"),
        ("granite", '<tool_call>[{"name": "f", "arguments": [1]}]'),
        ("internlm", "<|action_start|><|plugin|>\nnot json<|action_end|>"),
        ("glm45", "<tool_call>\n<arg_value>1</arg_value>\n</tool_call>"),
    ],
)
def test_a_malformed_call_is_content(name, reply):
    content, calls = parse(name, [reply])
    assert calls == [] and content is not None
    assert content.replace(" ", "") in reply.replace(" ", "")
    assert all(
        parse(name, [reply[:cut], reply[cut:]]) == (content, []) for cut in range(len(reply))
    )


def test_a_valid_call_beside_a_malformed_one_is_kept():
    reply = (
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n'
        '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    )
    content, calls = parse("hermes", [reply])
    assert calls == [TIME]
    assert content == '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'


@pytest.mark.parametrize("name", sorted(TOOL_CALL_PARSERS))
def test_plain_text_is_kept_exactly(name):
    text = "The answer is 4.\nNo tool is needed [really].  "
    assert parse(name, [text]) == (text, [])
    assert parse(name, list(text)) == (text, [])


def test_a_hermes_call_left_open_at_the_end_counts_when_its_json_is_whole():
    assert parse("hermes", ['<tool_call>{"name": "get_time", "arguments": {}}']) == (None, [TIME])


def test_qwen3_coder_values_take_their_schema_types():
    tools = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "n": {"type": "integer"},
                        "x": {"type": "number"},
                        "ok": {"type": "boolean"},
                        "code": {"type": "string"},
                        "items": {"type": "array"},
                    },
                },
            },
        }
    ]
    reply = (
        "<tool_call>\n<function=f>\n<parameter=n>\n3\n</parameter>\n<parameter=x>\n2.5\n"
        "</parameter>\n<parameter=ok>\ntrue\n</parameter>\n<parameter=code>\n"
        "def f():\n    return 1\n</parameter>\n<parameter=items>\n[1, 'a']\n</parameter>\n"
        '<parameter=free>\n{"k": null}\n</parameter>\n</function>\n</tool_call>'
    )
    parser = TOOL_CALL_PARSERS["qwen3_coder"](tools)
    delta = parser.feed(reply)
    delta += parser.finish()
    (call,) = joined_calls(delta.calls)
    assert json.loads(call.arguments) == {
        "n": 3,
        "x": 2.5,
        "ok": True,
        "code": "def f():\n    return 1",
        "items": [1, "a"],
        "free": {"k": None},
    }


@pytest.mark.parametrize(
    "template, parser",
    [
        ("{{ '<tool_call>\\n' }}{{ tool_call | tojson }}{{ '</tool_call>' }}", "hermes"),
        ("<tool_call>\n<function={{ name }}>", "qwen3_coder"),
        ("[TOOL_CALLS]{{ calls }}", "mistral"),
        (
            "'<｜tool▁call▁begin｜>' + type + '<｜tool▁sep｜>' + name + '\\n```json\\n'",
            "deepseek_v3",
        ),
        ("'<｜tool▁call▁begin｜>' + name + '<｜tool▁sep｜>'", "deepseek_v31"),
        ("<tool_call>{{ name }}\n<arg_key>{{ k }}</arg_key>", "glm45"),
        ("<|python_tag|>{{ call }}", "llama3_json"),
        ("<|python_start|>{{ call }}", "pythonic"),
        ("<|start_of_role|>assistant<|end_of_role|><tool_call>{{ calls }}", "granite"),
        ("<|action_start|><|plugin|>", "internlm"),
        ("{{ messages }}", "hermes"),
    ],
)
def test_auto_reads_the_format_from_the_chat_template(template, parser):
    assert detect_tool_parser(template) == parser
