"""How a tool-call parser reads one reply as it streams.

A parser is fed the reply's text in pieces (``feed``) and told when it ends (``finish``); each
call returns a ``ParsedDelta``: the content and the tool calls that are *settled* by the text so
far. A call is settled once it is complete and well-formed, so a stream never carries a call the
whole reply would not have: the streamed deltas of a reply, however its text was split, add up to
exactly what one ``feed`` of the whole text and ``finish`` give (the tests split fixtures at every
character). What could still turn out to be the start of a call (``<tool_`` at the end of the text
so far) is held back until the next piece decides it.

A call that opens but does not parse (bad JSON, a missing name) is content: its text is returned
as the model wrote it, never as a broken call and never as an error.

Whitespace that only separates content from calls (the newline before ``<tool_call>``, between
two calls, after the last) is layout, not content: it is dropped. A reply without calls keeps its
text exactly.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ParsedCall:
    """A complete call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass
class CallDelta:
    """What a delta adds to call ``index``: its name on the call's first delta, then arguments
    (a parser of free-form calls sends a call whole; a named tool_choice streams its arguments)."""

    index: int
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedDelta:
    """Content and calls settled since the previous delta."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __iadd__(self, other: ParsedDelta) -> ParsedDelta:
        self.content += other.content
        self.calls += other.calls
        return self


@dataclass(frozen=True)
class CallFrame:
    """A call in a parser's format as the grammar engine sees it (tools.py: a ``strict`` tool
    under "auto"): ``trigger``, then the rest of ``begin`` (which starts with it) with the
    function's name, the arguments' JSON object, then ``end``."""

    trigger: str
    begin: str  # format() with name=<the name as a JSON string> or raw_name=<the name>
    end: str


Piece = str | ParsedCall


class ToolCallParser:
    """Reads one reply; subclasses say where calls are (``scan``).

    Class attributes: ``name`` (the ``--tool-call-parser`` value), ``skip_special_tokens``
    (False where the format's markers are special tokens that detokenizing would drop, so a
    request with tools keeps them), ``frame`` (None where the arguments are not one JSON object,
    so a strict tool cannot be held to its schema).
    """

    name: str = ""
    skip_special_tokens: bool = True
    frame: CallFrame | None = None

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        self.functions = {t["function"]["name"]: t["function"] for t in tools}
        self._buffer = ""
        self._num_calls = 0
        self._held_space = ""  # trailing whitespace of the content: layout if a call follows
        self._after_call = False

    def feed(self, text: str) -> ParsedDelta:
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> ParsedDelta:
        delta = self._drain(final=True)
        if not self._num_calls:
            delta.content += self._held_space
        self._held_space = ""
        return delta

    def scan(self, text: str, final: bool) -> tuple[list[Piece], int]:
        """The pieces settled at the start of ``text`` (the reply past what earlier scans
        consumed) and how many characters they consumed; with ``final`` there is no more
        text, so everything must be consumed."""
        raise NotImplementedError

    def _drain(self, final: bool) -> ParsedDelta:
        pieces, consumed = self.scan(self._buffer, final)
        self._buffer = self._buffer[consumed:]
        delta = ParsedDelta()
        for piece in pieces:
            if isinstance(piece, ParsedCall):
                self._held_space, self._after_call = "", True
                delta.calls.append(CallDelta(self._num_calls, piece.name, piece.arguments))
                self._num_calls += 1
            else:
                delta.content += self._content(piece)
        return delta

    def _content(self, text: str) -> str:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return ""
            self._after_call = False
        text = self._held_space + text
        kept = text.rstrip()
        self._held_space = text[len(kept) :]
        return kept


def held_back(text: str, start: int, markers: tuple[str, ...]) -> int:
    """How many characters at the end of ``text[start:]`` could begin one of ``markers``."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text) - start), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest


class DelimitedCallParser(ToolCallParser):
    """Calls between an opening marker (one of ``opens``) and ``close``, with content around
    them; ``parse_body`` reads the text between the markers into calls (None: malformed).

    Without a ``close`` (a format whose call ends where its JSON does), ``body_end`` says
    where a body ends. A body still open when the reply ends is parsed as it is (a model
    stopped by its end-of-turn token right after the arguments)."""

    opens: tuple[str, ...] = ()
    close: str | None = None

    def scan(self, text: str, final: bool) -> tuple[list[Piece], int]:
        pieces: list[Piece] = []
        position = 0
        while True:
            start, opening = self._next_open(text, position)
            if start < 0:
                end = len(text) if final else len(text) - held_back(text, position, self.opens)
                if end > position:
                    pieces.append(text[position:end])
                return pieces, max(end, position)
            if start > position:
                pieces.append(text[position:start])
            body = start + len(opening)
            found = self.body_end(text, body, final)
            if found is None:
                return pieces, start
            body_end, after = found
            calls = self.parse_body(text[body:body_end])
            pieces.extend(calls if calls else [text[start:after]])
            position = after

    def _next_open(self, text: str, position: int) -> tuple[int, str]:
        found = [(text.find(marker, position), marker) for marker in self.opens]
        found = [(index, marker) for index, marker in found if index >= 0]
        return min(found) if found else (-1, "")

    def body_end(self, text: str, body: int, final: bool) -> tuple[int, int] | None:
        """(end of the body, where the text after the call starts), or None to wait."""
        assert self.close is not None
        end = text.find(self.close, body)
        if end >= 0:
            return end, end + len(self.close)
        return (len(text), len(text)) if final else None

    def parse_body(self, body: str) -> list[ParsedCall] | None:
        raise NotImplementedError


def json_value_end(text: str, start: int) -> int | None:
    """Where the JSON value starting at ``text[start:]`` (after whitespace) ends; None while
    it is incomplete or not JSON. An object or array is complete only at its closing bracket,
    which no later text can change."""
    position = start
    while position < len(text) and text[position].isspace():
        position += 1
    try:
        _, end = json.JSONDecoder().raw_decode(text, position)
    except json.JSONDecodeError:
        return None
    return end


def call_of(obj: Any, arguments_keys: tuple[str, ...] = ("arguments",)) -> ParsedCall | None:
    """``{"name": ..., <arguments key>: {...}}`` as a call (arguments may also be given as
    the JSON text of an object); None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments: Any = {}
    for key in arguments_keys:
        if key in obj:
            arguments = obj[key]
            break
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


_NAME = re.compile(r"[^\s<>\[\]{}()\"']+")


def plain_name(text: str) -> str | None:
    """A function name written as text (not inside JSON): one word, no markup; None if not."""
    name = text.strip()
    return name if _NAME.fullmatch(name) else None


def load_json(text: str) -> Any:
    """The JSON value of ``text``, or None when it is not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None
