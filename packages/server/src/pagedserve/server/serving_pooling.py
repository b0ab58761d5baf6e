"""The pooling routes: POST /v1/embeddings, /pooling, /classify, /score (and /v1/score),
/rerank (and /v1/rerank, /v2/rerank).

Each prompt of a request is one engine request (``EngineClient.encode``: a pooling request,
prefill only), all submitted at once so the engine batches them with everyone else's; the
response waits for all of them and counts their prompt tokens as usage. Only a pooling model
(``--runner pooling``) serves these routes, and only a generative one the generation routes:
the other kind is a 400 naming the model (``require_runner``).

Prompts are strings or token ids (or lists of either). A text is tokenized as the model's own
tokenizer does it (special tokens added unless ``add_special_tokens`` is false), and cut by
``truncate_prompt_tokens`` with the tokenizer's truncation, which keeps [CLS] and [SEP] as
sentence-transformers does; token ids are cut to their last k (``truncation_side`` "right":
the first k). Scores pair texts 1:1, 1:N or N:N (engine/scoring.py): a cross-encoder reads each
pair as one prompt, an embedding model scores a pair by the cosine of its two embeddings.
"""

from __future__ import annotations

import asyncio
import base64

import torch
from starlette.requests import Request
from starlette.responses import JSONResponse

from pagedserve.engine import InvalidRequestError, PoolingParams, PoolingRequestOutput
from pagedserve.engine.scoring import cosine, pair_prompt, score_pairs, text_prompt
from pagedserve.server.errors import APIError, bad_request, from_engine_error
from pagedserve.server.field_coverage import refuse_unsupported
from pagedserve.server.protocol import UsageInfo
from pagedserve.server.protocol_pooling import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingBaseRequest,
    PoolingData,
    PoolingRequest,
    PoolingResponse,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from pagedserve.server.state import ServerState, new_id, now_s
from pagedserve.server.streams import aborted_error

POOLING_ROUTES = "/v1/embeddings, /pooling, /classify, /score and /rerank"

# one engine request: (token ids, token types or None, its text or None)
Prompt = tuple[list[int], list[int] | None, str | None]


def require_runner(state: ServerState, runner: str, path: str) -> None:
    """A 400 when ``path`` is not a route of this kind of model (a chat route on an
    embedding model, an embedding route on a generative one)."""
    config = state.engine.model_config
    if config.runner_type == runner:
        return
    if runner == "pooling":
        message = (
            f"the model {state.model_name!r} generates text: {path} needs a pooling model "
            "(serve an embedding or reranking model, or start this one with --runner pooling "
            "--convert embed)"
        )
    else:
        message = (
            f"the model {state.model_name!r} is a pooling model ({config.pooling_task}): it "
            f"generates no text, so it does not serve {path}; it serves {POOLING_ROUTES}"
        )
    raise APIError(message, 400, param="model", code="wrong_model_kind")


# ---- routes ------------------------------------------------------------------------------------


async def create_embedding(request: Request, state: ServerState, body: EmbeddingRequest):
    prompts = _prompts(state, body, body.input, body.add_special_tokens)
    params = _params(body, "embed", dimensions=body.dimensions)
    outputs = await encode_all(state, body, prompts, params)
    data = [
        EmbeddingData(index=i, embedding=encode_vector(o.outputs.data, body))
        for i, o in enumerate(outputs)
    ]
    response = EmbeddingResponse(
        id=_id("embd", body), created=now_s(), model=_served(state, body), data=data,
        usage=_usage(outputs),
    )  # fmt: skip
    return JSONResponse(response.model_dump())


async def create_pooling(request: Request, state: ServerState, body: PoolingRequest):
    prompts = _prompts(state, body, body.input, body.add_special_tokens)
    params = _params(body, body.task, dimensions=body.dimensions)
    outputs = await encode_all(state, body, prompts, params)
    data = [
        PoolingData(index=i, data=encode_vector(o.outputs.data, body))
        for i, o in enumerate(outputs)
    ]
    response = PoolingResponse(
        id=_id("pool", body), created=now_s(), model=_served(state, body), data=data,
        usage=_usage(outputs),
    )  # fmt: skip
    return JSONResponse(response.model_dump())


async def create_classify(request: Request, state: ServerState, body: ClassificationRequest):
    prompts = _prompts(state, body, body.input, body.add_special_tokens)
    outputs = await encode_all(state, body, prompts, _params(body, "classify"))
    labels = state.engine.model_config.hf_config.get("id2label") or {}
    data = []
    for i, output in enumerate(outputs):
        probs = output.outputs.data
        best = str(int(probs.argmax()))
        data.append(
            ClassificationData(
                index=i,
                label=labels.get(best, best),
                probs=probs.tolist(),
                num_classes=len(probs),
            )  # fmt: skip
        )
    response = ClassificationResponse(
        id=_id("classify", body), created=now_s(), model=_served(state, body), data=data,
        usage=_usage(outputs),
    )  # fmt: skip
    return JSONResponse(response.model_dump())


async def create_score(request: Request, state: ServerState, body: ScoreRequest):
    names, first, second = body.pair()
    scores, usage = await score(state, body, score_pairs_of(state, first, second, names))
    data = [ScoreData(index=i, score=s) for i, s in enumerate(scores)]
    response = ScoreResponse(
        id=_id("score", body), created=now_s(), model=_served(state, body), data=data,
        usage=UsageInfo(prompt_tokens=usage, total_tokens=usage),
    )  # fmt: skip
    return JSONResponse(response.model_dump())


async def create_rerank(request: Request, state: ServerState, body: RerankRequest):
    """The documents by the model's relevance to the query, best first; ``top_n`` of them
    (0: all), with their text unless ``return_documents`` is false."""
    if not body.documents:
        raise bad_request("documents must not be empty", "documents")
    limit = state.config.max_pooling_inputs
    if len(body.documents) > limit:
        raise bad_request(f"at most {limit} documents, got {len(body.documents)}", "documents")
    pairs = [(body.query, document) for document in body.documents]
    scores, usage = await score(state, body, pairs)
    order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
    order = order[: body.top_n] if body.top_n else order
    results = [
        RerankResult(
            index=i,
            document=RerankDocument(text=body.documents[i]) if body.return_documents else None,
            relevance_score=scores[i],
        )
        for i in order
    ]
    usage_info = RerankUsage(prompt_tokens=usage, total_tokens=usage)
    response = RerankResponse(
        id=_id("rerank", body), model=_served(state, body), usage=usage_info, results=results
    )
    return JSONResponse(response.model_dump())


# ---- the engine requests -----------------------------------------------------------------------


async def encode_all(
    state: ServerState, body: PoolingBaseRequest, prompts: list[Prompt], params: PoolingParams
) -> list[PoolingRequestOutput]:
    """Every prompt's output, in order; the first refusal as an APIError (the others are
    cancelled, which aborts them)."""
    request_id = new_id("pool")

    async def one(index: int, prompt: Prompt) -> PoolingRequestOutput:
        ids, types, text = prompt
        engine_id = f"{request_id}-{index}"
        state.in_flight[engine_id] = None  # at once, so a drain never misses a request
        final = None
        try:
            async for output in state.engine.encode(
                ids, params, engine_id, text, body.priority, token_type_ids=types
            ):
                final = output
        finally:
            state.in_flight.pop(engine_id, None)
        return final

    tasks = [asyncio.create_task(one(i, p)) for i, p in enumerate(prompts)]
    try:
        outputs = await asyncio.gather(*tasks)
    except Exception as error:
        for task in tasks:
            task.cancel()
        raise from_engine_error(error, state.config.retry_after_s) from error
    if any(output is None or output.aborted for output in outputs):
        raise aborted_error(state)
    return outputs


async def score(
    state: ServerState, body: PoolingBaseRequest, pairs: list[tuple[str, str]]
) -> tuple[list[float], int]:
    """Each pair's score and the prompt tokens spent: a cross-encoder's relevance (its one
    class through the sigmoid, unless ``use_activation`` is false), or the cosine of the two
    texts' embeddings."""
    config = state.engine.model_config
    tokenizer, max_len = state.engine.tokenizer, state.engine.scheduler_config.max_model_len
    k = body.truncate_prompt_tokens
    if config.pooling_task == "embed":
        texts = list(dict.fromkeys(text for pair in pairs for text in pair))
        prompts = [(text_prompt(tokenizer, t, k, max_len), None, t) for t in texts]
        outputs = await encode_all(state, body, prompts, _params(body, "embed"))
        vectors = {t: o.outputs.data for t, o in zip(texts, outputs, strict=True)}
        return [cosine(vectors[a], vectors[b]) for a, b in pairs], _num_tokens(outputs)
    if int(config.hf_config.get("num_labels") or 1) != 1:
        raise bad_request(
            f"the model {state.model_name!r} is a classifier of several classes: it gives no "
            "single relevance score (use /classify)",
            "model",
        )
    prompts = [(*pair_prompt(tokenizer, a, b, k, max_len), None) for a, b in pairs]
    outputs = await encode_all(state, body, prompts, _params(body, "score"))
    return [o.outputs.score for o in outputs], _num_tokens(outputs)


# ---- helpers -----------------------------------------------------------------------------------


def score_pairs_of(state: ServerState, first, second, names) -> list[tuple[str, str]]:
    try:
        pairs = score_pairs(first, second, names)
    except InvalidRequestError as e:
        raise bad_request(str(e), e.param) from e
    limit = state.config.max_pooling_inputs
    if len(pairs) > limit:
        raise bad_request(f"at most {limit} pairs, got {len(pairs)}", names[1])
    return pairs


def _prompts(state: ServerState, body, prompt_input, add_special_tokens: bool) -> list[Prompt]:
    """The request's checks, then each prompt as token ids (see the module docstring)."""
    state.check_admitting()
    refuse_unsupported(body)
    if body.padding == "max_length":
        raise bad_request("padding to max_length is not supported: prompts run unpadded", "padding")
    items = prompt_input
    if isinstance(items, str) or (items and isinstance(items[0], int)):
        items = [items]
    if not items or any(not item for item in items):
        raise bad_request("the input is empty: give at least one token", "input")
    limit = state.config.max_pooling_inputs
    if len(items) > limit:
        raise bad_request(f"at most {limit} inputs per request, got {len(items)}", "input")
    tokenizer, max_len = state.engine.tokenizer, state.engine.scheduler_config.max_model_len
    k, side = body.truncate_prompt_tokens, body.truncation_side
    prompts = []
    for item in items:
        if isinstance(item, str) and side is None:
            prompts.append(
                (text_prompt(tokenizer, item, k, max_len, add_special_tokens), None, item)
            )
            continue
        ids = (
            tokenizer.encode(item, add_special_tokens=add_special_tokens)
            if isinstance(item, str)
            else list(item)
        )
        if k is not None:
            k_ = max_len if k == -1 else k
            ids = ids[:k_] if side == "right" else ids[-k_:]
        prompts.append((ids, None, item if isinstance(item, str) else None))
    return prompts


def _params(body: PoolingBaseRequest, task: str | None, dimensions: int | None = None):
    try:  # truncation was done above, as the text's tokenizer does it
        return PoolingParams(task=task, dimensions=dimensions, use_activation=body.use_activation)
    except InvalidRequestError as e:
        raise bad_request(str(e), e.param) from e


def encode_vector(data: torch.Tensor, body: EmbeddingRequest) -> list[float] | str:
    """A vector as JSON floats, or as base64 of its float32 bytes: little-endian (what
    OpenAI's clients decode, and "native" on the machines this runs on) unless ``endianness``
    says big."""
    if body.encoding_format == "base64":
        dtype = ">f4" if body.endianness == "big" else "<f4"
        return base64.b64encode(data.numpy().astype(dtype).tobytes()).decode("ascii")
    return data.tolist()


def _num_tokens(outputs: list[PoolingRequestOutput]) -> int:
    return sum(len(o.prompt_token_ids) for o in outputs)


def _usage(outputs: list[PoolingRequestOutput]) -> UsageInfo:
    tokens = _num_tokens(outputs)
    return UsageInfo(prompt_tokens=tokens, total_tokens=tokens)


def _id(prefix: str, body: PoolingBaseRequest) -> str:
    return f"{prefix}-{body.request_id}" if body.request_id else new_id(prefix)


def _served(state: ServerState, body: PoolingBaseRequest) -> str:
    return state.served_name(body.model)


ROUTE_BODIES = {  # path -> (body, handler): app.py registers each as a pooling route
    "/v1/embeddings": (EmbeddingRequest, create_embedding),
    "/pooling": (PoolingRequest, create_pooling),
    "/classify": (ClassificationRequest, create_classify),
    "/score": (ScoreRequest, create_score),
    "/v1/score": (ScoreRequest, create_score),
    "/rerank": (RerankRequest, create_rerank),
    "/v1/rerank": (RerankRequest, create_rerank),
    "/v2/rerank": (RerankRequest, create_rerank),
}
