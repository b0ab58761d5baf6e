"""Tool calling in chat: tools into the prompt, tool calls out of the reply.

- ``tool_choice`` "none" (or no tools): a plain chat; the tools are not shown to the model.
- "auto" (the default with tools): the tools are rendered into the prompt, the model answers
  freely, and ``--tool-call-parser`` (tool_parsers.py) finds calls in its reply.
- "required" and a named function: the reply is held by the grammar engine to the calls'
  JSON: a named call's arguments follow its ``parameters`` schema; "required" writes a JSON
  array of ``{"name", "arguments"}`` (one element when ``parallel_tool_calls`` is false).
- "auto" with a ``strict: true`` tool: the reply stays free text, but once the parser's call
  opening is written the grammar engine holds the call to a given tool's name and, for a strict
  tool, its ``parameters`` schema (xgrammar's triggered tags); with ``parallel_tool_calls``
  false the reply ends after its first call.

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
from pagedserve.server.tool_parsers import CALL_FRAMES, TOOL_CALL_PARSERS

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
        frame = CALL_FRAMES[self.parser]
        tags = [
            {
                "type": "tag",
                "begin": frame.begin.format(name=json.dumps(name)),
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

    def tool_calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The reply as (content, tool calls)."""
        if self.mode == "named":
            return None, [_tool_call(self.named, text)]
        if self.mode == "required":
            try:
                calls = json.loads(text)
            except json.JSONDecodeError:  # cut short by max_tokens
                return text, []
            return None, [_tool_call(c["name"], json.dumps(c["arguments"])) for c in calls]
        if self.mode == "auto":
            content, parsed = TOOL_CALL_PARSERS[self.parser](text)
            return content, [_tool_call(name, arguments) for name, arguments in parsed]
        return text, []


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object", "properties": {}}


def _tool_call(name: str, arguments: str) -> ToolCall:
    return ToolCall(id=new_tool_call_id(), function=FunctionCall(name=name, arguments=arguments))


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


def template_supports_tools(tokenizer, template: str | None) -> bool:
    source = template or getattr(tokenizer, "chat_template", None) or ""
    return "tools" in source


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
