"""Tool-call parsers (``--tool-call-parser``): a model's reply -> content and tool calls, in the
format of each model family, streamed (base.py says how a parser reads a reply in pieces).

``--tool-call-parser auto`` reads the format from the chat template: a template that writes calls
in one family's markers gets that family's parser (``detect_tool_parser``); a template that takes
no tools gets pagedserve's own tool prompt (tools.py), which asks for hermes' format.
"""

from __future__ import annotations

from pagedserve.server.tool_parsers.base import (
    CallDelta,
    CallFrame,
    ParsedCall,
    ParsedDelta,
    ToolCallParser,
)
from pagedserve.server.tool_parsers.deepseek import DeepSeekV3Parser, DeepSeekV31Parser
from pagedserve.server.tool_parsers.forced import NamedCallParser, RequiredCallsParser
from pagedserve.server.tool_parsers.harmony import OpenAIToolParser
from pagedserve.server.tool_parsers.json_families import (
    GraniteParser,
    HermesParser,
    InternLMParser,
    Llama3JsonParser,
    MistralParser,
)
from pagedserve.server.tool_parsers.pythonic import PythonicParser
from pagedserve.server.tool_parsers.xml_families import Glm45Parser, Qwen3CoderParser

TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    parser.name: parser
    for parser in (
        HermesParser,
        Llama3JsonParser,
        MistralParser,
        PythonicParser,
        Qwen3CoderParser,
        DeepSeekV3Parser,
        DeepSeekV31Parser,
        GraniteParser,
        InternLMParser,
        Glm45Parser,
        OpenAIToolParser,
    )
}
TOOL_CALL_PARSERS["llama4_pythonic"] = PythonicParser  # vLLM's name for Llama 4's use of it

# What a chat template writes when it renders an assistant's tool call (every string of an entry
# in its source), most specific first.
TEMPLATE_SIGNATURES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("<|channel|>commentary", "functions."), "openai"),  # gpt-oss's harmony
    (("<｜tool▁call▁begin｜>", "```json"), "deepseek_v3"),
    (("<｜tool▁call▁begin｜>",), "deepseek_v31"),
    (("<function=",), "qwen3_coder"),
    (("<arg_key>",), "glm45"),
    (("[TOOL_CALLS]",), "mistral"),
    (("<|action_start|>",), "internlm"),
    (("<|tool_call|>",), "granite"),
    (("<|start_of_role|>", "<tool_call>"), "granite"),
    (("<|python_start|>",), "pythonic"),
    (("<|python_tag|>",), "llama3_json"),
    (("<tool_call>",), "hermes"),
)
DEFAULT_TOOL_PARSER = "hermes"  # the format of pagedserve's own tool prompt


def detect_tool_parser(template: str | None) -> str:
    """The parser for the calls ``template`` writes (hermes when it writes none it knows)."""
    source = template or ""
    for signature, name in TEMPLATE_SIGNATURES:
        if all(part in source for part in signature):
            return name
    return DEFAULT_TOOL_PARSER


__all__ = [
    "DEFAULT_TOOL_PARSER",
    "TOOL_CALL_PARSERS",
    "CallDelta",
    "CallFrame",
    "NamedCallParser",
    "ParsedCall",
    "ParsedDelta",
    "RequiredCallsParser",
    "ToolCallParser",
    "detect_tool_parser",
]
