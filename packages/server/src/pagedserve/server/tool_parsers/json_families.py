"""Formats whose calls are JSON objects between markers (examples are one call each):

- ``hermes`` (Hermes 2/3, Qwen 2.5, Qwen3): ``<tool_call>{"name": "f", "arguments": {...}}
  </tool_call>``, text before the first call is content.
- ``mistral`` (Mistral, Mixtral, Ministral, Mistral Small, Magistral): ``[TOOL_CALLS]`` then
  either a JSON list ``[{"name": "f", "arguments": {...}}, ...]`` (tokenizers before v11) or
  ``f[ARGS]{...}`` (v11 and later, one ``[TOOL_CALLS]`` per call).
- ``granite`` (IBM Granite 3.x): ``<|tool_call|>`` (3.0) or ``<tool_call>`` (3.1 on) then a JSON
  list of ``{"name", "arguments"}``.
- ``internlm`` (InternLM 2/2.5): ``<|action_start|><|plugin|>{"name": "f", "parameters": {...}}
  <|action_end|>``.
- ``llama3_json`` (Llama 3.1/3.2/3.3 JSON calls): the whole reply is ``{"name": "f",
  "parameters": {...}}`` (optionally after ``<|python_tag|>``), or several joined by ``;``.

Mistral's, Granite 3.0's and InternLM's markers are special tokens, which a reply keeps only when
detokenized with ``skip_special_tokens`` off: those parsers turn it off for requests with tools.
"""

from __future__ import annotations

import json

from pagedserve.server.tool_parsers.base import (
    CallFrame,
    DelimitedCallParser,
    ParsedCall,
    Piece,
    ToolCallParser,
    call_of,
    json_value_end,
    load_json,
    plain_name,
)


class HermesParser(DelimitedCallParser):
    name = "hermes"
    opens = ("<tool_call>",)
    close = "</tool_call>"
    frame = CallFrame("<tool_call>", '<tool_call>{{"name": {name}, "arguments": ', "}</tool_call>")

    def parse_body(self, body: str) -> list[ParsedCall] | None:
        call = call_of(load_json(body.strip()))
        return [call] if call else None


class InternLMParser(DelimitedCallParser):
    name = "internlm"
    skip_special_tokens = False
    opens = ("<|action_start|><|plugin|>",)
    close = "<|action_end|>"
    frame = CallFrame(
        "<|action_start|><|plugin|>",
        '<|action_start|><|plugin|>{{"name": {name}, "parameters": ',
        "}<|action_end|>",
    )

    def parse_body(self, body: str) -> list[ParsedCall] | None:
        call = call_of(load_json(body.strip()), ("parameters", "arguments"))
        return [call] if call else None


def calls_of_list(text: str) -> list[ParsedCall] | None:
    """A JSON list of ``{"name", "arguments"}`` objects as calls (None if any is not one)."""
    items = load_json(text.strip())
    if not isinstance(items, list) or not items:
        return None
    calls = [call_of(item) for item in items]
    return None if None in calls else calls  # type: ignore[return-value]


class GraniteParser(DelimitedCallParser):
    name = "granite"
    skip_special_tokens = False
    opens = ("<|tool_call|>", "<tool_call>")
    frame = CallFrame("<tool_call>", '<tool_call>[{{"name": {name}, "arguments": ', "}]")

    def body_end(self, text: str, body: int, final: bool) -> tuple[int, int] | None:
        end = json_value_end(text, body)
        if end is not None:
            return end, end
        return (len(text), len(text)) if final else None

    def parse_body(self, body: str) -> list[ParsedCall] | None:
        return calls_of_list(body)


class MistralParser(DelimitedCallParser):
    name = "mistral"
    skip_special_tokens = False
    opens = ("[TOOL_CALLS]",)
    frame = CallFrame("[TOOL_CALLS]", "[TOOL_CALLS]{raw_name}[ARGS]", "")

    def body_end(self, text: str, body: int, final: bool) -> tuple[int, int] | None:
        start = body
        while start < len(text) and text[start].isspace():
            start += 1
        if text.startswith("[", start):  # the JSON list of the older tokenizers
            end = json_value_end(text, start)
        else:  # name[ARGS]{...}
            args = text.find("[ARGS]", start)
            end = None if args < 0 else json_value_end(text, args + len("[ARGS]"))
        if end is not None:
            return end, end
        return (len(text), len(text)) if final else None

    def parse_body(self, body: str) -> list[ParsedCall] | None:
        if body.lstrip().startswith("["):
            return calls_of_list(body)
        name, sep, arguments = body.partition("[ARGS]")
        if not sep:
            return None
        call = call_of({"name": plain_name(name), "arguments": load_json(arguments)})
        return [call] if call else None


class Llama3JsonParser(ToolCallParser):
    """The whole reply is the calls, or it is content: a reply that opens with ``{`` (after
    ``<|python_tag|>``) is held to its end and read then; any other streams as content."""

    name = "llama3_json"
    frame = CallFrame('{"name": ', '{{"name": {name}, "parameters": ', "}")
    _tag = "<|python_tag|>"

    def __init__(self, tools) -> None:
        super().__init__(tools)
        self._calls: bool | None = None  # undecided until the reply's first character

    def scan(self, text: str, final: bool) -> tuple[list[Piece], int]:
        if self._calls is None:
            head = text.lstrip()
            if not final and (not head or self._tag.startswith(head)):
                return [], 0  # nothing yet, or (part of) the python tag
            self._calls = head.removeprefix(self._tag).lstrip().startswith("{")
        if not self._calls:
            return ([text] if text else []), len(text)
        if not final:
            return [], 0
        calls = self._parse(text.strip().removeprefix(self._tag).strip())
        return (calls or [text]), len(text)

    @staticmethod
    def _parse(body: str) -> list[ParsedCall] | None:
        calls, decoder, position = [], json.JSONDecoder(), 0
        while position < len(body):
            try:
                obj, position = decoder.raw_decode(body, position)
            except json.JSONDecodeError:
                return None
            call = call_of(obj, ("parameters", "arguments"))
            if call is None:
                return None
            calls.append(call)
            while position < len(body) and body[position] in " \n\t;":
                position += 1
        return calls
