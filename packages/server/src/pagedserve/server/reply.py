"""One choice's reply, read as it streams: its thinking (reasoning.py), then its answer, which
the request's tool plan (tools.py) reads into content and tool calls.

``ReplyPlan`` is what a request decided about its replies (its reasoning mode, its tools);
``ReplyPlan.reader()`` gives a fresh ``ReplyReader`` per choice, whose ``feed``/``finish`` return
``ReplyDelta``s; ``ReplyPlan.whole(text)`` reads a finished reply at once. Tool parsing and any
tool grammar see only the answer, never the thinking. Every route (chat, responses, messages)
reads replies through this one path, so a streamed reply and a whole one agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.server.harmony import HarmonySplitter
from pagedserve.server.reasoning import (
    ReasoningMode,
    ReasoningSplitter,
    reasoning_splitter,
    reasoning_token_count,
)
from pagedserve.server.tool_parsers import CallDelta, ParsedCall, ParsedDelta


@dataclass
class ReplyDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)

    def __iadd__(self, other: ReplyDelta) -> ReplyDelta:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls += other.calls
        return self


@dataclass
class Reply:
    """A whole reply: None where a part is empty (as OpenAI's ``content: null``)."""

    reasoning: str | None
    content: str | None
    calls: list[ParsedCall]


class ReplyReader:
    def __init__(self, splitter: ReasoningSplitter | HarmonySplitter | None, calls) -> None:
        self.splitter = splitter
        self.calls = calls  # a tool parser (tool_parsers), or None: the answer is content

    def feed(self, text: str) -> ReplyDelta:
        reasoning, answer = self.splitter.feed(text) if self.splitter else ("", text)
        return self._answer(reasoning, answer, final=False)

    def finish(self) -> ReplyDelta:
        reasoning, answer = self.splitter.finish() if self.splitter else ("", "")
        return self._answer(reasoning, answer, final=True)

    def _answer(self, reasoning: str, answer: str, final: bool) -> ReplyDelta:
        if self.calls is None:
            return ReplyDelta(reasoning, answer)
        parsed: ParsedDelta = self.calls.feed(answer)
        if final:
            parsed += self.calls.finish()
        return ReplyDelta(reasoning, parsed.content, parsed.calls)


@dataclass
class ReplyPlan:
    """``reasoning``: the request's reasoning mode (None without a reasoning parser);
    ``tools``: its ToolCallPlan; ``include_reasoning`` false drops the thinking (vLLM's field)."""

    tools: object
    reasoning: ReasoningMode | None = None
    include_reasoning: bool = True

    def reader(self) -> ReplyReader:
        splitter = reasoning_splitter(self.reasoning) if self.reasoning is not None else None
        return ReplyReader(splitter, self.tools.reader())

    def whole(self, text: str) -> Reply:
        reader = self.reader()
        delta = reader.feed(text)
        delta += reader.finish()
        return Reply(
            reasoning=self.shown_reasoning(delta.reasoning) or None,
            content=delta.content or None,
            calls=joined_calls(delta.calls),
        )

    def shown_reasoning(self, text: str) -> str:
        return text if self.include_reasoning else ""

    def reasoning_tokens(self, token_ids: list[int], decode) -> int:
        if self.reasoning is None:
            return 0
        return reasoning_token_count(self.reasoning, token_ids, decode)


def joined_calls(deltas: list[CallDelta]) -> list[ParsedCall]:
    """Call deltas (a call's name first, then its arguments in pieces) as whole calls."""
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for delta in deltas:
        if delta.name is not None:
            names[delta.index] = delta.name
        arguments[delta.index] = arguments.get(delta.index, "") + delta.arguments
    return [ParsedCall(names[i], arguments[i]) for i in sorted(names)]
