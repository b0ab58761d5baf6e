"""The bodies of OpenAI's Responses API (POST /v1/responses), as pydantic models.

Only what pagedserve serves: text in (a string, or a list of messages whose content is text),
text out (one assistant message with one ``output_text`` part), and the sampling knobs
``max_output_tokens``, ``temperature``, ``top_p``. Nothing is stored (``store`` is answered
false, as vLLM does without its store), so ``previous_response_id`` cannot be followed.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StrictInt, StrictStr

from pagedserve.server.protocol import OpenAIBaseModel


class InputTextPart(OpenAIBaseModel):
    type: Literal["input_text"]
    text: StrictStr


class OutputTextPart(OpenAIBaseModel):
    """Text of an earlier assistant turn, sent back as conversation history."""

    type: Literal["output_text"]
    text: StrictStr


class InputMessage(OpenAIBaseModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: StrictStr | list[InputTextPart | OutputTextPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class TextFormat(OpenAIBaseModel):
    type: Literal["text"]


class TextConfig(OpenAIBaseModel):
    format: TextFormat | None = None


class ResponsesRequest(OpenAIBaseModel):
    model: str | None = None
    input: StrictStr | Annotated[list[InputMessage], Field(min_length=1)]
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None
    metadata: dict[str, str] | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none"] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    user: str | None = None


class OutputText(OpenAIBaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] = Field(default_factory=list)


class OutputMessage(OpenAIBaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class InputTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)


class IncompleteDetails(OpenAIBaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(OpenAIBaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    model: str
    output: list[OutputMessage]
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, str] | None = None
    store: bool = False
    parallel_tool_calls: bool = False
    tool_choice: str = "none"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
