"""``pythonic`` (Llama 3.2, Llama 4, and models tuned to call tools as Python): the whole reply
is a Python list of calls with keyword arguments, ``[get_weather(city="Paris", days=3),
get_time(zone="CET")]``, optionally between Llama 4's ``<|python_start|>`` and
``<|python_end|>``. Arguments are Python literals (strings, numbers, True/False/None, lists,
dicts), read without evaluating anything.

A reply that opens with ``[`` is held to its end and read then (it is the calls, or it is
content); any other streams as content.
"""

from __future__ import annotations

import ast
import json

from pagedserve.server.tool_parsers.base import ParsedCall, Piece, ToolCallParser

START, END = "<|python_start|>", "<|python_end|>"


class PythonicParser(ToolCallParser):
    name = "pythonic"

    def __init__(self, tools) -> None:
        super().__init__(tools)
        self._calls: bool | None = None

    def scan(self, text: str, final: bool) -> tuple[list[Piece], int]:
        if self._calls is None:
            head = text.lstrip()
            if not final and (not head or START.startswith(head)):
                return [], 0
            self._calls = head.removeprefix(START).lstrip().startswith("[")
        if not self._calls:
            return ([text] if text else []), len(text)
        if not final:
            return [], 0
        body = text.strip().removeprefix(START).removesuffix(END).strip()
        calls = parse_python_calls(body)
        return (calls or [text]), len(text)


def parse_python_calls(body: str) -> list[ParsedCall] | None:
    """``[f(a=1), g()]`` as calls; None when it is not a list of such calls."""
    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, ast.Name):
            return None
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
        if None in arguments:  # **kwargs
            return None
        try:
            text = json.dumps(arguments, ensure_ascii=False)
        except (TypeError, ValueError):  # a set, bytes, a complex number: no JSON for it
            return None
        calls.append(ParsedCall(node.func.id, text))
    return calls
