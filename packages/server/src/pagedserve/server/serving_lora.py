"""LoRA adapters over HTTP, with vLLM's routes: load and unload while requests run.

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
from starlette.responses import PlainTextResponse

from pagedserve.server.errors import APIError, from_engine_error, from_validation_error
from pagedserve.server.state import ServerState


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str


def _parse(model: type[BaseModel], data: dict) -> BaseModel:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from e


def _check_enabled(state: ServerState) -> None:
    if not state.engine.lora_enabled:
        raise APIError("LoRA is not enabled on this server (start it with --enable-lora)", 400)


async def load_lora_adapter(state: ServerState, data: dict, request: Request) -> PlainTextResponse:
    body = _parse(LoadLoRAAdapterRequest, data)
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


async def unload_lora_adapter(state: ServerState, data: dict, request: Request):
    body = _parse(UnloadLoRAAdapterRequest, data)
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
