"""Readers of replies that the grammar engine wrote to a tool_choice (tools.py):

- "required": a JSON array of ``{"name", "arguments"}``. Each element is a call once its
  closing brace is written, so calls stream one by one. A list cut short (``max_tokens``) keeps
  the calls completed before the cut; the unfinished rest is returned as content, and the
  response's ``finish_reason`` ("length") says that the list was cut.
- a named function: the reply is that function's arguments, streamed as they are written.
"""

from __future__ import annotations

import json

from pagedserve.server.tool_parsers.base import (
    CallDelta,
    ParsedCall,
    ParsedDelta,
    Piece,
    ToolCallParser,
    call_of,
    json_value_end,
)


class RequiredCallsParser(ToolCallParser):
    name = "required"

    def __init__(self, tools) -> None:
        super().__init__(tools)
        self._opened = False

    def scan(self, text: str, final: bool) -> tuple[list[Piece], int]:
        pieces: list[Piece] = []
        position = 0
        if not self._opened:
            start = text.find("[")
            if start < 0 or text[:start].strip():
                return ([text] if final and text else []), (len(text) if final else 0)
            self._opened, position = True, start + 1
        while True:
            while position < len(text) and text[position] in " \n\t\r,":
                position += 1
            if text.startswith("]", position):
                position += 1
                break
            end = json_value_end(text, position)
            if end is None:
                break
            call = call_of(_loads(text[position:end]))
            if call is None:
                break
            pieces.append(call)
            position = end
        if final and position < len(text):
            pieces.append(text[position:])
            position = len(text)
        return pieces, position


def _loads(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


class NamedCallParser:
    """The reply is the named function's arguments: one call, streamed as it is written."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._started = False

    def feed(self, text: str) -> ParsedDelta:
        if not text:
            return ParsedDelta()
        delta = ParsedDelta(calls=[CallDelta(0, None if self._started else self.name, text)])
        self._started = True
        return delta

    def finish(self) -> ParsedDelta:
        if self._started:
            return ParsedDelta()
        self._started = True
        return ParsedDelta(calls=[CallDelta(0, self.name, "")])


__all__ = ["NamedCallParser", "ParsedCall", "RequiredCallsParser"]
