"""``openai``: gpt-oss's tool calls, in OpenAI's harmony format.

A harmony call is a message to a recipient on the commentary channel, its arguments a JSON
object: ``<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":
"Tokyo"}<|call|>``. ``--reasoning-parser openai_gptoss`` (server/harmony.py) reads a reply's
messages and hands every call on in exactly that canonical form, whatever header order the
model wrote; this parser reads those calls out of the answer, the rest being content. A
message to something other than ``functions.NAME`` (a built-in tool), or whose arguments are
not a JSON object, stays content, as the model wrote it.
"""

from __future__ import annotations

import json

from pagedserve.server.tool_parsers.base import (
    DelimitedCallParser,
    ParsedCall,
    load_json,
    plain_name,
)

CALL_OPEN = "<|channel|>commentary to="  # the canonical call: CALL_OPEN recipient ... CALL_END
CALL_HEADER_END = "<|message|>"
CALL_END = "<|call|>"


class OpenAIToolParser(DelimitedCallParser):
    name = "openai"
    skip_special_tokens = False  # harmony's markers are special tokens
    opens = (CALL_OPEN,)
    close = CALL_END

    def parse_body(self, body: str) -> list[ParsedCall] | None:
        header, found, arguments = body.partition(CALL_HEADER_END)
        words = header.split()
        if not found or not words or not words[0].startswith("functions."):
            return None
        name = plain_name(words[0].removeprefix("functions."))
        value = load_json(arguments)
        if name is None or not isinstance(value, dict):
            return None
        return [ParsedCall(name, json.dumps(value, ensure_ascii=False))]
