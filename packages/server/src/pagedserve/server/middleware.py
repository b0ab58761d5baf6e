"""The gate every HTTP request passes first: header size, path normalisation, API key, body size.

One pure-ASGI middleware, in this order, so that nothing is read from a caller before it is
known to be allowed:

1. headers larger than ``max_header_bytes`` -> 431;
2. the path is normalised (percent-decoding until stable, backslashes as slashes, empty and dot
   segments resolved, trailing slash dropped) and written back into the scope. Routing and the
   key check therefore see the *same* path: ``//v1/models``, ``/v1/%6Dodels`` or
   ``/health/../v1/models`` cannot reach a protected route unauthenticated, because they are
   either routed as ``/v1/models`` (and checked as such) or not routed at all;
3. with an API key, every path but the open ones (``/health``, ``/metrics`` unless configured
   otherwise, the API's schema and docs) needs ``Authorization: Bearer <key>`` or, as
   Anthropic's clients send it, ``x-api-key: <key>``, compared in constant time
   (``hmac.compare_digest`` on the bytes) -> 401 otherwise;
4. a declared ``Content-Length`` over ``max_body_bytes`` -> 413 at once; a chunked body is
   counted as it is read and fails with 413 when it passes the cap. The paths of
   ``upload_limits`` (POST /v1/files) have caps of their own (``--max-file-bytes``).
"""

from __future__ import annotations

import hmac
import logging
import uuid
from urllib.parse import quote, unquote

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedserve.server.errors import APIError, internal_error

logger = logging.getLogger("pagedserve.server")

UNPROTECTED_PATHS = frozenset({"/health"})
OPEN_PREFIXES = ()  # path prefixes served without the key (static files of open pages)


def normalize_path(path: str) -> str:
    """The canonical form of a URL path (see the module docstring)."""
    for _ in range(8):
        decoded = unquote(path)
        if decoded == path:
            break
        path = decoded
    segments: list[str] = []
    for segment in path.replace("\\", "/").split("/"):
        if segment in ("", "."):
            continue
        if segment == "..":
            if segments:
                segments.pop()
            continue
        segments.append(segment)
    return "/" + "/".join(segments)


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None


def bearer_token(scope: Scope) -> bytes | None:
    value = _header(scope, b"authorization")
    if value is None:
        return None
    scheme, _, token = value.strip().partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else None


class GateMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        max_body_bytes: int,
        max_header_bytes: int,
        open_paths: frozenset[str] = UNPROTECTED_PATHS,
        open_prefixes: tuple[str, ...] = OPEN_PREFIXES,
        upload_limits: dict[str, int] | None = None,
    ) -> None:
        self.app = app
        self.upload_limits = upload_limits or {}
        self.api_key = api_key.encode() if api_key else None
        self.open_paths = open_paths
        self.open_prefixes = open_prefixes
        self.max_body_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            scope = self._check(scope)
        except APIError as error:
            await error.response(normalize_path(scope["path"]))(scope, receive, send)
            return
        await self.app(scope, self._counting_receive(receive, self._limit(scope)), send)

    def _limit(self, scope: Scope) -> int:
        """The body cap of a request (on its normalised path)."""
        return self.upload_limits.get(scope["path"], self.max_body_bytes)

    def _check(self, scope: Scope) -> Scope:
        header_bytes = sum(len(k) + len(v) for k, v in scope.get("headers", ()))
        if header_bytes > self.max_header_bytes:
            raise APIError(
                f"request headers are {header_bytes} bytes; the limit is {self.max_header_bytes}",
                431,
            )
        path = normalize_path(scope["path"])
        scope = dict(scope, path=path, raw_path=quote(path).encode())
        if self.api_key is not None and not self._is_open(path):
            tokens = [bearer_token(scope), _header(scope, b"x-api-key")]
            if not any(t is not None and hmac.compare_digest(t, self.api_key) for t in tokens):
                raise APIError(
                    "a valid API key is required: send 'Authorization: Bearer <key>'",
                    401,
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        length = _header(scope, b"content-length")
        if length is not None:
            if not length.isdigit():
                raise APIError("Content-Length must be a non-negative integer", 400)
            if int(length) > self._limit(scope):
                raise self._too_large(int(length), self._limit(scope))
        return scope

    def _is_open(self, path: str) -> bool:
        return path in self.open_paths or any(path.startswith(p) for p in self.open_prefixes)

    def _too_large(self, size: int, limit: int) -> APIError:
        return APIError(f"the request body is {size} bytes or more; the limit is {limit}", 413)

    def _counting_receive(self, receive: Receive, limit: int) -> Receive:
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise self._too_large(received, limit)
            return message

        return counted


class InternalErrorMiddleware:
    """Turns an unexpected exception into the 500 of ``internal_error`` (with
    ``Connection: close``) and does not re-raise it.

    Starlette's own last-resort handler answers and then re-raises, and uvicorn, seeing the
    exception after the response started, drops the connection without a word: a client's
    next pooled request then fails with a reset. Here the server says it closes the connection,
    and h11 closes it cleanly once the 500 is sent. An exception after the response started
    (mid-stream) can only end the connection, so it is re-raised for uvicorn to do that.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            logger.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise
            await internal_error().response(scope.get("path", ""))(scope, receive, send)


class RequestIdMiddleware:
    """``--enable-request-id-headers``: every response carries ``X-Request-Id``, the one the
    request sent (so a client or proxy can match logs) or a new one, as vLLM's server does."""

    def __init__(self, app: ASGIApp, enabled: bool) -> None:
        self.app = app
        self.enabled = enabled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.enabled:
            await self.app(scope, receive, send)
            return
        request_id = _header(scope, b"x-request-id") or uuid.uuid4().hex.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class ServerLoad:
    """vLLM's server load: the generation requests being served right now (counted while their
    ASGI call runs, so a stream counts until its last chunk is sent)."""

    def __init__(self) -> None:
        self.count = 0


class LoadTrackingMiddleware:
    """``--enable-server-load-tracking``: counts the POSTs to ``paths`` (the generation routes)
    in ``load`` while they are served, for GET /load. Inside the gate: only admitted requests,
    on their normalised paths, count."""

    def __init__(self, app: ASGIApp, load: ServerLoad, paths: frozenset[str], enabled: bool):
        self.app = app
        self.load = load
        self.paths = paths
        self.enabled = enabled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tracked = (
            self.enabled
            and scope["type"] == "http"
            and scope["method"] == "POST"
            and scope["path"] in self.paths
        )
        if not tracked:
            await self.app(scope, receive, send)
            return
        self.load.count += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.count -= 1
