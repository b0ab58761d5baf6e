"""Reasoning parsers against replies in the reasoning models' format: thinking and answer split
the same streamed as whole, for every cut of the reply; the mode a prompt puts a reply in
(Qwen3's ``enable_thinking: false``, a template that opened or closed the thinking); thinking
tokens counted against the tokenizer; tool calls read from the answer only; and an output
constraint that holds the answer and leaves the thinking free, walked through the engine's
grammar backend token by token."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from pagedserve.engine.structured_output import StructuredOutputsParams
from pagedserve.engine.structured_output.xgrammar_backend import XgrammarBackend
from pagedserve.server.reasoning import (
    REASONING_PARSERS,
    ReasoningMode,
    ReasoningSplitter,
    answer_only,
    reasoning_token_count,
)
from pagedserve.server.reply import ReplyPlan
from pagedserve.server.tools import ToolCallPlan

OPEN, OPTIONAL, CLOSED = ReasoningMode.OPEN, ReasoningMode.OPTIONAL, ReasoningMode.CLOSED

# (mode, reply, thinking, answer)
FIXTURES = [
    (OPEN, "<think>\nFirst, 2 + 2.\nThat is 4.\n</think>\n\nThe answer is 4.", "First, 2 + 2.\nThat is 4.", "The answer is 4."),
    (OPEN, "The template opened it. So: 4.</think>\n\n4", "The template opened it. So: 4.", "4"),
    (OPEN, "<think>Cut short while still thinking about <thi", "Cut short while still thinking about <thi", ""),
    (OPEN, "<think>\n\n</think>\n\nNo thinking needed.", "", "No thinking needed."),
    (OPEN, "x < y and </thin> is not the tag</think>done", "x < y and </thin> is not the tag", "done"),
    (OPTIONAL, "Hello <think>there</think>", "", "Hello <think>there</think>"),
    (OPTIONAL, "  <think>a plan</think> the answer ", "a plan", "the answer "),
    (CLOSED, "<think>not thinking</think>answer", "", "<think>not thinking</think>answer"),
]  # fmt: skip


def split(mode, pieces):
    splitter = ReasoningSplitter(mode)
    thinking, answer = "", ""
    for piece in [*pieces, None]:
        more = splitter.feed(piece) if piece is not None else splitter.finish()
        thinking, answer = thinking + more[0], answer + more[1]
    return thinking, answer


@pytest.mark.parametrize("mode, reply, thinking, answer", FIXTURES)
def test_the_split_and_every_streamed_split_agree(mode, reply, thinking, answer):
    assert split(mode, [reply]) == (thinking, answer)
    for cut in range(len(reply) + 1):
        assert split(mode, [reply[:cut], reply[cut:]]) == (thinking, answer), cut
    assert split(mode, list(reply)) == (thinking, answer)


def test_the_thinking_streams_before_it_ends():
    splitter = ReasoningSplitter(OPEN)
    assert splitter.feed("<think>Let me see") == ("Let me see", "")
    assert splitter.feed(" more</th") == (" more", "")  # '</th' may be the closing tag
    assert splitter.feed("ink>\n\nYes") == ("", "Yes")


QWEN3_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    "parser, tail, kwargs, mode",
    [
        ("qwen3", QWEN3_PROMPT, {}, OPEN),
        ("qwen3", QWEN3_PROMPT, {"enable_thinking": False}, CLOSED),
        ("qwen3", QWEN3_PROMPT + "<think>\n\n</think>\n\n", {}, CLOSED),
        ("deepseek_r1", "<｜Assistant｜><think>\n", {}, OPEN),
        ("think", QWEN3_PROMPT, {}, OPTIONAL),
        ("think", QWEN3_PROMPT + "<think>\n", {}, OPEN),
        ("think", "<think>old</think>earlier answer<|im_start|>assistant\n", {}, OPTIONAL),
    ],
)
def test_the_prompt_and_enable_thinking_set_the_mode(parser, tail, kwargs, mode):
    assert REASONING_PARSERS[parser].mode(tail, kwargs) is mode


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))


def test_thinking_tokens_end_with_the_closing_tag(tokenizer):
    ids = tokenizer.encode("<think>why not</think>\n\nbecause", add_special_tokens=False)
    count = reasoning_token_count(OPEN, ids, tokenizer.decode)
    assert "</think>" in tokenizer.decode(ids[:count])
    assert "</think>" not in tokenizer.decode(ids[: count - 1])
    assert reasoning_token_count(OPEN, ids[: count - 1], tokenizer.decode) == count - 1  # cut
    assert reasoning_token_count(CLOSED, ids, tokenizer.decode) == 0
    plain = tokenizer.encode("because", add_special_tokens=False)
    assert reasoning_token_count(OPTIONAL, plain, tokenizer.decode) == 0


TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


def test_tool_calls_are_read_from_the_answer_only():
    call = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    reply = f"<think>I could write {call} here.</think>\n\nChecking. {call}"
    plan = ReplyPlan(ToolCallPlan("auto", TOOLS, "hermes"), OPEN)
    whole = plan.whole(reply)
    assert whole.reasoning == f"I could write {call} here."
    assert whole.content == "Checking." and [c.name for c in whole.calls] == ["get_time"]
    hidden = ReplyPlan(ToolCallPlan("auto", TOOLS, "hermes"), OPEN, include_reasoning=False)
    assert hidden.whole(reply).reasoning is None


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.fixture(scope="module")
def walk(tokenizer):
    """``walk(constraint, text) -> bool``: may the reply be ``text``, then end?"""
    backend = XgrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])

    def allowed(constraint, text: str) -> bool:
        matcher = backend.compile(constraint).matcher()
        ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        return all(matcher.accept_token(t) for t in ids)

    return allowed


@pytest.mark.parametrize(
    "mode, text, allowed",
    [
        (OPEN, 'any thought { at all</think>\n\n{"n": 4}', True),
        (OPEN, '{"n": 4}', False),  # the thinking must close before the answer
        (OPEN, 'thought</think>{"n": "four"}', False),
        (OPTIONAL, '<think>a thought</think>\n{"n": 4}', True),
        (OPTIONAL, '{"n": 4}', True),
        (OPTIONAL, 'Sure: {"n": 4}', False),
        (CLOSED, '{"n": 4}', True),
        (CLOSED, '<think>x</think>{"n": 4}', False),
    ],
)
def test_a_json_answer_is_held_after_free_thinking(walk, mode, text, allowed):
    constraint = answer_only(StructuredOutputsParams(json=SCHEMA), mode, "response_format")
    assert walk(constraint, text) is allowed


def test_every_kind_of_constraint_follows_the_thinking(walk):
    cases = [
        (StructuredOutputsParams(regex=r"[0-9]+"), "42", "4x"),
        (StructuredOutputsParams(choice=["yes", "no"]), "no", "maybe"),
        (StructuredOutputsParams(grammar='root ::= "a" "b"*'), "abbb", "ba"),
        (StructuredOutputsParams(json_object=True), json.dumps({"k": [1]}), "[1]"),
    ]
    for constraint, good, bad in cases:
        wrapped = answer_only(constraint, OPEN, "structured_outputs")
        assert walk(wrapped, f"hmm</think>{good}") and not walk(wrapped, f"hmm</think>{bad}")
