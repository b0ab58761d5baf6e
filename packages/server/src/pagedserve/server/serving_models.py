"""The served models, with vLLM's routes: list them, and load and unload LoRA adapters while
requests run.

    GET /v1/models                GET /v1/models/{id}
    POST /v1/load_lora_adapter    {"lora_name": "sql", "lora_path": "/adapters/sql"}
    POST /v1/unload_lora_adapter  {"lora_name": "sql"}

A loaded adapter is served under its name (``"model": "sql"``) and listed by /v1/models with
the base model as its ``parent``. Loading reads and checks the adapter before it is listed (a
bad one is a 400 and changes nothing); unloading unlists it at once (new requests naming it get
a 404) while the requests already running with it finish with it.
"""

from __future__ import annotations

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from pagedserve.server.errors import APIError, from_engine_error, from_validation_error
from pagedserve.server.protocol import ModelCard, ModelList
from pagedserve.server.request_bodies import read_json, state_of
from pagedserve.server.request_params import check_model
from pagedserve.server.state import ServerState


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str


def model_card(state: ServerState, lora_name: str | None = None) -> ModelCard:
    """The base model's card, or a LoRA adapter's (its root the adapter's folder, its parent
    the base model, as vLLM lists them)."""
    engine = state.engine
    lora = state.lora_modules.get(lora_name) if lora_name else None
    return ModelCard(
        id=lora.lora_name if lora else state.model_name,
        created=state.created,
        root=lora.lora_path if lora else str(engine.model_config.model),
        parent=state.model_name if lora else None,
        max_model_len=engine.scheduler_config.max_model_len,
        default_sampling_params=dict(engine.model_config.generation_defaults.sampling),
    )


async def list_models(request: Request) -> Response:
    """Every served model (behind one endpoint, several) and each one's loaded adapters."""
    cards = [
        model_card(state, name)
        for state in request.app.state.models.states()
        for name in (None, *state.lora_modules)
    ]
    return JSONResponse(ModelList(data=cards).model_dump())


async def retrieve_model(request: Request) -> Response:
    state = state_of(request, request.path_params["model_id"])
    check_model(state, request.path_params["model_id"])
    return JSONResponse(model_card(state, request.path_params["model_id"]).model_dump())


def _parse(model: type[BaseModel], data: dict) -> BaseModel:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from e


def _check_enabled(state: ServerState) -> None:
    if not state.engine.lora_enabled:
        raise APIError("LoRA is not enabled on this server (start it with --enable-lora)", 400)


async def load_lora_adapter(request: Request) -> PlainTextResponse:
    state = state_of(request)
    body = _parse(LoadLoRAAdapterRequest, await read_json(request))
    _check_enabled(state)
    name = body.lora_name.strip()
    if not name or name == state.model_name or name in state.lora_modules:
        raise APIError(
            f"the name {name!r} is already served (or empty); unload it first", 400,
            param="lora_name", code="lora_name_taken",
        )  # fmt: skip
    lora = state.new_lora_request(name, body.lora_path)
    try:
        await state.engine.add_lora(lora)
    except ValueError as error:
        raise from_engine_error(error, state.config.retry_after_s) from error
    state.lora_modules[name] = lora
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: Request) -> PlainTextResponse:
    state = state_of(request)
    body = _parse(UnloadLoRAAdapterRequest, await read_json(request))
    _check_enabled(state)
    lora = state.lora_modules.pop(body.lora_name, None)
    if lora is None:
        raise APIError(
            f"no LoRA adapter named {body.lora_name!r} is loaded", 404,
            param="lora_name", code="lora_not_found",
        )  # fmt: skip
    await state.engine.remove_lora(lora.lora_int_id)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


async def load_startup_adapters(state: ServerState) -> None:
    """The ``--lora-modules`` adapters, read and checked before the server answers."""
    for module in state.config.lora_modules:
        name, _, path = module.partition("=")
        _check_enabled(state)
        if name in state.lora_modules or name == state.model_name:
            raise ValueError(f"--lora-modules: the name {name!r} is given twice")
        lora = state.new_lora_request(name, path)
        await state.engine.add_lora(lora)
        state.lora_modules[name] = lora
