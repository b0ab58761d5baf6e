"""DeepSeek's calls, in a block of calls after the content (markers are DeepSeek's special
tokens, whose bars and spaces are the full-width ``｜`` and ``▁``):

- ``deepseek_v3`` (DeepSeek-V3, DeepSeek-R1)::

      <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
      ```json
      {"city": "Paris"}
      ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

- ``deepseek_v31`` (DeepSeek-V3.1): ``<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city":
  "Paris"}<｜tool▁call▁end｜>`` in the same block.

Each ``<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>`` is one call; the block's own markers are
layout.
"""

from __future__ import annotations

import re

from pagedserve.server.tool_parsers.base import (
    CallFrame,
    DelimitedCallParser,
    ParsedCall,
    Piece,
    call_of,
    held_back,
    load_json,
    plain_name,
)

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEPARATOR = "<｜tool▁sep｜>"
_V3_BODY = re.compile(r"function" + SEPARATOR + r"([^\n]+)\n```json\n(.*)\n```\s*", re.DOTALL)


class DeepSeekV3Parser(DelimitedCallParser):
    name = "deepseek_v3"
    opens = (CALL_BEGIN,)
    close = CALL_END
    frame = CallFrame(
        CALL_BEGIN,
        CALL_BEGIN + "function" + SEPARATOR + "{raw_name}\n```json\n",
        "\n```" + CALL_END,
    )

    def scan(self, text: str, final: bool) -> tuple[list[Piece], int]:
        """The calls as any delimited format's, the block markers around them dropped."""
        pieces, consumed = super().scan(text, final)
        kept: list[Piece] = []
        for piece in pieces:
            if isinstance(piece, str):
                piece = piece.replace(CALLS_BEGIN, "").replace(CALLS_END, "")
            if piece:
                kept.append(piece)
        if not final and consumed == len(text):  # hold a block marker's beginning too
            consumed -= held_back(text, 0, (CALLS_BEGIN, CALLS_END))
            kept = self._trim_held(kept, len(text) - consumed)
        return kept, consumed

    @staticmethod
    def _trim_held(pieces: list[Piece], size: int) -> list[Piece]:
        if size and pieces and isinstance(pieces[-1], str):
            last = pieces[-1][:-size]
            return [*pieces[:-1], last] if last else pieces[:-1]
        return pieces

    def parse_body(self, body: str) -> list[ParsedCall] | None:
        match = _V3_BODY.fullmatch(body)
        if match is None:
            return None
        call = call_of({"name": plain_name(match.group(1)), "arguments": load_json(match[2])})
        return [call] if call else None


class DeepSeekV31Parser(DeepSeekV3Parser):
    name = "deepseek_v31"
    frame = CallFrame(CALL_BEGIN, CALL_BEGIN + "{raw_name}" + SEPARATOR, CALL_END)

    def parse_body(self, body: str) -> list[ParsedCall] | None:
        name, sep, arguments = body.partition(SEPARATOR)
        if not sep:
            return None
        call = call_of({"name": plain_name(name), "arguments": load_json(arguments)})
        return [call] if call else None
