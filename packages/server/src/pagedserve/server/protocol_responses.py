"""The bodies of OpenAI's Responses API (POST /v1/responses), as pydantic models.

Only what pagedserve serves: text and images in (a string, or a list of messages whose content
is text and ``input_image`` parts, of ``function_call`` / ``function_call_output`` items that
carry a tool round trip, and of ``reasoning`` items that give an earlier turn's thinking back),
out a ``reasoning`` item (with a reasoning parser), one assistant message with one
``output_text`` part and/or ``function_call`` items; the sampling knobs ``max_output_tokens``,
``temperature``, ``top_p``, ``reasoning.effort``, and function ``tools`` (flat: ``{"type":
"function", "name", "parameters"}``; what they mean is tools.py's). ``tools`` stays a list of
objects here so that another tool type is a 400 naming it (serving_responses). ``store`` (true
unless sent false, when the server has a store) keeps the response for ``previous_response_id``
and ``GET``/``DELETE /v1/responses/{id}``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, StrictInt, StrictStr, Tag

from pagedserve.server.protocol import OpenAIBaseModel


class InputTextPart(OpenAIBaseModel):
    type: Literal["input_text"]
    text: StrictStr


class OutputTextPart(OpenAIBaseModel):
    """Text of an earlier assistant turn, sent back as conversation history."""

    type: Literal["output_text"]
    text: StrictStr


class InputImagePart(OpenAIBaseModel):
    """An image, in OpenAI's Responses shape (``image_url`` a URL string, not chat's object):
    read as chat's ``image_url`` part (media.py). ``file_id`` is refused: images are not read
    from stored files."""

    type: Literal["input_image"]
    image_url: StrictStr | None = None
    file_id: StrictStr | None = None
    detail: StrictStr | None = None


class InputMessage(OpenAIBaseModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: StrictStr | list[InputTextPart | OutputTextPart | InputImagePart]

    def text(self) -> str:
        """The text parts joined, without separator (images left out)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if not isinstance(part, InputImagePart))


class FunctionCallInput(OpenAIBaseModel):
    """A call the model made earlier (an assistant turn's tool call), sent back as history."""

    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr
    id: str | None = None
    status: str | None = None


class FunctionCallOutputInput(OpenAIBaseModel):
    """What the client's tool returned for ``call_id`` (a ``tool`` message in chat)."""

    type: Literal["function_call_output"]
    call_id: StrictStr
    output: StrictStr | list[InputTextPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


class ReasoningTextPart(OpenAIBaseModel):
    type: Literal["reasoning_text"]
    text: StrictStr


class ReasoningInput(OpenAIBaseModel):
    """An earlier turn's thinking, given back as history (it goes to the assistant turn that
    follows it, for a chat template that shows earlier thinking)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[ReasoningTextPart] | None = None
    encrypted_content: str | None = None
    status: str | None = None

    def text(self) -> str:
        """The thinking: its text, else the summary OpenAI's own reasoning items carry."""
        if self.content:
            return "".join(part.text for part in self.content)
        return "\n\n".join(str(part.get("text", "")) for part in self.summary)


def _input_kind(item: Any) -> str:
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)
    return kind if kind in ("function_call", "function_call_output", "reasoning") else "message"


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[FunctionCallInput, Tag("function_call")]
    | Annotated[FunctionCallOutputInput, Tag("function_call_output")]
    | Annotated[ReasoningInput, Tag("reasoning")],
    Discriminator(_input_kind),
]


class FunctionToolChoice(OpenAIBaseModel):
    type: Literal["function"]
    name: StrictStr


class TextFormat(OpenAIBaseModel):
    type: Literal["text"]


class TextConfig(OpenAIBaseModel):
    format: TextFormat | None = None


class ReasoningConfig(OpenAIBaseModel):
    """``effort`` as chat's ``reasoning_effort`` (the template's; "none" turns thinking off)."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(OpenAIBaseModel):
    model: str | None = None
    input: StrictStr | Annotated[list[InputItem], Field(min_length=1)]
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None
    metadata: dict[str, str] | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    user: str | None = None
    reasoning: ReasoningConfig | None = None
    # refused (field_coverage.py)
    background: bool | None = None
    include: list[StrictStr] | None = None


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


class OutputReasoning(OpenAIBaseModel):
    """The reply's thinking (with ``--reasoning-parser``): its text in one part."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[ReasoningTextPart]
    status: Literal["in_progress", "completed", "incomplete"]


class OutputFunctionCall(OpenAIBaseModel):
    """A call the model makes: the client runs it and sends back a ``function_call_output``."""

    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


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


class ResponseDeleted(OpenAIBaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


class IncompleteDetails(OpenAIBaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(OpenAIBaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    model: str
    output: list[
        Annotated[OutputMessage | OutputFunctionCall | OutputReasoning, Field(discriminator="type")]
    ]
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, str] | None = None
    previous_response_id: str | None = None
    store: bool = False
    parallel_tool_calls: bool = True
    tool_choice: str | FunctionToolChoice = "none"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
