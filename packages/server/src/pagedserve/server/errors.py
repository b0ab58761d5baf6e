"""Errors in OpenAI's shape, and the one place where exceptions become HTTP statuses.

Every error body is ``{"error": {"message", "type", "param", "code"}}`` so that the official
clients raise their typed exceptions (BadRequestError, AuthenticationError, NotFoundError,
RateLimitError...). ``param`` names the request field at fault when there is one.

Under /v1/messages (Anthropic's Messages API) the same errors take Anthropic's shape instead,
``{"type": "error", "error": {"type", "message"}}``, with Anthropic's type names
(``invalid_request_error``, ``authentication_error``, ``not_found_error``, ``overloaded_error``,
``api_error``...), so that the anthropic client raises its typed exceptions: ``APIError.response``
takes the request's path and picks the shape.

Mapping: invalid parameters (pydantic, and the engine's ``InvalidRequestError``, raised by
SamplingParams and by the engine's checks against the model) -> 400; bad key -> 401; unknown
model or route -> 404; body too large -> 413; headers too large -> 431; queue full
(``SchedulerOverloadedError``) or draining -> 503 with Retry-After; engine dead -> 503; anything
else -> 500 (its details go to the log only).
"""

from __future__ import annotations

import json
import logging
import re
from http import HTTPStatus

from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from pagedserve.engine import EngineDeadError, InvalidRequestError, SchedulerOverloadedError
from pagedserve.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("pagedserve.server")

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error with its HTTP status, OpenAI error type, offending parameter and headers."""

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return _ERROR_TYPES.get(self.status_code, "invalid_request_error")

    def body(self) -> dict:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def anthropic_body(self) -> dict:
        kind = _ANTHROPIC_TYPES.get(self.status_code, "invalid_request_error")
        if self.status_code >= 500 and self.status_code not in _ANTHROPIC_TYPES:
            kind = "api_error"
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response(self, path: str = "") -> JSONResponse:
        """The error as a response, in Anthropic's shape under /v1/messages, else OpenAI's."""
        body = self.anthropic_body() if is_anthropic_path(path) else self.body()
        return JSONResponse(body, status_code=self.status_code, headers=self.headers)


ANTHROPIC_PREFIX = "/v1/messages"
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(message, 400, param=param)


def internal_error() -> APIError:
    """The one 500. It closes the connection: whatever failed may have left the request's body
    half read, and a client that pooled the connection must not send its next request on it."""
    return APIError("internal server error", 500, headers={"Connection": "close"})


def overloaded(message: str, retry_after_s: int) -> APIError:
    return APIError(message, 503, code="overloaded", headers={"Retry-After": str(retry_after_s)})


_UNION_HINTS = {
    "prompt": "must be a string, a list of strings, a list of token ids (integers >= 0) "
    "or a list of such lists",
    "stop": "must be a string or a list of strings",
    "input": "must be a string or a non-empty list of messages, each {'role': user, system, "
    "developer or assistant, 'content': a string or input_text/output_text/input_image parts}, "
    "and of function_call {call_id, name, arguments} and function_call_output {call_id, output} "
    "items",
    "content": "must be a string or a list of {'type': 'text', 'text': ...} and {'type': "
    "'image_url', 'image_url': {'url': ...}} parts (audio, video and file parts are not "
    "supported)",
}


def _is_type_tag(part: str) -> bool:
    return "[" in part or "(" in part or part in {"str", "int", "float", "bool", "dict", "list"}


def from_validation_error(error: ValidationError) -> APIError:
    """The first problem pydantic found, with its location as ``param`` (``messages.0.role``)."""
    first = error.errors(include_url=False)[0]
    raw_loc = [str(part) for part in first.get("loc", ())]
    # Union members show up in the location as type tags ("str", "list[int]"): drop them, and
    # say what the union accepts rather than why its first member failed.
    loc = [part for part in raw_loc if not _is_type_tag(part)]
    param = ".".join(loc) or None
    named = [part for part in loc if not part.isdigit()]
    if len(loc) < len(raw_loc) and named and named[-1] in _UNION_HINTS:
        return bad_request(f"{param} {_UNION_HINTS[named[-1]]}", param)
    where = f"{param}: " if param else ""
    return bad_request(f"{where}{first.get('msg', 'invalid value')}", param)


def from_invalid_request(error: ValueError, aliases: dict[str, str] | None = None) -> APIError:
    """A 400 for a refused request, with ``param`` from ``InvalidRequestError``.

    ``aliases`` renames the engine's field names to the API's (``logprobs`` -> ``top_logprobs``
    in chat), in ``param`` and where the message starts with the field's name.
    """
    message = str(error) or "invalid request"
    param = error.param if isinstance(error, InvalidRequestError) else None
    if param and aliases and param in aliases:
        new = aliases[param]
        if message.startswith(param + " "):
            message = new + message[len(param) :]
        param = new
    return bad_request(message, param)


def from_engine_error(
    error: BaseException, retry_after_s: int, aliases: dict[str, str] | None = None
) -> APIError:
    """Map what ``AsyncLLM.generate`` raises before its first output to an APIError."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, SchedulerOverloadedError):
        return overloaded(f"the server is overloaded: {error}", retry_after_s)
    if isinstance(error, ValueError):
        return from_invalid_request(error, aliases)
    if isinstance(error, EngineDeadError):
        return APIError(f"the engine is not running: {error}", 503, code="engine_dead")
    logger.exception("unexpected engine error", exc_info=error)
    return internal_error()


# A \uD800-\uDFFF escape: the only way a JSON text can hold a lone surrogate.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def parse_json_body(raw: bytes) -> object:
    """The body as JSON, with 400s that say what is wrong (bad UTF-8, bad JSON, a string that
    is not Unicode text)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not valid UTF-8: {e.reason}") from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from e
    except RecursionError as e:
        raise bad_request("the request body is nested too deeply") from e
    if _SURROGATE_ESCAPE.search(text):
        _refuse_lone_surrogates(data)
    return data


def _refuse_lone_surrogates(data: object) -> None:
    """JSON may escape half of a UTF-16 surrogate pair alone (``"\\ud800"``); Python keeps it
    as a character no tokenizer can encode. Refuse it with the field that holds it, walking
    iteratively (json.loads already bounded the depth, but not the walker's stack)."""
    stack: list[tuple[object, str]] = [(data, "")]
    while stack:
        value, where = stack.pop()
        if isinstance(value, dict):
            items = [(k, v) for k, v in value.items()]
            items += [(k, k) for k in value]  # keys are strings too
        elif isinstance(value, list):
            items = list(enumerate(value))
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                param = where or None
                raise bad_request(
                    f"{where or 'the body'} holds a lone UTF-16 surrogate "
                    "(an unpaired \\ud800-\\udfff escape), which is not text",
                    param,
                ) from None
            continue
        else:
            continue
        for key, item in items:
            stack.append((item, f"{where}.{key}" if where else str(key)))


# ---- Starlette exception handlers ------------------------------------------------------------


async def handle_api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response(request.url.path)


async def handle_http_exception(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own 404/405 (unknown route, wrong method) in OpenAI's shape."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}"
    else:
        message = exc.detail or HTTPStatus(exc.status_code).phrase
    error = APIError(message, exc.status_code, headers=dict(exc.headers or {}))
    return error.response(request.url.path)


async def handle_client_disconnect(request: Request, exc: Exception) -> Response:
    """The client left while its body was being read: nobody is there to answer (nginx's 499)."""
    return Response(status_code=499)


EXCEPTION_HANDLERS = {
    APIError: handle_api_error,
    HTTPException: handle_http_exception,
    ClientDisconnect: handle_client_disconnect,
}
