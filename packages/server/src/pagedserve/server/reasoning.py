"""Reasoning parsers (``--reasoning-parser``): a reasoning model's reply -> its thinking and its
answer, as vLLM returns them (``reasoning_content``/``reasoning`` beside ``content``).

The models think between ``<think>`` and ``</think>``; they differ in who writes the opening tag:

- ``deepseek_r1`` (DeepSeek-R1 and its distills, QwQ) and ``qwen3`` (Qwen3, Qwen3.5): the reply
  starts in the thinking whether the model writes ``<think>`` itself or the chat template put it
  in the prompt. A reply with no ``</think>`` is all thinking (cut short while thinking).
- ``think`` (any model that opens ``<think>`` itself): the reply is thinking only if it opens
  with ``<think>`` (or the prompt left one open); any other reply is all answer.
- ``openai_gptoss`` (gpt-oss) writes no tags but OpenAI's harmony messages: its analysis
  channel is the thinking, the rest the answer (harmony.py; its tool calls go on to the
  ``openai`` tool parser). Its replies are read with their special tokens kept; an output
  constraint or a thinking budget, written for tags, is refused under it.

No thinking is expected when the request says ``chat_template_kwargs: {"enable_thinking":
false}`` (Qwen3's switch; ``reasoning_effort: "none"`` sets it, as in vLLM), or when the prompt
already closed the thinking (a template that writes ``<think></think>`` to skip it): then the
whole reply is the answer. ``ReasoningMode`` says which of the three cases a request is in.

The split streams: ``ReasoningSplitter.feed`` returns what each piece of text settles, holding
back what could still be the start of a tag, so the pieces of every split of a reply add up to
its split as a whole. Whitespace between a tag and the text it wraps is layout: it is dropped.

``answer_only`` turns an output constraint (structured outputs, a tool_choice's grammar) into
one that leaves the thinking free and holds the answer after it, so that a reasoning model
still thinks before a JSON answer.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

from pagedserve.engine.structured_output import StructuredOutputsParams
from pagedserve.server.errors import bad_request
from pagedserve.server.harmony import HarmonySplitter
from pagedserve.server.tool_parsers.base import held_back

START, END = "<think>", "</think>"
PROMPT_TAIL_TOKENS = 64  # how much of a prompt's end is read to see whether it opened thinking


class ReasoningMode(enum.Enum):
    OPEN = "open"  # the reply starts in the thinking (a leading <think> is the tag, not text)
    OPTIONAL = "optional"  # the reply thinks only if it opens with <think>
    CLOSED = "closed"  # no thinking: the whole reply is the answer
    HARMONY = "harmony"  # harmony messages (gpt-oss): the analysis channel is the thinking


@dataclass(frozen=True)
class ReasoningParser:
    """One ``--reasoning-parser``: its name, and whether its models think without opening
    the tag themselves (``starts_thinking``)."""

    name: str
    starts_thinking: bool
    harmony: bool = False

    def mode(self, prompt_tail: str, template_kwargs: dict[str, Any]) -> ReasoningMode:
        """The mode of a request whose rendered prompt ends with ``prompt_tail``."""
        if self.harmony:
            return ReasoningMode.HARMONY
        if template_kwargs.get("enable_thinking") is False:
            return ReasoningMode.CLOSED
        opened, closed = prompt_tail.rfind(START), prompt_tail.rfind(END)
        if opened > closed:
            return ReasoningMode.OPEN
        if closed >= 0 and not prompt_tail[closed + len(END) :].strip():
            return ReasoningMode.CLOSED
        return ReasoningMode.OPEN if self.starts_thinking else ReasoningMode.OPTIONAL


REASONING_PARSERS = {
    parser.name: parser
    for parser in (
        ReasoningParser("deepseek_r1", starts_thinking=True),
        ReasoningParser("qwen3", starts_thinking=True),
        ReasoningParser("think", starts_thinking=False),
        ReasoningParser("openai_gptoss", starts_thinking=True, harmony=True),
    )
}


def reasoning_splitter(mode: ReasoningMode) -> ReasoningSplitter | HarmonySplitter:
    """A fresh splitter of one reply in ``mode``."""
    return HarmonySplitter() if mode is ReasoningMode.HARMONY else ReasoningSplitter(mode)


class ReasoningSplitter:
    """Splits one reply, fed in pieces, into thinking and answer (see the module docstring)."""

    def __init__(self, mode: ReasoningMode) -> None:
        self.mode = mode
        self._phase = "answer" if mode is ReasoningMode.CLOSED else "start"
        self._buffer = ""
        self._held_space = ""  # trailing whitespace of the thinking: dropped at </think>
        self._answer_started = mode is ReasoningMode.CLOSED
        self.ended = False  # the thinking closed (its </think> was read)
        self.thought = False  # some of the reply was thinking

    def feed(self, text: str) -> tuple[str, str]:
        """(thinking, answer) settled by ``text``."""
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> tuple[str, str]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, str]:
        reasoning, answer = "", ""
        if self._phase == "start":
            head = self._buffer.lstrip()
            if not final and START.startswith(head):
                return "", ""  # whitespace, or part of the opening tag, so far
            if head.startswith(START):
                self._buffer, self._phase = head[len(START) :].lstrip(), "thinking"
            elif self.mode is ReasoningMode.OPEN:
                self._buffer, self._phase = head, "thinking"
            else:
                self._phase, self._answer_started = "answer", True
        if self._phase == "thinking":
            end = self._buffer.find(END)
            if end >= 0:
                reasoning = self._thinking(self._buffer[:end])
                self._held_space, self.ended = "", True
                self._buffer, self._phase = self._buffer[end + len(END) :], "answer"
            else:
                keep = 0 if final else held_back(self._buffer, 0, (END,))
                cut = len(self._buffer) - keep
                reasoning, self._buffer = self._thinking(self._buffer[:cut]), self._buffer[cut:]
        if self._phase == "answer":
            if not self._answer_started:
                self._buffer = self._buffer.lstrip()
                self._answer_started = bool(self._buffer)
            answer, self._buffer = self._buffer, ""
        return reasoning, answer

    def _thinking(self, text: str) -> str:
        if not text:
            return ""
        if not self.thought:
            text = text.lstrip()
        text = self._held_space + text
        kept = text.rstrip()
        self._held_space = text[len(kept) :]
        self.thought = self.thought or bool(kept)
        return kept


def split_reply(mode: ReasoningMode, text: str) -> tuple[str, str, bool]:
    """A whole reply as (thinking, answer, whether the thinking closed)."""
    splitter = reasoning_splitter(mode)
    reasoning, answer = splitter.feed(text)
    more_reasoning, more_answer = splitter.finish()
    return reasoning + more_reasoning, answer + more_answer, splitter.ended


def reasoning_token_count(mode: ReasoningMode, token_ids: list[int], decode) -> int:
    """How many of a reply's tokens are thinking (its ``</think>`` included): the shortest
    prefix whose text closes the thinking, found by bisection over ``decode(ids) -> text``;
    all of them when the thinking never closed, none when there was none."""
    if mode is ReasoningMode.CLOSED or not token_ids:
        return 0
    reasoning, _, ended = split_reply(mode, decode(token_ids))
    if not ended:
        return len(token_ids) if reasoning else 0
    low, high = 1, len(token_ids)
    while low < high:
        middle = (low + high) // 2
        if split_reply(mode, decode(token_ids[:middle]))[2]:
            high = middle
        else:
            low = middle + 1
    return low


# ---- constraints on the answer only -------------------------------------------------------

ANSWER_GAP = {"type": "regex", "pattern": r"\s{0,4}"}  # the blank line after </think>


def answer_only(
    constraint: StructuredOutputsParams | None, mode: ReasoningMode | None, param: str
) -> StructuredOutputsParams | None:
    """``constraint`` applied after the thinking: the thinking is free text up to ``</think>``,
    then the answer is held to the constraint (``param`` names the field a refusal blames).
    Unchanged without a reasoning parser (``mode`` None) or thinking."""
    if constraint is None or mode is None or mode is ReasoningMode.CLOSED:
        return constraint
    if mode is ReasoningMode.HARMONY:
        raise bad_request(
            "an output constraint under --reasoning-parser openai_gptoss is not supported: "
            "it would hold the harmony messages' markup, not the final answer",
            param,
        )
    answer = [ANSWER_GAP, _as_format(constraint, param)]
    if mode is ReasoningMode.OPEN:
        thinking = {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": END}
        fmt: dict = {"type": "sequence", "elements": [thinking, *answer]}
    else:
        thinking = {"type": "tag", "begin": START, "content": {"type": "any_text"}, "end": END}
        fmt = {
            "type": "or",
            "elements": [{"type": "sequence", "elements": [thinking, *answer]}, answer[1]],
        }
    return StructuredOutputsParams(
        structural_tag={"type": "structural_tag", "format": fmt},
        disable_any_whitespace=constraint.disable_any_whitespace,
    )


def _as_format(constraint: StructuredOutputsParams, param: str) -> dict:
    """One constraint as an element of xgrammar's structural tag format."""
    kind = constraint.kind
    if kind in ("json", "json_object"):
        schema = constraint.json if kind == "json" else {"type": "object"}
        return {"type": "json_schema", "json_schema": schema}  # the backend checks and loads it
    if kind == "regex":
        return {"type": "regex", "pattern": constraint.regex}
    if kind == "choice":
        alternatives = " | ".join(json.dumps(choice) for choice in constraint.choice or [])
        return {"type": "grammar", "grammar": f"root ::= {alternatives}"}
    if kind == "grammar":
        return {"type": "grammar", "grammar": constraint.grammar}
    tag = constraint.structural_tag
    tag = json.loads(tag) if isinstance(tag, str) else tag
    if not isinstance(tag, dict) or "format" not in tag:
        raise bad_request(
            "with a reasoning parser, a structural tag must be in xgrammar's format form "
            '({"type": "structural_tag", "format": ...}) so that it can follow the thinking',
            param,
        )
    return tag["format"]


def thinking_budget(
    tokenizer, parser: str | None, mode: ReasoningMode | None, budget: int | None, param: str
) -> dict:
    """SamplingParams fields for vLLM's ``thinking_token_budget`` (``param``: the field's name in
    the request): the budget, and where the thinking starts and ends as the tokenizer writes
    ``<think>`` and ``</think>`` (in the request's reasoning ``mode``, an OPEN reply starts
    inside the thinking); the engine forces the end once the thinking has that many tokens.
    None and -1 ask for no budget, and a request that does not think needs none. It needs
    ``--reasoning-parser``: without one the server does not know the model thinks."""
    if budget is None or budget == -1 or mode is ReasoningMode.CLOSED:
        return {}
    if budget < 0:
        raise bad_request(f"{param} must be a non-negative integer or -1 (unlimited)", param)
    if mode is ReasoningMode.HARMONY or (parser and REASONING_PARSERS[parser].harmony):
        raise bad_request(f"{param} is for <think> models; gpt-oss's harmony has none", param)
    if parser is None:
        raise bad_request(
            f"{param} needs a reasoning model served with --reasoning-parser, which says where "
            "its thinking starts and ends",
            param,
        )
    return {
        "thinking_token_budget": budget,
        "thinking_start_token_ids": tokenizer.encode(START, add_special_tokens=False),
        "thinking_end_token_ids": tokenizer.encode(END, add_special_tokens=False),
        "thinking_starts_open": mode is ReasoningMode.OPEN,
    }
