"""``strict: true`` tools under tool_choice "auto": the reply stays free text, and a call the
model opens is held to a given tool and, for a strict tool, to its schema.

The grammar the plan builds is walked token by token with the engine's own backend over the
tiny model's tokenizer, so each verdict is the one the sampler's mask would give."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from pagedserve.engine.structured_output.xgrammar_backend import XgrammarBackend
from pagedserve.server.protocol import ChatCompletionRequest
from pagedserve.server.testing import TINY_MODEL_NAME as MODEL
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
