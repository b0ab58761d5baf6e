"""The tokenizer's routes, as vLLM serves them: POST /tokenize, POST /detokenize, GET /tokenizer_info.

/tokenize takes a prompt (``add_special_tokens``) or a conversation, rendered exactly as chat
renders it (chat_prompt.py: ``add_generation_prompt``, ``continue_final_message``,
``chat_template_kwargs``); /detokenize refuses a token id outside the vocabulary in vLLM's words.

/tokenizer_info gives what a client needs to tokenize as the server does. The tokenizer's class, and its configuration (``init_kwargs``: special tokens, padding side,
model_max_length...) where a value is JSON; the chat template when it has one; added tokens as
``{id: {content, special}}``. It can reveal a local path (``name_or_path``) and the template, so
vLLM and pagedserve serve it only with ``--enable-tokenizer-info-endpoint``.
"""

from __future__ import annotations

import json

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedserve.server.chat_prompt import chat_prompt_ids, template_options
from pagedserve.server.errors import APIError
from pagedserve.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
)
from pagedserve.server.request_bodies import read_body, read_json, state_of, validated
from pagedserve.server.request_params import check_model


async def tokenize(request: Request) -> Response:
    data = await read_json(request)
    body = validated(data, TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest)
    state = state_of(request, body.model)
    check_model(state, body.model)
    tokenizer = state.engine.tokenizer
    if isinstance(body, TokenizeChatRequest):
        add_generation_prompt, template_kwargs = template_options(body)
        tokens = await chat_prompt_ids(state, body.messages, add_generation_prompt, template_kwargs)
    else:
        tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    max_len = state.engine.scheduler_config.max_model_len
    strs = tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
    response = TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=max_len)
    response.token_strs = strs
    return JSONResponse(response.model_dump())


async def detokenize(request: Request) -> Response:
    body = await read_body(request, DetokenizeRequest)
    state = state_of(request, body.model)
    check_model(state, body.model)
    vocab = state.engine.model_config.vocab_size
    bad = next((t for t in body.tokens if t >= vocab), None)
    if bad is not None:
        message = f"Token id {bad} is out of vocabulary: token ids must be in [0, {vocab})"
        raise APIError(message, 400, param="tokens")
    return JSONResponse(
        DetokenizeResponse(prompt=state.engine.tokenizer.decode(body.tokens)).model_dump()
    )


async def tokenizer_info(request: Request) -> Response:
    """vLLM's /tokenizer_info (behind --enable-tokenizer-info-endpoint, as there)."""
    state = state_of(request)
    if not state.config.enable_tokenizer_info_endpoint:
        raise APIError("no route GET /tokenizer_info (see --enable-tokenizer-info-endpoint)", 404)
    return JSONResponse(tokenizer_info_of(state.engine.tokenizer).model_dump())


def _json_safe(value) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def tokenizer_info_of(tokenizer) -> TokenizerInfoResponse:
    config = {
        key: value
        for key, value in getattr(tokenizer, "init_kwargs", {}).items()
        if not key.startswith("_") and key != "added_tokens_decoder" and _json_safe(value)
    }
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        config["chat_template"] = template
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    config["added_tokens_decoder"] = {
        str(index): {"content": str(token), "special": bool(getattr(token, "special", False))}
        for index, token in added.items()
    }
    return TokenizerInfoResponse(tokenizer_class=type(tokenizer).__name__, **config)
