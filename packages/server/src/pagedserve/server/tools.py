"""Tool calling in chat: tools into the prompt, tool calls out of the reply.

- ``tool_choice`` "none" (or no tools): a plain chat; the tools are not shown to the model.
- "auto" (the default with tools): the tools are rendered into the prompt, the model answers
  freely, and ``--tool-call-parser`` (tool_parsers/) finds calls in its reply.
- "required" and a named function: the reply is held by the grammar engine to the calls'
  JSON: a named call's arguments follow its ``parameters`` schema; "required" writes a JSON
  array of ``{"name", "arguments"}`` (one element when ``parallel_tool_calls`` is false). The
  array has no length bound (as vLLM's schema for it): it ends where the model closes it, and a
  list cut by ``max_tokens`` keeps its complete calls (tool_parsers/forced.py).
- "auto" with a ``strict: true`` tool: the reply stays free text, but once the parser's call
  opening is written the grammar engine holds the call to a given tool's name and, for a strict
  tool, its ``parameters`` schema (xgrammar's triggered tags); with ``parallel_tool_calls``
  false the reply ends after its first call. A parser whose arguments are not one JSON object
  (pythonic, qwen3_coder, glm45) cannot hold a strict tool: such a request is a 400.

Tools are rendered by the chat template when it takes them (its source mentions ``tools``).
The documented default for a template without tool support (SmolLM2's): a system message that
lists the tools as JSON and asks for Hermes-style ``<tool_call>`` replies, assistant tool calls
written back in that form, and ``tool`` messages passed on as ``<tool_response>`` user turns.
A reply with calls has ``finish_reason: "tool_calls"``.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from pagedserve.engine.structured_output import StructuredOutputsParams
from pagedserve.server.errors import bad_request
from pagedserve.server.structured_protocol import FunctionCall, NamedToolChoice, ToolCall
from pagedserve.server.tool_parsers import (
    TOOL_CALL_PARSERS,
    NamedCallParser,
    ParsedCall,
    RequiredCallsParser,
    ToolCallParser,
    detect_tool_parser,
)

DEFAULT_TOOL_SYSTEM_PROMPT = (
    "You are a function-calling assistant. You may call one or more of these functions:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a function, reply with one line per call, exactly:\n"
    '<tool_call>{{"name": <function name>, "arguments": <arguments as a JSON object>}}'
    "</tool_call>\nIf no function is needed, answer normally."
)


def new_tool_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


@dataclass
class ToolCallPlan:
    """How one chat request uses its tools (mode "none" when it uses none)."""

    mode: str  # "none", "auto", "required" or "named"
    tools: list[dict[str, Any]]
    parser: str
    named: str | None = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        return self.mode != "none"

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar that enforces a "required" or named choice, or "auto" with a strict
        tool; None otherwise."""
        by_name = {t["function"]["name"]: t["function"] for t in self.tools}
        if self.mode == "named":
            return StructuredOutputsParams(json=_parameters(by_name[self.named]))
        if self.mode == "auto":
            return self._strict_calls(by_name)
        if self.mode != "required":
            return None
        call = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": _parameters(fn)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name, fn in by_name.items()
        ]
        items = call[0] if len(call) == 1 else {"anyOf": call}
        schema = {"type": "array", "items": items, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)

    def _strict_calls(self, by_name: dict[str, dict]) -> StructuredOutputsParams | None:
        """Under "auto": free text, and every call the model opens held to a given tool (a
        strict tool's arguments to its schema, another's to any JSON object)."""
        if not any(fn.get("strict") for fn in by_name.values()):
            return None
        frame = TOOL_CALL_PARSERS[self.parser].frame
        if frame is None:
            raise bad_request(
                f"a strict tool needs a tool-call parser whose arguments are one JSON object; "
                f"{self.parser!r} writes them otherwise (drop strict, or serve another parser)",
                "tools",
            )
        tags = [
            {
                "type": "tag",
                "begin": frame.begin.format(name=json.dumps(name), raw_name=name),
                "content": {
                    "type": "json_schema",
                    "json_schema": _parameters(fn) if fn.get("strict") else {"type": "object"},
                },
                "end": frame.end,
            }
            for name, fn in by_name.items()
        ]
        triggered = {"type": "triggered_tags", "triggers": [frame.trigger], "tags": tags}
        triggered["stop_after_first"] = not self.parallel
        return StructuredOutputsParams(
            structural_tag={"type": "structural_tag", "format": triggered}
        )

    @property
    def skip_special_tokens(self) -> bool:
        """False when the parser's markers are special tokens, which the reply must keep."""
        return not (self.mode == "auto" and not TOOL_CALL_PARSERS[self.parser].skip_special_tokens)

    def reader(self) -> ToolCallParser | NamedCallParser | None:
        """A fresh reader of one reply's answer (None: the answer is all content)."""
        if self.mode == "named":
            return NamedCallParser(self.named)
        if self.mode == "required":
            return RequiredCallsParser(self.tools)
        if self.mode == "auto":
            return TOOL_CALL_PARSERS[self.parser](self.tools)
        return None


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object", "properties": {}}


def as_tool_calls(calls: list[ParsedCall]) -> list[ToolCall]:
    """Parsed calls as OpenAI's ``tool_calls``, each with a new id."""
    return [
        ToolCall(id=new_tool_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
        for c in calls
    ]


def _hermes_call(function: dict[str, Any]) -> str:
    name = json.dumps(function["name"])
    return f'<tool_call>{{"name": {name}, "arguments": {function["arguments"]}}}</tool_call>'


def plan_tools(body, parser: str) -> ToolCallPlan:
    """Check the request's tools and tool_choice (each fault a 400 naming the field)."""
    tools = body.tools or []
    choice = body.tool_choice
    for index, tool in enumerate(tools):
        if not tool.function.name:
            raise bad_request(f"tools[{index}].function.name is missing", f"tools[{index}]")
    dumped = [t.model_dump(exclude_none=True) for t in tools]
    names = [t.function.name for t in tools]
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise bad_request(
                f"tool_choice names {choice.function.name!r}, which is not among the tools "
                f"given ({names})",
                "tool_choice",
            )
        return ToolCallPlan("named", dumped, parser, choice.function.name, body.parallel_tool_calls)
    if choice in ("required", "auto") and not tools:
        raise bad_request(f"tool_choice {choice!r} needs tools", "tool_choice")
    mode = "none" if not tools or choice == "none" else (choice or "auto")
    return ToolCallPlan(mode, dumped, parser, None, body.parallel_tool_calls)


def template_source(tokenizer, template: str | None) -> str:
    """The chat template a request renders with: ``--chat-template``, else the model's."""
    source = template or getattr(tokenizer, "chat_template", None) or ""
    return source if isinstance(source, str) else json.dumps(source)


def template_supports_tools(tokenizer, template: str | None) -> bool:
    return "tools" in template_source(tokenizer, template)


def resolve_tool_parser(name: str, tokenizer, template: str | None) -> str:
    """``--tool-call-parser``'s value; ``auto``: the format the chat template writes calls in
    (hermes, the format of the default tool prompt, for a template without tools)."""
    if name != "auto":
        return name
    if not template_supports_tools(tokenizer, template):
        return detect_tool_parser(None)
    return detect_tool_parser(template_source(tokenizer, template))


def conversation_with_tools(
    conversation: list[dict[str, Any]], plan: ToolCallPlan, native: bool
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The conversation and the template's extra arguments, tools rendered.

    ``native``: the template takes ``tools`` itself; else the default rendering above."""
    if native:
        return conversation, ({"tools": plan.tools} if plan.active else {})
    rendered = []
    for message in conversation:
        if message["role"] == "tool":
            body = f"<tool_response>\n{message['content']}\n</tool_response>"
            rendered.append({"role": "user", "content": body})
        elif message.get("tool_calls"):
            calls = "\n".join(_hermes_call(c["function"]) for c in message["tool_calls"])
            text = (message.get("content") or "").strip()
            rendered.append({"role": "assistant", "content": f"{text}\n{calls}".strip()})
        else:
            rendered.append({k: v for k, v in message.items() if k != "tool_calls"})
    if plan.active:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in plan.tools)
        system = DEFAULT_TOOL_SYSTEM_PROMPT.format(tools=listing)
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {"role": "system", "content": rendered[0]["content"] + "\n\n" + system}
        else:
            rendered.insert(0, {"role": "system", "content": system})
    return rendered, {}
