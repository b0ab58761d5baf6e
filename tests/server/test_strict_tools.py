"""``strict: true`` tools under tool_choice "auto": the reply stays free text, and a call the
model opens is held to a given tool and, for a strict tool, to its schema.

The grammar the plan builds is walked token by token with the engine's own backend over the
tiny model's tokenizer, so each verdict is the one the sampler's mask would give."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from pagedserve.engine.structured_output.xgrammar_backend import XgrammarBackend
from pagedserve.server.errors import APIError
from pagedserve.server.protocol import ChatCompletionRequest
from pagedserve.server.testing import TINY_MODEL_NAME as MODEL
from pagedserve.server.tool_parsers import TOOL_CALL_PARSERS
from pagedserve.server.tools import plan_tools

PICK_CITY = {
    "type": "function",
    "function": {
        "name": "pick_city",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ANYTHING = {"type": "function", "function": {"name": "note", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def walk(tiny_checkpoint):
    """``walk(parser, text, **request) -> bool``: may the reply be ``text``, then end?"""
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))
    backend = XgrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])

    def allowed(parser: str, text: str, **request) -> bool:
        body = ChatCompletionRequest(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], **request
        )
        matcher = backend.compile(plan_tools(body, parser).constraint()).matcher()
        tokens = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        return all(matcher.accept_token(t) for t in tokens)

    return allowed


def test_without_a_strict_tool_auto_is_unconstrained():
    body = ChatCompletionRequest(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=[ANYTHING]
    )
    assert plan_tools(body, "hermes").constraint() is None


@pytest.mark.parametrize(
    "text, allowed",
    [
        ("The weather is fine.", True),
        ('Sure. <tool_call>{"name": "pick_city", "arguments": {"city": "Rome"}}</tool_call>', True),
        ('<tool_call>{"name": "pick_city", "arguments": {"city": "Oslo"}}</tool_call>', False),
        ('<tool_call>{"name": "pick_city", "arguments": {"town": "Rome"}}</tool_call>', False),
        ('<tool_call>{"name": "note", "arguments": {"any": [1, 2]}}</tool_call>', True),
        ('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', False),
        ('<tool_call>{"name": "pick_city", "arguments": {"city": "Rome"}}', False),  # unclosed
    ],
)
def test_hermes_calls_are_held_to_the_strict_schema(walk, text, allowed):
    assert walk("hermes", text, tools=[PICK_CITY, ANYTHING]) is allowed


def test_llama3_json_calls_are_held_too(walk):
    good = '{"name": "pick_city", "parameters": {"city": "Paris"}}'
    assert walk("llama3_json", good, tools=[PICK_CITY])
    assert not walk("llama3_json", good.replace("Paris", "Lima"), tools=[PICK_CITY])


def test_parallel_tool_calls_false_ends_the_reply_after_one_call(walk):
    call = '<tool_call>{"name": "pick_city", "arguments": {"city": "Rome"}}</tool_call>'
    assert walk("hermes", call + call, tools=[PICK_CITY])
    assert not walk("hermes", call + call, tools=[PICK_CITY], parallel_tool_calls=False)


FRAMED = sorted(name for name, parser in TOOL_CALL_PARSERS.items() if parser.frame is not None)


@pytest.mark.parametrize("parser", FRAMED)
def test_each_framed_parser_holds_its_calls_and_reads_what_it_holds(walk, parser):
    """The grammar's frame of a call is the parser's own format: a call written in it is held
    to the strict schema, and the parser reads it back as that call."""
    frame = TOOL_CALL_PARSERS[parser].frame
    opening = frame.begin.format(name=json.dumps("pick_city"), raw_name="pick_city")
    good = f'Sure. {opening}{{"city": "Rome"}}{frame.end}'
    assert walk(parser, good, tools=[PICK_CITY])
    assert not walk(parser, good.replace("Rome", "Oslo"), tools=[PICK_CITY])
    reader = TOOL_CALL_PARSERS[parser]([PICK_CITY])
    delta = reader.feed(good.removeprefix("Sure. ") if parser == "llama3_json" else good)
    delta += reader.finish()
    assert [(c.name, json.loads(c.arguments)) for c in delta.calls] == [
        ("pick_city", {"city": "Rome"})
    ]


@pytest.mark.parametrize("parser", sorted(set(TOOL_CALL_PARSERS) - set(FRAMED)))
def test_a_strict_tool_under_a_parser_without_json_arguments_is_refused(parser):
    body = ChatCompletionRequest(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=[PICK_CITY]
    )
    with pytest.raises(APIError) as error:
        plan_tools(body, parser).constraint()
    assert error.value.status_code == 400 and error.value.param == "tools"


CALL = '{"name": "pick_city", "arguments": {"city": "Rome"}}'


@pytest.mark.parametrize(
    "text, parallel, allowed",
    [
        (f"[{CALL}]", True, True),  # the model may close the list after any call...
        (f"[{CALL}, {CALL}, {CALL}]", True, True),  # ...or go on
        (f"[{CALL}", True, False),  # but the list must be closed before the reply ends
        ("[]", True, False),  # and hold at least one call
        (f"[{CALL}, {CALL}]", False, False),  # one call when parallel_tool_calls is false
    ],
)
def test_required_ends_where_the_model_closes_the_list(walk, text, parallel, allowed):
    request = dict(tools=[PICK_CITY], tool_choice="required", parallel_tool_calls=parallel)
    assert walk("hermes", text, **request) is allowed
