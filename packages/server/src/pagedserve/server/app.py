"""The Starlette application: routes, the gate middleware, metrics, lifespan.

``build_app(engine, config)`` takes an ``AsyncLLM`` (any ``EngineClient``) and returns an
ASGI app; it runs under uvicorn (``pagedserve serve``) or in-process (httpx.ASGITransport,
Starlette's TestClient). Routes:

    POST /v1/completions        POST /v1/chat/completions     POST /v1/responses
    POST /v1/chat/completions/batch (vLLM's)                   POST /invocations (SageMaker's)
    GET|DELETE /v1/responses/{id}  POST /v1/messages  POST /v1/messages/count_tokens (Anthropic)
    POST /v1/embeddings  POST /pooling  POST /classify  POST /score /v1/score
    POST /rerank /v1/rerank /v2/rerank  (a pooling model's: serving_pooling.py)
    GET /v1/models[/{id}]        POST /v1/load_lora_adapter     POST /v1/unload_lora_adapter
    POST /tokenize              POST /detokenize              GET /tokenizer_info
    POST|GET /v1/files, GET|DELETE /v1/files/{id}, GET /v1/files/{id}/content  (OpenAI's Files)
    POST|GET /v1/batches, GET /v1/batches/{id}, POST /v1/batches/{id}/cancel  (OpenAI's Batch)
    GET /health  GET|POST /ping  GET /load  GET /metrics  GET /version
    GET /openapi.json  GET /docs  GET /  /static/...

With ``--otlp-traces-endpoint``, the tracing middleware and tracer (tracing.py, which imports
OpenTelemetry) join the app; without it, nothing of OpenTelemetry is imported.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from importlib import metadata
from pathlib import Path

from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from pagedserve.engine import EngineClient, EngineDeadError
from pagedserve.server.config import ServerConfig
from pagedserve.server.errors import EXCEPTION_HANDLERS, APIError
from pagedserve.server.metrics import EngineMetrics
from pagedserve.server.middleware import (
    GateMiddleware,
    InternalErrorMiddleware,
    LoadTrackingMiddleware,
    RequestIdMiddleware,
    ServerLoad,
)
from pagedserve.server.openapi import openapi_document
from pagedserve.server.protocol import (
    BatchChatCompletionRequest,
    ChatCompletionRequest,
    CompletionRequest,
    LoadResponse,
    VersionResponse,
)
from pagedserve.server.protocol_messages import CountTokensRequest, MessagesRequest
from pagedserve.server.protocol_responses import ResponsesRequest
from pagedserve.server.request_bodies import read_body, read_json, state_of, validated
from pagedserve.server.serving_batches import ROUTES as BATCH_ROUTES
from pagedserve.server.serving_batches import BatchService
from pagedserve.server.serving_chat import create_chat_completion
from pagedserve.server.serving_chat_batch import create_batch_chat_completion
from pagedserve.server.serving_completion import create_completion
from pagedserve.server.serving_messages import count_tokens, create_message
from pagedserve.server.serving_models import (
    list_models,
    load_lora_adapter,
    load_startup_adapters,
    retrieve_model,
    unload_lora_adapter,
)
from pagedserve.server.serving_pooling import ROUTE_BODIES, require_runner
from pagedserve.server.serving_responses import (
    create_response,
    delete_response,
    retrieve_response,
)
from pagedserve.server.serving_tokenization import detokenize, tokenize, tokenizer_info
from pagedserve.server.state import ServedModels, ServerState, now_s

logger = logging.getLogger("pagedserve.server")
METRICS_REFRESH_S = 10.0
# the routes that generate: what --enable-server-load-tracking counts (vLLM's load-aware routes)
GENERATION_PATHS = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/chat/completions/batch",
        "/v1/responses",
        "/v1/messages",
        "/invocations",
    }
)


# ---- routes ------------------------------------------------------------------------------------


def body_route(
    model: type[BaseModel], create, runner: str = "generate"
) -> Callable[[Request], Awaitable[Response]]:
    """The route that reads its body as ``model`` and answers it with
    ``create(request, state, body)``, on the served model the body names, when that model is
    of the ``runner`` kind (a generative model, or a pooling one); the other kind is a 400."""

    async def route(request: Request) -> Response:
        body = await read_body(request, model)
        state = state_of(request, body.model)
        require_runner(state, runner, request.url.path)
        return await create(request, state, body)

    route.__name__ = create.__name__
    route.runner = runner  # what served_post_paths reads: the kind of model the route needs
    return route


async def invocations(request: Request) -> Response:
    """SageMaker's one route (as vLLM serves it): a chat body (with ``messages``) or a
    completion body (with ``prompt``), answered as its own route answers it."""
    data = await read_json(request)
    if "messages" in data:
        kind, create = ChatCompletionRequest, create_chat_completion
    elif "prompt" in data:
        kind, create = CompletionRequest, create_completion
    else:
        raise APIError(
            "Cannot find suitable handler for request. Expected one of: "
            "['ChatCompletionRequest', 'CompletionRequest'] (a body with 'messages' or 'prompt')",
            400,
        )
    body = validated(data, kind)
    state = state_of(request, body.model)
    require_runner(state, "generate", request.url.path)
    return await create(request, state, body)


async def server_load(request: Request) -> Response:
    """vLLM's GET /load: the generation requests being served (0 unless
    --enable-server-load-tracking counts them)."""
    return JSONResponse(LoadResponse(server_load=request.app.state.server_load.count).model_dump())


async def get_response(request: Request) -> Response:
    return await retrieve_response(request, state_of(request))


async def remove_response(request: Request) -> Response:
    return await delete_response(request, state_of(request))


async def health(request: Request) -> Response:
    """200 while the engine runs; 503 once it is dead, or while the server drains."""
    state = state_of(request)
    try:
        await state.engine.check_health()
    except EngineDeadError as e:
        return JSONResponse({"status": "dead", "error": str(e)}, status_code=503)
    if state.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    body = await asyncio.to_thread(request.app.state.metrics.render)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


def server_version() -> str:
    try:
        return metadata.version("pagedserve")
    except metadata.PackageNotFoundError:  # pragma: no cover - always installed in the venv
        return "unknown"


async def version(request: Request) -> Response:
    return JSONResponse(VersionResponse(version=server_version()).model_dump())


STATIC_DIR = Path(__file__).parent / "static"


def check_docs_served(request: Request) -> None:
    """/openapi.json and /docs are routes unless --disable-fastapi-docs takes them away."""
    if request.app.state.config.disable_fastapi_docs:
        raise APIError(f"no route GET {request.url.path} (--disable-fastapi-docs)", 404)


async def openapi_json(request: Request) -> Response:
    check_docs_served(request)
    app_state = request.app.state
    if not hasattr(app_state, "openapi"):  # built once, on first use
        config = app_state.config
        open_ = open_paths(config)
        app_state.openapi = openapi_document(server_version(), config.api_key is not None, open_)
    return JSONResponse(app_state.openapi)


async def playground(request: Request) -> Response:
    """The playground: a chat page with live figures, served from the package's static files."""
    return FileResponse(STATIC_DIR / "playground.html", media_type="text/html")


async def docs(request: Request) -> Response:
    """The API's documentation page; its script renders /openapi.json (no CDN: static files)."""
    check_docs_served(request)
    return FileResponse(STATIC_DIR / "docs.html", media_type="text/html")


ROUTES = [
    Route("/v1/completions", body_route(CompletionRequest, create_completion), methods=["POST"]),
    Route(
        "/v1/chat/completions",
        body_route(ChatCompletionRequest, create_chat_completion),
        methods=["POST"],
    ),
    Route(
        "/v1/chat/completions/batch",
        body_route(BatchChatCompletionRequest, create_batch_chat_completion),
        methods=["POST"],
    ),
    Route("/v1/responses", body_route(ResponsesRequest, create_response), methods=["POST"]),
    Route("/v1/responses/{response_id}", get_response, methods=["GET"]),
    Route("/v1/responses/{response_id}", remove_response, methods=["DELETE"]),
    # Anthropic's Messages API (its errors in Anthropic's shape: errors.py)
    Route("/v1/messages", body_route(MessagesRequest, create_message), methods=["POST"]),
    Route(
        "/v1/messages/count_tokens", body_route(CountTokensRequest, count_tokens), methods=["POST"]
    ),
    Route("/invocations", invocations, methods=["POST"]),
    *(
        Route(path, body_route(body, create, "pooling"), methods=["POST"])
        for path, (body, create) in ROUTE_BODIES.items()
    ),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"]),
    Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
    Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
    Route("/tokenizer_info", tokenizer_info, methods=["GET"]),
    *BATCH_ROUTES,
    Route("/health", health, methods=["GET"]),
    Route("/ping", health, methods=["GET", "POST"]),  # SageMaker's health check
    Route("/load", server_load, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
    Route("/version", version, methods=["GET"]),
    Route("/openapi.json", openapi_json, methods=["GET"]),
    Route("/docs", docs, methods=["GET"]),
    Route("/", playground, methods=["GET"]),
    Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"),
]


# ---- the app -----------------------------------------------------------------------------------


def build_app(
    engine: EngineClient, config: ServerConfig | None = None, model_name: str | None = None
) -> Starlette:
    """The ASGI app serving ``engine`` (an AsyncLLM, or anything that is an EngineClient)
    under ``model_name``.

    The engine is shut down with the app's lifespan (uvicorn); in-process users that skip the
    lifespan shut it down themselves.
    """
    config = config or ServerConfig()
    name = model_name or config.served_model_name or str(engine.model_config.model)
    state = ServerState(engine=engine, config=config, model_name=name, created=now_s())
    tracing = []
    if config.otlp_traces_endpoint:
        from pagedserve.server.tracing import RequestTracer, TraceContextMiddleware

        state.tracer = RequestTracer(config.otlp_traces_endpoint)
        tracing.append(Middleware(TraceContextMiddleware))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        await load_startup_adapters(state)  # a bad --lora-modules adapter stops the start
        await app.state.batches.start()  # a restart resumes the batches it was running
        refresher = asyncio.create_task(_refresh_metrics(app.state.metrics))
        try:
            yield
        finally:
            refresher.cancel()
            await app.state.batches.stop()
            await engine.shutdown()
            if state.tracer is not None:
                state.tracer.shutdown()

    app = assemble_app(ServedModels([state]), config, lifespan, inner_middleware=tracing)
    app.state.server = state
    app.state.batches = BatchService(app, state)
    metrics = EngineMetrics(
        engine, name, in_flight=lambda: len(state.in_flight), prefix=config.metrics_prefix + ":"
    )
    state.observe_request_params = metrics.observe_request_params
    app.state.metrics = metrics
    return app


def assemble_app(
    models: ServedModels,
    config: ServerConfig,
    lifespan,
    routes: list | None = None,
    inner_middleware: list[Middleware] | None = None,
) -> Starlette:
    """The Starlette app over ``models`` with the server's middleware (CORS, the gate, internal
    errors, request ids, then ``inner_middleware``) and error shapes: ``build_app`` gives it one
    engine, the cluster's ingress a set of remote ones and its own /health and /metrics
    (``routes`` first: the first match wins). The caller sets ``app.state.metrics`` (anything
    with ``render() -> bytes``) and, to serve the Batch API, ``app.state.batches``."""
    load = ServerLoad()
    app = Starlette(
        routes=[*(routes or []), *ROUTES],
        middleware=[
            # outermost: a browser's preflight (OPTIONS, no key) is answered before the gate
            Middleware(
                CORSMiddleware,
                allow_origins=list(config.allowed_origins),
                allow_methods=list(config.allowed_methods),
                allow_headers=list(config.allowed_headers),
                allow_credentials=config.allow_credentials,
            ),
            Middleware(
                GateMiddleware,
                api_key=config.api_key,
                max_body_bytes=config.max_body_bytes,
                max_header_bytes=config.max_header_bytes,
                upload_limits={"/v1/files": config.max_file_bytes},
                open_paths=open_paths(config),
                open_prefixes=("/static/",),
            ),
            Middleware(
                LoadTrackingMiddleware,
                load=load,
                paths=GENERATION_PATHS,
                enabled=config.enable_server_load_tracking,
            ),
            Middleware(InternalErrorMiddleware),
            Middleware(RequestIdMiddleware, enabled=config.enable_request_id_headers),
            *(inner_middleware or []),
        ],
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=lifespan,
    )
    app.state.models = models
    app.state.config = config
    app.state.server_load = load
    return app


def open_paths(config: ServerConfig) -> frozenset[str]:
    """Routes served without the API key: /health (and SageMaker's /ping), the API's schema
    and docs and the playground page (their static files too; the page's own calls carry the
    key), and /metrics unless configured otherwise."""
    paths = {"/", "/health", "/ping", "/openapi.json", "/docs"}
    if not config.metrics_require_api_key:
        paths.add("/metrics")
    return frozenset(paths)


async def _refresh_metrics(engine_metrics: EngineMetrics) -> None:
    """Drain finished-request latencies into the histograms even when nobody scrapes."""
    while True:
        await asyncio.sleep(METRICS_REFRESH_S)
        try:
            engine_metrics.refresh()
        except Exception:  # a metrics hiccup must never take the server down
            logger.exception("refreshing metrics failed")
