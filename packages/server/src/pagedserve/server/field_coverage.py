"""No silent fields: every field a request body declares is read by its route, or refused with
a 400 naming it. This module keeps that account.

``REFUSED`` says why each refused field is refused: a mechanism pagedserve does not have, or
one it will not run on a request's say (per-request logits processors, which vLLM V1 refuses
too). A refused
field is accepted when sent with no effect (its default, ``null``, an empty list), as vLLM does
not fail a client that spells out a default.

``HANDLED`` lists, per request model (nested ones included), the fields its route reads. A test
walks every model reachable from the routes' bodies and fails on a field in neither list, so a
field cannot be added without deciding which it is; another test holds the list of vLLM's own
request fields to the models, so none of them is ignored unseen.

``thinking_token_budget`` (and Anthropic's ``thinking.budget_tokens``) needs
``--reasoning-parser``: the engine forces the end of the thinking after N tokens, at the
parser's tags (reasoning.thinking_budget).
"""

from __future__ import annotations

import inspect
import typing

from pydantic import BaseModel

from pagedserve.server import protocol as p
from pagedserve.server import protocol_batches as b
from pagedserve.server import protocol_messages as m
from pagedserve.server import protocol_pooling as pool
from pagedserve.server import protocol_responses as r
from pagedserve.server.errors import bad_request

# The bodies the routes read (each walked with the models nested in it).
REQUEST_MODELS: tuple[type[BaseModel], ...] = (
    p.CompletionRequest,
    p.ChatCompletionRequest,
    p.BatchChatCompletionRequest,
    r.ResponsesRequest,
    p.TokenizeCompletionRequest,
    p.TokenizeChatRequest,
    p.DetokenizeRequest,
    m.MessagesRequest,
    m.CountTokensRequest,
    b.CreateBatchRequest,
    b.FileUpload,
    pool.EmbeddingRequest,
    pool.PoolingRequest,
    pool.ClassificationRequest,
    pool.ScoreRequest,
    pool.RerankRequest,
)

_ENGINE = "needs engine support that pagedserve does not have yet"

REFUSED: dict[str, str] = {
    "logits_processors": "per-request logits processors (code named by a request) are not run; "
    "vLLM V1 refuses them too",
    "logprob_token_ids": f"logprobs of chosen token ids {_ENGINE}",
    "extra_args": "no sampler plugin reads extra arguments in pagedserve",
    "vllm_xargs": "no sampler plugin reads extra arguments in pagedserve",
    "repetition_detection": f"n-gram repetition detection {_ENGINE}",
    "watermarking": f"watermarking {_ENGINE}",
    "stream_interval": f"batching stream chunks by token count {_ENGINE}",
    "cache_salt": f"salting the prefix cache {_ENGINE}",
    "ec_transfer_params": "pagedserve has no encoder-cache transfer connector",
    "routed_experts_prompt_start": "pagedserve does not return routed-expert data",
    "return_token_offsets": "token offsets are served by vLLM's render endpoints only",
    "return_mm_kwargs": "the processed image inputs are not returned",
    "guided_decoding_backend": "the grammar backend is the server's choice (xgrammar)",
    "guided_whitespace_pattern": "give the whitespace in the schema or regex itself",
    "prompt_embeds": "prompt embeddings as input are not supported",
    "chat_template": "a request may not bring its own chat template (use --chat-template)",
    "media_io_kwargs": "images are read with the server's own limits (media.py)",
    "mm_processor_kwargs": "the model folder's image processor runs as it is configured",
    "return_prompt_text": "the rendered prompt is available from POST /tokenize",
    "functions": "the deprecated functions field is not served: send tools",
    "function_call": "the deprecated function_call field is not served: send tool_choice",
    "audio": "pagedserve takes text and images, not audio",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "pagedserve has no web search",
    "background": "background responses are not supported: stream, or wait for the answer",
    "include": "no extra output (encrypted reasoning, logprobs, sources) is served",
    "container": "pagedserve runs no code-execution containers",
    "mcp_servers": "pagedserve connects to no MCP servers: give the tools as client tools",
    "context_management": "pagedserve does not edit the context: send the messages to keep",
    "inference_geo": "pagedserve serves from where it runs",
    "speed": "pagedserve has one speed",
    "diagnostics": "no diagnostics are returned",
    "embed_dtype": "embeddings are served as float32",
}
# Refused in chat (and its batch route) only where their meaning differs from the completions
# route's.
CHAT_REFUSED: dict[str, str] = {
    "add_special_tokens": "the chat template writes the special tokens; add them there",
    "modalities": "pagedserve answers in text only",
    "store": "chat completions are not stored: use /v1/responses with store",
}
NO_EFFECT = (None, [], "")

_CHAT_HANDLED = frozenset(
    """model messages n temperature top_p top_k min_p presence_penalty frequency_penalty
    repetition_penalty seed stop stop_token_ids include_stop_str_in_output ignore_eos
    min_tokens logit_bias skip_special_tokens spaces_between_special_tokens stream
    stream_options priority user truncate_prompt_tokens truncation_side max_tokens
    max_completion_tokens logprobs top_logprobs prompt_logprobs use_beam_search
    length_penalty early_stopping return_token_ids return_tokens_as_token_ids request_id
    session_id thinking_token_budget response_format structured_outputs guided_json
    guided_regex guided_choice guided_grammar tools tool_choice parallel_tool_calls
    bad_words allowed_token_ids
    add_generation_prompt continue_final_message chat_template_kwargs documents
    reasoning_effort include_reasoning echo kv_transfer_params""".split()
)
# what every pooling route reads (serving_pooling.py); padding: do_not_pad is what it does,
# max_length is refused there by name
_POOLING_HANDLED = frozenset(
    """model user truncate_prompt_tokens truncation_side request_id priority use_activation
    padding""".split()
)
_EMBED_HANDLED = _POOLING_HANDLED | {
    "input", "encoding_format", "dimensions", "add_special_tokens", "endianness"
}  # fmt: skip
HANDLED: dict[str, frozenset[str]] = {
    "EmbeddingRequest": _EMBED_HANDLED,
    "PoolingRequest": _EMBED_HANDLED | {"task"},
    "ClassificationRequest": _POOLING_HANDLED | {"input", "add_special_tokens"},
    "ScoreRequest": _POOLING_HANDLED
    | {"text_1", "text_2", "queries", "documents", "data_1", "data_2"},
    "RerankRequest": _POOLING_HANDLED | {"query", "documents", "top_n", "return_documents"},
    "CompletionRequest": frozenset(
        """model prompt n temperature top_p top_k min_p presence_penalty frequency_penalty
        repetition_penalty seed stop stop_token_ids include_stop_str_in_output ignore_eos
        min_tokens logit_bias skip_special_tokens spaces_between_special_tokens stream
        stream_options priority user truncate_prompt_tokens truncation_side max_tokens echo
        logprobs suffix best_of add_special_tokens prompt_logprobs use_beam_search
        length_penalty early_stopping return_token_ids return_tokens_as_token_ids request_id
        session_id thinking_token_budget response_format structured_outputs guided_json
        guided_regex guided_choice guided_grammar bad_words allowed_token_ids
        kv_transfer_params""".split()
    ),
    "ChatCompletionRequest": _CHAT_HANDLED,
    # each conversation is planned as a chat request; the batch refuses stream, tools, beam
    # search, prompt_logprobs and n above 1 by name (serving_chat_batch.py)
    "BatchChatCompletionRequest": _CHAT_HANDLED,
    "StreamOptions": frozenset({"include_usage", "continuous_usage_stats"}),
    "ResponseFormat": frozenset({"type", "json_schema"}),
    "JsonSchemaFormat": frozenset({"name", "description", "json_schema", "strict"}),
    "StructuredOutputsRequest": frozenset(
        {"json_", "regex", "choice", "grammar", "json_object", "structural_tag"}
        | {"disable_any_whitespace"}
    ),
    "ChatCompletionTool": frozenset({"type", "function"}),
    "FunctionDefinition": frozenset({"name", "description", "parameters", "strict"}),
    "NamedToolChoice": frozenset({"type", "function"}),
    "NamedFunction": frozenset({"name"}),
    "ChatMessage": frozenset(
        {"role", "content", "name", "tool_call_id", "tool_calls", "reasoning_content"}
        | {"reasoning"}
    ),
    "TextContentPart": frozenset({"type", "text"}),
    # the image is read by media.py; detail other than auto is refused by name (check_detail)
    "ImageURLContentPart": frozenset({"type", "image_url", "uuid"}),  # uuid refused (media.py)
    "ImageURL": frozenset({"url", "detail"}),
    "ToolCall": frozenset({"id", "type", "function"}),
    "FunctionCall": frozenset({"name", "arguments"}),
    "TokenizeChatRequest": frozenset(
        {"model", "messages", "add_generation_prompt", "continue_final_message"}
        | {"chat_template_kwargs", "return_token_strs"}
    ),
    "TokenizeCompletionRequest": frozenset(
        {"model", "prompt", "add_special_tokens", "return_token_strs"}
    ),
    "DetokenizeRequest": frozenset({"model", "tokens"}),
    "ResponsesRequest": frozenset(
        """model input instructions max_output_tokens temperature top_p stream store metadata
        previous_response_id tools tool_choice parallel_tool_calls text user reasoning""".split()
    ),
    "InputMessage": frozenset({"type", "role", "content"}),
    "InputTextPart": frozenset({"type", "text"}),
    "InputImagePart": frozenset({"type", "image_url", "detail", "file_id"}),  # file_id refused
    "OutputTextPart": frozenset({"type", "text"}),
    # an input item's id and status only name the item the client got earlier
    "FunctionCallInput": frozenset({"type", "call_id", "name", "arguments", "id", "status"}),
    "FunctionCallOutputInput": frozenset({"type", "call_id", "output", "id", "status"}),
    "ReasoningInput": frozenset(
        {"type", "id", "summary", "content", "encrypted_content", "status"}
    ),
    "ReasoningTextPart": frozenset({"type", "text"}),
    "FunctionToolChoice": frozenset({"type", "name"}),
    "TextConfig": frozenset({"format"}),
    "TextFormat": frozenset({"type"}),
    # effort as chat's reasoning_effort; summary: the whole thinking is always returned instead
    "ReasoningConfig": frozenset({"effort", "summary"}),
    "CountTokensRequest": frozenset(
        {"model", "messages", "system", "tools", "tool_choice", "thinking"}
    ),
    # metadata.user_id and service_tier only describe the caller; cache_control is a hint the
    # prefix cache makes true anyway (cache_read_input_tokens reports its hits)
    "MessagesRequest": frozenset(
        """model messages system tools tool_choice thinking max_tokens stop_sequences stream
        temperature top_p top_k metadata output_config service_tier cache_control""".split()
    ),
    "MessageParam": frozenset({"role", "content"}),
    "TextBlock": frozenset({"type", "text", "cache_control", "citations"}),
    "ToolUseBlock": frozenset({"type", "id", "name", "input", "cache_control"}),
    "ToolResultBlock": frozenset({"type", "tool_use_id", "content", "is_error", "cache_control"}),
    "ThinkingBlock": frozenset({"type", "thinking", "signature"}),
    "UnservedBlock": frozenset({"type"}),  # any such block is refused, naming it
    "Tool": frozenset({"name", "description", "input_schema", "type", "cache_control"}),
    "ToolChoice": frozenset({"type", "name", "disable_parallel_tool_use"}),
    "ThinkingConfig": frozenset({"type", "budget_tokens", "display"}),
    "OutputConfig": frozenset({"effort", "format"}),
    "JsonOutputFormat": frozenset({"type", "json_schema"}),
    "Metadata": frozenset({"user_id"}),
    # OpenAI's Batch API: the body refuses unknown fields (extra="forbid"), and POST /v1/files
    # refuses a form part other than these two by name (serving_batches.py)
    "CreateBatchRequest": frozenset({"input_file_id", "endpoint", "completion_window", "metadata"}),
    "FileUpload": frozenset({"file", "purpose"}),
}


def refused_fields(model: type[BaseModel]) -> dict[str, str]:
    """The fields ``model`` declares only to refuse them, with why."""
    chat = issubclass(model, p.ChatCompletionRequest)
    reasons = {**REFUSED, **(CHAT_REFUSED if chat else {})}
    return {name: why for name, why in reasons.items() if name in model.model_fields}


def reachable_models(roots) -> list[type[BaseModel]]:
    """``roots`` and every model a field of theirs can hold, however deeply."""
    found: list[type[BaseModel]] = []

    def visit(annotation) -> None:
        if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
            if annotation not in found:
                found.append(annotation)
                for field in annotation.model_fields.values():
                    visit(field.annotation)
            return
        for argument in typing.get_args(annotation):
            visit(argument)

    for root in roots:
        visit(root)
    return found


def uncovered_fields(model: type[BaseModel]) -> list[str]:
    """The fields of ``model`` that are neither handled nor refused."""
    covered = HANDLED.get(model.__name__, frozenset()) | set(refused_fields(model))
    return [name for name in model.model_fields if name not in covered]


def refuse_unsupported(body: BaseModel) -> None:
    """A 400 naming the first refused field the request sent with an effect."""
    fields = type(body).model_fields
    for name, why in refused_fields(type(body)).items():
        if name not in body.model_fields_set:
            continue
        value = getattr(body, name)
        if value in NO_EFFECT or value == fields[name].default:
            continue
        raise bad_request(f"{name} is not supported: {why}", name)
