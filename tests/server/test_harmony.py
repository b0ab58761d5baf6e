"""gpt-oss's replies in OpenAI's harmony format, read by ``--reasoning-parser openai_gptoss`` and
``--tool-call-parser openai`` through the reply plan every route reads replies with: the
analysis channel is the thinking, the final channel the content, commentary to
``functions.NAME`` a tool call (in either header order: the model's own, and the one gpt-oss's
chat template writes calls back in), a preamble content; the same split streamed at every cut
of the reply; and what the server picks and refuses for gpt-oss.

The replies are harmony as the format's guide writes gpt-oss's outputs (the prompt ending in
``<|start|>assistant``), with and without the stop token (``<|return|>``, ``<|call|>``) that
ends generation and that the engine may leave out of the text.
"""

from __future__ import annotations

import json
import re

import pytest

from pagedserve.server.reasoning import REASONING_PARSERS, ReasoningMode, answer_only
from pagedserve.server.reply import ReplyPlan
from pagedserve.server.tool_parsers import detect_tool_parser
from pagedserve.server.tools import ToolCallPlan

HARMONY = ReasoningMode.HARMONY
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_current_weather",
        "parameters": {"type": "object", "properties": {"location": {"type": "string"}}},
    },
}

ANSWER = (
    '<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple arithmetic. Provide '
    "answer.<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>"
)
CALL = (
    "<|channel|>analysis<|message|>Need to use function get_current_weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_current_weather <|constrain|>json"
    '<|message|>{"location":"San Francisco"}<|call|>'
)
# a preamble, then a call with its recipient before the channel (as the chat template writes
# calls back into the prompt), cut by the engine before its <|call|>
PREAMBLE_CALL = (
    "<|channel|>analysis<|message|>Two cities; check the first.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Checking Tokyo first.<|end|>"
    "<|start|>assistant to=functions.get_current_weather<|channel|>commentary json"
    '<|message|>{"location": "Tokyo"}'
)


def read(reply: str, pieces: list[str] | None = None, tools: str = "auto"):
    """(thinking, content, [(name, arguments)]) of a reply, fed whole or in ``pieces``."""
    plan = ReplyPlan(ToolCallPlan(tools, [WEATHER], "openai"), HARMONY)
    reader = plan.reader()
    thinking, content, calls = "", "", []
    for piece in [*(pieces or [reply]), None]:
        delta = reader.feed(piece) if piece is not None else reader.finish()
        thinking, content = thinking + delta.reasoning, content + delta.content
        calls += [(c.name, json.loads(c.arguments)) for c in delta.calls if c.name]
    return thinking, content, calls


CASES = {
    "answer": (ANSWER, 'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.',
               "2 + 2 = 4.", []),
    "answer-cut": (ANSWER.removesuffix("<|return|>"),
                   'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.',
                   "2 + 2 = 4.", []),
    "call": (CALL, "Need to use function get_current_weather.", "",
             [("get_current_weather", {"location": "San Francisco"})]),
    "preamble-call": (PREAMBLE_CALL, "Two cities; check the first.", "Checking Tokyo first.",
                      [("get_current_weather", {"location": "Tokyo"})]),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_thinking_content_and_calls_the_same_whole_and_streamed(case):
    reply, thinking, content, calls = CASES[case]
    assert read(reply) == (thinking, content, calls)
    for cut in range(len(reply) + 1):
        assert read(reply, [reply[:cut], reply[cut:]]) == (thinking, content, calls), cut
    assert read(reply, list(reply)) == (thinking, content, calls)


def test_the_thinking_streams_before_its_message_ends():
    reader = ReplyPlan(ToolCallPlan("none", [], "openai"), HARMONY).reader()
    assert reader.feed("<|channel|>analysis<|message|>Let me think").reasoning == "Let me think"
    assert reader.feed(" more<|e").reasoning == " more"  # "<|e" may be <|end|>: held
    delta = reader.feed("nd|><|start|>assistant<|channel|>final<|message|>Done")
    assert (delta.reasoning, delta.content) == ("", "Done")


def test_without_tools_a_call_stays_in_the_content_as_one_canonical_message():
    _, content, calls = read(CALL, tools="none")
    assert calls == []
    assert content == (
        "<|channel|>commentary to=functions.get_current_weather <|constrain|>json<|message|>"
        '{"location":"San Francisco"}<|call|>'
    )


def test_a_call_to_a_builtin_tool_or_with_broken_arguments_is_content():
    python = CALL.replace("functions.get_current_weather", "python")
    assert read(python)[2] == [] and "to=python" in read(python)[1]
    broken = CALL.replace('{"location":"San Francisco"}', '{"location": ')
    assert read(broken)[2] == []


def test_a_reply_that_is_not_harmony_is_all_content():
    assert read("Just text, no channels.") == ("", "Just text, no channels.", [])


def test_thinking_tokens_end_with_the_analysis_message():
    """A "token" a marker or a word: the thinking is every token up to its <|end|>."""
    plan = ReplyPlan(ToolCallPlan("none", [], "openai"), HARMONY)
    tokens = re.findall(r"<\|\w+\|>|\s*[^\s<]+", ANSWER)
    assert "".join(tokens) == ANSWER
    assert plan.reasoning_tokens(tokens, "".join) == tokens.index("<|end|>") + 1
    final = ANSWER[ANSWER.index("<|start|>") + len("<|start|>assistant") :]  # no thinking
    assert plan.reasoning_tokens(re.findall(r"<\|\w+\|>|\s*[^\s<]+", final), "".join) == 0


def test_the_server_reads_gpt_oss_with_harmony_and_refuses_tag_constraints():
    assert REASONING_PARSERS["openai_gptoss"].mode("<|start|>assistant", {}) is HARMONY
    template = (  # the call gpt-oss's chat template writes back into a prompt
        '{{- "<|start|>assistant to=" }}{{- "functions." + tool_call.name + '
        '"<|channel|>commentary " }}'
    )
    assert detect_tool_parser(template) == "openai"
    from pagedserve.engine.structured_output import StructuredOutputsParams

    with pytest.raises(Exception, match="openai_gptoss"):
        answer_only(StructuredOutputsParams(json={"type": "object"}), HARMONY, "response_format")
