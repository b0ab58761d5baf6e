"""What the routes and the launcher share: the engine, the config, in-flight requests, draining."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from pagedserve.engine import EngineClient
from pagedserve.server.config import ServerConfig
from pagedserve.server.errors import APIError


@dataclass
class ServerState:
    """Shared by the routes and the launcher: in-flight engine requests, and the drain flag."""

    engine: EngineClient
    config: ServerConfig
    model_name: str
    created: int = 0
    draining: bool = False
    in_flight: dict[str, None] = field(default_factory=dict)  # engine request ids

    def check_admitting(self) -> None:
        if self.draining:
            raise APIError(
                "the server is shutting down and admits no new requests",
                503,
                code="shutting_down",
                headers={"Retry-After": str(self.config.retry_after_s)},
            )

    async def abort_all(self) -> None:
        for request_id in list(self.in_flight):
            await self.engine.abort(request_id)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())
