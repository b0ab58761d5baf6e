"""GET /openapi.json: the API's OpenAPI 3.1 document, built from the protocol's pydantic models.

Each route is described once, in ``OPERATIONS`` (its request and response models, and whether it
streams); the models' JSON schemas (pydantic's, draft 2020-12, which OpenAPI 3.1 adopts) become
``components.schemas``, requests in pydantic's validation mode and responses in serialization
mode. A test holds ``OPERATIONS`` equal to the app's routes, so no route goes undocumented.

The document says what this server enforces, no more: the bearer scheme is declared only when it
runs with an API key, and then every route but the open ones (``open_paths``, the gate's) needs
it. A schema-driven client or fuzzer takes a declared scheme as a promise; one declared on a
server without a key would be "authentication declared but not enforced".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from pagedserve.server import protocol as p
from pagedserve.server import protocol_batches as b
from pagedserve.server import protocol_messages as m
from pagedserve.server import protocol_pooling as pool
from pagedserve.server import protocol_responses as r
from pagedserve.server import serving_models as lora

REF = "#/components/schemas/{model}"


@dataclass(frozen=True)
class Operation:
    method: str
    path: str
    summary: str
    request: tuple[type[BaseModel], ...] = ()  # one of these bodies
    response: type[BaseModel] | None = None
    media_type: str = "application/json"
    streams: bool = False  # also answers text/event-stream with "stream": true
    request_media_type: str = "application/json"


OPERATIONS = [
    Operation(
        "post",
        "/v1/completions",
        "Complete a prompt (text, token ids, or a list of them)",
        (p.CompletionRequest,),
        p.CompletionResponse,
        streams=True,
    ),
    Operation(
        "post",
        "/v1/chat/completions",
        "Answer a conversation through the model's chat template",
        (p.ChatCompletionRequest,),
        p.ChatCompletionResponse,
        streams=True,
    ),
    Operation(
        "post",
        "/v1/chat/completions/batch",
        "vLLM's batched chat: a list of conversations, one choice answering each",
        (p.BatchChatCompletionRequest,),
        p.ChatCompletionResponse,
    ),
    Operation(
        "post",
        "/v1/responses",
        "OpenAI's Responses API: text, messages and tool results in; a message and tool calls out",
        (r.ResponsesRequest,),
        r.ResponseObject,
        streams=True,
    ),
    Operation(
        "get",
        "/v1/responses/{response_id}",
        "A stored response (404 when none has the id)",
        response=r.ResponseObject,
    ),
    Operation(
        "delete",
        "/v1/responses/{response_id}",
        "Delete a stored response",
        response=r.ResponseDeleted,
    ),
    Operation(
        "post",
        "/v1/messages",
        "Anthropic's Messages API: system, messages and tools in; text, thinking and tool_use "
        "blocks out (errors in Anthropic's shape)",
        (m.MessagesRequest,),
        m.MessageResponse,
        streams=True,
    ),
    Operation(
        "post",
        "/v1/messages/count_tokens",
        "The tokens of a Messages request's prompt",
        (m.CountTokensRequest,),
        m.CountTokensResponse,
    ),
    Operation(
        "post",
        "/invocations",
        "SageMaker's route: a chat body (messages) or a completion body (prompt), answered as "
        "its own route answers it",
        (p.ChatCompletionRequest, p.CompletionRequest),
        streams=True,
    ),
    Operation(
        "post",
        "/v1/files",
        "Upload a JSONL file of batch requests (OpenAI's Files API, purpose batch)",
        (b.FileUpload,),
        b.FileObject,
        request_media_type="multipart/form-data",
    ),
    Operation("get", "/v1/files", "The stored files, newest first", response=b.FileList),
    Operation("get", "/v1/files/{file_id}", "One file", response=b.FileObject),
    Operation("delete", "/v1/files/{file_id}", "Delete a file", response=b.FileDeleted),
    Operation(
        "get",
        "/v1/files/{file_id}/content",
        "A file's bytes (a batch's input, output or error JSONL)",
        media_type="application/octet-stream",
    ),
    Operation(
        "post",
        "/v1/batches",
        "Run a file of requests in the background, on the capacity interactive requests leave",
        (b.CreateBatchRequest,),
        b.BatchObject,
    ),
    Operation("get", "/v1/batches", "The batches, newest first", response=b.BatchList),
    Operation(
        "get", "/v1/batches/{batch_id}", "One batch and its progress", response=b.BatchObject
    ),
    Operation(
        "post",
        "/v1/batches/{batch_id}/cancel",
        "Cancel a batch: the answers so far are kept",
        response=b.BatchObject,
    ),
    Operation(
        "post",
        "/v1/embeddings",
        "Embeddings of texts or token ids (a pooling model; float or base64)",
        (pool.EmbeddingRequest,),
        pool.EmbeddingResponse,
    ),
    Operation(
        "post",
        "/pooling",
        "vLLM's: a pooling model's output for each input (an embedding, class probabilities)",
        (pool.PoolingRequest,),
        pool.PoolingResponse,
    ),
    Operation(
        "post",
        "/classify",
        "Class probabilities and label of each input (a classifier)",
        (pool.ClassificationRequest,),
        pool.ClassificationResponse,
    ),
    *(
        Operation(
            "post",
            path,
            "Scores of text pairs, 1:1, 1:N or N:N (a cross-encoder, or embeddings' cosine)",
            (pool.ScoreRequest,),
            pool.ScoreResponse,
        )
        for path in ("/score", "/v1/score")
    ),
    *(
        Operation(
            "post",
            path,
            "Documents ordered by relevance to a query (Jina's and Cohere's shape)",
            (pool.RerankRequest,),
            pool.RerankResponse,
        )
        for path in ("/rerank", "/v1/rerank", "/v2/rerank")
    ),
    Operation("get", "/v1/models", "The served model", response=p.ModelList),
    Operation("get", "/v1/models/{model_id}", "One model by its id", response=p.ModelCard),
    Operation(
        "post",
        "/v1/load_lora_adapter",
        "Load a LoRA adapter and serve it under its name (with --enable-lora)",
        (lora.LoadLoRAAdapterRequest,),
        media_type="text/plain",
    ),
    Operation(
        "post",
        "/v1/unload_lora_adapter",
        "Unload a LoRA adapter; its running requests finish with it",
        (lora.UnloadLoRAAdapterRequest,),
        media_type="text/plain",
    ),
    Operation(
        "post",
        "/tokenize",
        "Token ids of a prompt or a conversation",
        (p.TokenizeCompletionRequest, p.TokenizeChatRequest),
        p.TokenizeResponse,
    ),
    Operation(
        "post", "/detokenize", "Text of token ids", (p.DetokenizeRequest,), p.DetokenizeResponse
    ),
    Operation(
        "get",
        "/tokenizer_info",
        "The tokenizer's configuration (with --enable-tokenizer-info-endpoint)",
        response=p.TokenizerInfoResponse,
    ),
    Operation(
        "get",
        "/health",
        "200 while serving, 503 when dead or draining",
        response=p.HealthResponse,
    ),
    Operation("get", "/ping", "SageMaker's health check: /health", response=p.HealthResponse),
    Operation("post", "/ping", "SageMaker's health check: /health", response=p.HealthResponse),
    Operation(
        "get",
        "/load",
        "Generation requests being served (with --enable-server-load-tracking)",
        response=p.LoadResponse,
    ),
    Operation("get", "/metrics", "Prometheus metrics", media_type="text/plain"),
    Operation("get", "/version", "The server's version", response=p.VersionResponse),
    Operation("get", "/openapi.json", "This document", media_type="application/json"),
    Operation("get", "/docs", "This document, rendered", media_type="text/html"),
    Operation("get", "/", "The playground: a streaming chat page", media_type="text/html"),
]
# what a route without a pydantic response model answers, by media type
_PLAIN_SCHEMAS = {"application/json": {"type": "object"}}


def _component_schemas() -> tuple[dict, dict]:
    """(refs by (model, mode), components.schemas) for every model the operations name."""
    inputs = [(m, "validation") for op in OPERATIONS for m in op.request]
    outputs = [(op.response, "serialization") for op in OPERATIONS if op.response is not None]
    outputs.append((p.ErrorResponse, "serialization"))
    keys = list(dict.fromkeys(inputs + outputs))
    refs, schemas = models_json_schema(keys, ref_template=REF)
    return refs, schemas.get("$defs", {})


def _operation(op: Operation, refs: dict, secured: bool) -> dict:
    body: dict = {"summary": op.summary, "operationId": _operation_id(op)}
    if op.request:
        members = [refs[(m, "validation")] for m in op.request]
        schema = members[0] if len(members) == 1 else {"oneOf": members}
        body["requestBody"] = {
            "required": True,
            "content": {op.request_media_type: {"schema": schema}},
        }
    content: dict = {}
    if op.response is not None:
        content[op.media_type] = {"schema": refs[(op.response, "serialization")]}
    else:
        content[op.media_type] = {"schema": _PLAIN_SCHEMAS.get(op.media_type, {"type": "string"})}
    if op.streams:
        content["text/event-stream"] = {
            "schema": {"type": "string", "description": "SSE: data: {chunk} ... data: [DONE]"}
        }
    error = {"content": {"application/json": {"schema": refs[(p.ErrorResponse, "serialization")]}}}
    body["responses"] = {
        "200": {"description": "OK", "content": content},
        "4XX": {"description": "A refused request (OpenAI's error shape)", **error},
        "5XX": {"description": "Unavailable (503) or an internal error (500)", **error},
    }
    names = re.findall(r"\{(\w+)\}", op.path)
    if names:
        body["parameters"] = [
            {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
            for name in names
        ]
    if secured:
        body["security"] = [{"bearer": []}]
        body["responses"]["401"] = {"description": "No valid API key", **error}
    return body


def _operation_id(op: Operation) -> str:
    words = [w for w in op.path.replace("{", "").replace("}", "").split("/") if w]
    return op.method + "_" + "_".join(w.replace(".", "_") for w in words)


def openapi_document(
    version: str, api_key: bool = False, open_paths: frozenset[str] = frozenset()
) -> dict:
    """The document of a server that requires an API key (``api_key``) on every route but
    ``open_paths``, or on none."""
    refs, schemas = _component_schemas()
    paths: dict = {}
    for op in OPERATIONS:
        secured = api_key and op.path not in open_paths
        paths.setdefault(op.path, {})[op.method] = _operation(op, refs, secured)
    document = {
        "openapi": "3.1.0",
        "info": {
            "title": "pagedserve",
            "version": version,
            "description": "An OpenAI-compatible server (vLLM's request fields included).",
        },
        "paths": paths,
        "components": {"schemas": schemas},
    }
    if api_key:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return document
