"""The bodies of Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens), as
pydantic models with Anthropic's field names.

What pagedserve serves: a ``system`` prompt (text or text blocks), messages whose content is text
or blocks (``text``, ``tool_use``, ``tool_result``, ``thinking``), custom ``tools`` with an
``input_schema``, ``tool_choice``, ``stop_sequences``, ``thinking`` (mapped onto the chat
template's ``enable_thinking`` and the reasoning parser), ``output_config`` (``format``: a JSON
schema for the answer; ``effort``: the template's ``reasoning_effort``), and the sampling knobs
``temperature``, ``top_p``, ``top_k`` (which Anthropic documents and newer SDKs send through
``extra_body``). Images, documents, server tools, containers and MCP servers are refused with a
400 naming the field; ``cache_control`` is accepted as the hint it is (the prefix cache keeps
every prompt's blocks anyway, and reports them as ``cache_read_input_tokens``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictInt, StrictStr, Tag


class AnthropicModel(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class TextBlock(AnthropicModel):
    type: Literal["text"]
    text: StrictStr
    cache_control: dict[str, Any] | None = None
    citations: list[dict[str, Any]] | None = None


class ToolUseBlock(AnthropicModel):
    type: Literal["tool_use"]
    id: StrictStr
    name: StrictStr
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(AnthropicModel):
    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: StrictStr | list[TextBlock] | None = None
    is_error: bool = False
    cache_control: dict[str, Any] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(block.text for block in self.content)


class ThinkingBlock(AnthropicModel):
    type: Literal["thinking"]
    thinking: StrictStr
    signature: StrictStr | None = None


class UnservedBlock(AnthropicModel):
    """A block pagedserve cannot read (image, document, redacted_thinking, ...): refused."""

    type: StrictStr


def _block_kind(block: Any) -> str:
    kind = block.get("type") if isinstance(block, dict) else getattr(block, "type", None)
    return kind if kind in ("text", "tool_use", "tool_result", "thinking") else "unserved"


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[UnservedBlock, Tag("unserved")],
    Discriminator(_block_kind),
]


class MessageParam(AnthropicModel):
    role: Literal["user", "assistant"]
    content: StrictStr | list[ContentBlock]


class Tool(AnthropicModel):
    """A client tool; a server tool (``type`` other than ``custom``) is refused."""

    name: StrictStr
    description: StrictStr | None = None
    input_schema: dict[str, Any]
    type: StrictStr | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(AnthropicModel):
    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(AnthropicModel):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: StrictInt | None = None
    display: Literal["summarized", "omitted"] | None = None


class JsonOutputFormat(AnthropicModel):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(AnthropicModel):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None


class Metadata(AnthropicModel):
    user_id: StrictStr | None = None


class CountTokensRequest(AnthropicModel):
    model: StrictStr
    messages: Annotated[list[MessageParam], Field(min_length=1)]
    system: StrictStr | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[StrictInt, Field(ge=1)]
    stop_sequences: list[StrictStr] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None
    service_tier: StrictStr | None = None
    cache_control: dict[str, Any] | None = None
    # refused (field_coverage.py)
    container: Any = None
    mcp_servers: list[Any] | None = None
    context_management: dict[str, Any] | None = None
    inference_geo: StrictStr | None = None
    speed: StrictStr | None = None
    diagnostics: dict[str, Any] | None = None


# ---- responses -----------------------------------------------------------------------------


class MessagesUsage(AnthropicModel):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0  # prompt tokens served from the prefix cache
    cache_creation_input_tokens: int = 0


class MessageResponse(AnthropicModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[dict[str, Any]]  # text, thinking and tool_use blocks, in Anthropic's shape
    model: str
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None = None
    usage: MessagesUsage


class CountTokensResponse(AnthropicModel):
    input_tokens: int


class AnthropicErrorInfo(AnthropicModel):
    type: str
    message: str


class AnthropicErrorResponse(AnthropicModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorInfo
