"""The tokenizer's routes: POST /tokenize and /detokenize (vLLM's), GET /tokenizer_info."""

from __future__ import annotations

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedserve.server.errors import APIError, from_validation_error, read_body, read_json
from pagedserve.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from pagedserve.server.request_params import check_model
from pagedserve.server.serving_chat import chat_prompt_ids, template_options
from pagedserve.server.state import state_of
from pagedserve.server.tokenizer_info import tokenizer_info_of


async def tokenize(request: Request) -> Response:
    data = await read_json(request)
    kind = TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest
    try:
        body = kind.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from e
    state = state_of(request, body.model)
    check_model(state, body.model)
    tokenizer = state.engine.tokenizer
    if isinstance(body, TokenizeChatRequest):
        add_generation_prompt, template_kwargs = template_options(body)
        tokens = chat_prompt_ids(state, body.messages, add_generation_prompt, template_kwargs)
    else:
        tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    max_len = state.engine.scheduler_config.max_model_len
    strs = tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
    response = TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=max_len)
    response.token_strs = strs
    return JSONResponse(response.model_dump())


async def tokenizer_info(request: Request) -> Response:
    """vLLM's /tokenizer_info (behind --enable-tokenizer-info-endpoint, as there)."""
    state = state_of(request)
    if not state.config.enable_tokenizer_info_endpoint:
        raise APIError("no route GET /tokenizer_info (see --enable-tokenizer-info-endpoint)", 404)
    return JSONResponse(tokenizer_info_of(state.engine.tokenizer).model_dump())


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
