"""Tool-call parsers (``--tool-call-parser``): the model's text -> (content, tool calls).

- ``hermes`` (Hermes, Qwen 2.5/3): each call is ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>``; text before the first call is the message's content. A last call cut off
  before its closing tag still counts when its JSON is whole.
- ``llama3_json`` (Llama 3.1/3.2): the whole reply is a JSON object ``{"name": ...,
  "parameters": {...}}`` (optionally after ``<|python_tag|>``), or several joined by ``;``.

A reply that is not a well-formed call is plain content: an "auto" answer that chose not to
call a tool, or that tried and failed, is returned as text rather than as a broken call.

Each parser also has a ``CallFrame``: how a call opens and closes in its format, which is what
the grammar engine needs to hold a ``strict`` tool's arguments to its schema under "auto"
(tools.py): free text until the opening is written, then the call.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

ParsedCall = tuple[str, str]  # (function name, arguments as JSON text)
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _call(obj, arguments_key: str) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    if not isinstance(arguments, dict):
        return None
    return obj["name"], json.dumps(arguments, ensure_ascii=False)


def parse_hermes(text: str) -> tuple[str | None, list[ParsedCall]]:
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = []
    for body in _HERMES.findall(text[start:]):
        try:
            call = _call(json.loads(body), "arguments")
        except json.JSONDecodeError:
            call = None
        if call is None:
            return text, []
        calls.append(call)
    content = text[:start].strip()
    return content or None, calls


def parse_llama3_json(text: str) -> tuple[str | None, list[ParsedCall]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    calls = []
    decoder = json.JSONDecoder()
    position = 0
    while position < len(body):
        try:
            obj, end = decoder.raw_decode(body, position)
        except json.JSONDecodeError:
            return text, []
        call = _call(obj, "parameters")
        if call is None:
            return text, []
        calls.append(call)
        position = end
        while position < len(body) and body[position] in " \n\t;":
            position += 1
    return None, calls


TOOL_CALL_PARSERS: dict[str, Callable[[str], tuple[str | None, list[ParsedCall]]]] = {
    "hermes": parse_hermes,
    "llama3_json": parse_llama3_json,
}


@dataclass(frozen=True)
class CallFrame:
    """A call in a parser's format: ``trigger``, then the rest of ``begin`` (which starts with
    it) with the function's name, the arguments' JSON object, then ``end``."""

    trigger: str
    begin: str  # format() with name=<the name as a JSON string>
    end: str


CALL_FRAMES: dict[str, CallFrame] = {
    "hermes": CallFrame(
        "<tool_call>", '<tool_call>{{"name": {name}, "arguments": ', "}</tool_call>"
    ),
    "llama3_json": CallFrame('{"name": ', '{{"name": {name}, "parameters": ', "}"),
}
