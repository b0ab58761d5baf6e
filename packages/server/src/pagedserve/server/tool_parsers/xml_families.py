"""Formats whose arguments are written one parameter at a time, as text:

- ``qwen3_coder`` (Qwen3-Coder, Qwen3.5)::

      <tool_call>
      <function=get_weather>
      <parameter=city>
      Paris
      </parameter>
      </function>
      </tool_call>

- ``glm45`` (GLM-4.5, GLM-4.6)::

      <tool_call>get_weather
      <arg_key>city</arg_key>
      <arg_value>Paris</arg_value>
      </tool_call>

A value is text; it becomes the JSON type the tool's ``parameters`` schema gives that parameter
(``"3"`` for an integer is 3, ``"[1, 2]"`` for an array a list). A value that does not read as its
type, or a parameter the schema does not name, is kept as it reads as JSON, else as a string.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from pagedserve.server.tool_parsers.base import (
    DelimitedCallParser,
    ParsedCall,
    load_json,
    plain_name,
)

_QWEN_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.DOTALL)
_QWEN_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_GLM_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def typed_value(text: str, schema: dict[str, Any] | None) -> Any:
    """``text`` as the type ``schema`` names (see the module docstring)."""
    kinds = (schema or {}).get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if "string" in kinds:
        return text
    if "integer" in kinds and re.fullmatch(r"-?\d+", text.strip()):
        return int(text)
    if "number" in kinds:
        try:
            number = float(text)
            return int(number) if number.is_integer() and "." not in text else number
        except ValueError:
            pass
    if "boolean" in kinds and text.strip().lower() in ("true", "false"):
        return text.strip().lower() == "true"
    value = load_json(text)
    if value is None and text.strip() != "null":
        try:  # a Python literal ({'a': 1}, True) where the model wrote one
            value = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return text
    return value


def arguments_json(function: dict[str, Any] | None, pairs: list[tuple[str, str]]) -> str:
    properties = ((function or {}).get("parameters") or {}).get("properties") or {}
    arguments = {key: typed_value(value, properties.get(key)) for key, value in pairs}
    return json.dumps(arguments, ensure_ascii=False)


def _strip_newline(value: str) -> str:
    """A value sits on its own lines: one newline either side is layout."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


class Qwen3CoderParser(DelimitedCallParser):
    name = "qwen3_coder"
    opens = ("<tool_call>",)
    close = "</tool_call>"

    def parse_body(self, body: str) -> list[ParsedCall] | None:
        match = _QWEN_FUNCTION.fullmatch(body)
        if match is None:
            return None
        name = plain_name(match.group(1))
        pairs = [(k.strip(), _strip_newline(v)) for k, v in _QWEN_PARAMETER.findall(match[2])]
        if not name or _QWEN_PARAMETER.sub("", match.group(2)).strip():
            return None  # text between the parameters: not this format
        return [ParsedCall(name, arguments_json(self.functions.get(name), pairs))]


class Glm45Parser(DelimitedCallParser):
    name = "glm45"
    opens = ("<tool_call>",)
    close = "</tool_call>"

    def parse_body(self, body: str) -> list[ParsedCall] | None:
        head, sep, rest = body.partition("<arg_key>")
        name, rest = plain_name(head), sep + rest
        pairs = [(k.strip(), v) for k, v in _GLM_ARGUMENT.findall(rest)]
        if not name or _GLM_ARGUMENT.sub("", rest).strip():
            return None
        return [ParsedCall(name, arguments_json(self.functions.get(name), pairs))]
