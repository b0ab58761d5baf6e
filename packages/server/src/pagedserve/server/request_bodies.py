"""Reading a request: its JSON body, validated as a protocol model, and the served model's state
it names. Every failure is a 4xx in OpenAI's shape (415 for another content type, 400 for bad
UTF-8, bad JSON, a body that is not an object, or one the model refuses).
"""

from __future__ import annotations

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from pagedserve.server.errors import APIError, from_validation_error, parse_json_body
from pagedserve.server.state import ServerState


def state_of(request: Request, model: str | None = None) -> ServerState:
    """The state of the served model a request names (the first model when it names none)."""
    return request.app.state.models.state_for(model)


async def read_json(request: Request) -> dict:
    """The body as a JSON object (415 for another content type, 400 for bad UTF-8 or JSON)."""
    content_type = request.headers.get("content-type", "application/json")
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise APIError(f"the body must be application/json, got {content_type!r}", 415)
    data = parse_json_body(await request.body())
    if not isinstance(data, dict):
        raise APIError("the request body must be a JSON object", 400)
    return data


def validated(data: dict, model: type[BaseModel]) -> BaseModel:
    """``data`` (a parsed body) as ``model``; pydantic's refusal as a 400 naming the field."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from e


async def read_body(request: Request, model: type[BaseModel]) -> BaseModel:
    """The JSON body validated as ``model``."""
    return validated(await read_json(request), model)
