"""Request bodies of the OpenAI-compatible API, as pydantic models with OpenAI's field names.

The models check types and shapes (a prompt is a string, a list of strings, token ids or lists of
token ids; a message has a role, and text and image content: protocol_content.py). The server's caps (``n``, stop strings) are
checked by request_params.py; sampling ranges by ``SamplingParams``; what depends on the model
(token ids inside the vocabulary, the prompt within ``max_model_len``) by the engine.

Every field vLLM documents on these requests is declared here, and each is either read by its
route or refused with a 400 naming it (field_coverage.py keeps the account, and a test holds it
to the models). Fields neither OpenAI's nor vLLM's are accepted and ignored, as OpenAI's own
clients send fields that an engine may not know (``service_tier``, ``metadata``...).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from pagedserve.server.protocol_content import ChatMessage
from pagedserve.server.protocol_vllm import VLLMSamplingFields
from pagedserve.server.structured_protocol import (
    DeltaToolCall,
    StructuredOutputFields,
    ToolCall,
    ToolFields,
)

TokenIds = list[Annotated[StrictInt, Field(ge=0)]]


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


def _absent(value) -> bool:
    """A field's ``exclude_if``: left out of the body when it has no value."""
    return value is None


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage so far in every chunk


class SamplingRequest(StructuredOutputFields, VLLMSamplingFields):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's plus vLLM's extras;
    the structured-output ones in structured_protocol.py)."""

    model: str | None = None
    n: StrictInt = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: StrictInt = 0
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: StrictInt = 0
    user: str | None = None
    truncate_prompt_tokens: Annotated[StrictInt, Field(ge=1)] | None = None


class CompletionRequest(SamplingRequest):
    """POST /v1/completions. ``max_tokens=None`` means: as many as fit in ``max_model_len``."""

    prompt: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    max_tokens: StrictInt | None = None
    echo: bool = False
    logprobs: StrictInt | None = None
    suffix: str | None = None
    best_of: StrictInt | None = None
    add_special_tokens: bool = True
    prompt_embeds: Any = None


class ChatCompletionRequest(ToolFields, SamplingRequest):
    """POST /v1/chat/completions. ``max_completion_tokens`` is OpenAI's newer name for
    ``max_tokens``; either may be given (not both with different values)."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: bool = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = (
        None
    )
    include_reasoning: bool = True
    echo: bool = False  # vLLM: the reply starts with the last message, when it is the assistant's
    # refused (field_coverage.py)
    add_special_tokens: bool = False
    chat_template: StrictStr | None = None
    media_io_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    return_prompt_text: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[StrictStr] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    store: bool | None = None


class BatchChatCompletionRequest(ChatCompletionRequest):
    """POST /v1/chat/completions/batch (vLLM's): ``messages`` is a list of conversations, every
    other field applies to each."""

    messages: Annotated[
        list[Annotated[list[ChatMessage], Field(min_length=1)]], Field(min_length=1)
    ]


class TokenizeCompletionRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: StrictStr
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(OpenAIBaseModel):
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: TokenIds


# ---- responses -----------------------------------------------------------------------------


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


class CompletionTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0  # of completion_tokens, those spent thinking (--reasoning-parser)


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    completion_tokens_details: CompletionTokensDetails | None = Field(
        default=None, exclude_if=_absent
    )


class CompletionLogprobs(OpenAIBaseModel):
    """Legacy completions logprobs: parallel lists, one entry per token of ``text``."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(OpenAIBaseModel):
    """vLLM's Logprob: one candidate at one prompt position (``rank`` 1 is the likeliest;
    None where the token is outside the top candidates returned)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: None for the first prompt token, then {token id: PromptLogprob}
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids
    token_ids: list[int] | None = None


class CompletionResponse(OpenAIBaseModel):
    """The body of a non-streamed completion."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    # vLLM's: the engine's KV connector's answer (a prefill's transfer handle), else left out
    kv_transfer_params: dict | None = Field(default=None, exclude_if=_absent)


# vLLM's extensions in a streamed chunk: left out when they have no value (on every chunk but
# the one that carries them), as vLLM sends them; a client that extends a list from a present
# key must never find null there.
StreamedTokenIds = Annotated[list[int] | None, Field(default=None, exclude_if=_absent)]
StreamedPromptLogprobs = Annotated[PromptLogprobs | None, Field(default=None, exclude_if=_absent)]


class CompletionStreamChoice(CompletionChoice):
    prompt_logprobs: StreamedPromptLogprobs
    prompt_token_ids: StreamedTokenIds
    token_ids: StreamedTokenIds


class CompletionChunk(CompletionResponse):
    """One SSE chunk of a streamed completion: partial choices, or the usage alone."""

    choices: list[CompletionStreamChoice]


class TopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(OpenAIBaseModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(OpenAIBaseModel):
    """The reply; with a reasoning parser, its thinking in ``reasoning_content`` and in vLLM's
    newer ``reasoning`` (both, for clients of either; left out when there is none)."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = Field(default=None, exclude_if=_absent)
    reasoning: str | None = Field(default=None, exclude_if=_absent)
    # left out of the body when there is none, as OpenAI does
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=lambda calls: not calls)


class ChatCompletionChoice(OpenAIBaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids
    kv_transfer_params: dict | None = Field(default=None, exclude_if=_absent)  # as completions'


class DeltaMessage(OpenAIBaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = Field(default=None, exclude_if=_absent)
    reasoning: str | None = Field(default=None, exclude_if=_absent)
    tool_calls: list[DeltaToolCall] | None = Field(default=None, exclude_if=lambda calls: not calls)


class ChatCompletionStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: StreamedTokenIds  # return_token_ids


class ChatCompletionChunk(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    prompt_logprobs: StreamedPromptLogprobs  # on the first chunk
    prompt_token_ids: StreamedTokenIds  # return_token_ids, on the first chunk


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagedserve"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None
    # the model's generation_config sampling defaults a request inherits (vLLM's names)
    default_sampling_params: dict[str, Any] = {}


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(OpenAIBaseModel):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = None  # return_token_strs


class TokenizerInfoResponse(OpenAIBaseModel):
    """GET /tokenizer_info: the tokenizer's class and its JSON-safe configuration, as vLLM."""

    model_config = ConfigDict(extra="allow")
    tokenizer_class: str


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


class LoadResponse(OpenAIBaseModel):
    server_load: int  # generation requests being served (vLLM's GET /load)


class VersionResponse(OpenAIBaseModel):
    version: str


class HealthResponse(OpenAIBaseModel):
    status: Literal["ok", "draining", "dead"]
    error: str | None = None
