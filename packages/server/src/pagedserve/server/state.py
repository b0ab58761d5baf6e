"""What the routes and the launcher share: the engine, the config, in-flight requests, draining;
and the served models (one ServerState each) that the routes pick from by a request's ``model``."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedserve.engine import EngineClient, LoRARequest, SamplingParams
from pagedserve.server.config import ServerConfig
from pagedserve.server.errors import APIError
from pagedserve.server.responses_store import ResponseStore

if TYPE_CHECKING:  # tracing imports OpenTelemetry: only with --otlp-traces-endpoint
    from pagedserve.server.tracing import RequestTracer


@dataclass
class ServerState:
    """Shared by the routes and the launcher: in-flight engine requests, and the drain flag."""

    engine: EngineClient
    config: ServerConfig
    model_name: str
    created: int = 0
    draining: bool = False
    in_flight: dict[str, None] = field(default_factory=dict)  # engine request ids
    lora_modules: dict[str, LoRARequest] = field(default_factory=dict)  # by served name
    # told each request the engine admits (EngineMetrics.observe_request_params), when set
    observe_request_params: Callable[[SamplingParams], None] | None = None
    tracer: RequestTracer | None = None  # with --otlp-traces-endpoint
    _last_lora_id: int = 0
    responses_store: ResponseStore | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.responses_store = ResponseStore.from_config(
            self.config.responses_store, self.config.responses_store_max
        )

    def new_lora_request(self, name: str, path: str) -> LoRARequest:
        """An adapter under ``name`` with an id no other adapter of this server ever had (a
        reused id would let the prefix cache hand one adapter's blocks to another)."""
        self._last_lora_id += 1
        return LoRARequest(name, self._last_lora_id, path)

    def served_name(self, model: str | None) -> str:
        """The ``model`` a response names: the adapter the request asked for, else the base."""
        return model if model in self.lora_modules else self.model_name

    def lora_request_for(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names; None for the base model (or no name)."""
        return None if model is None else self.lora_modules.get(model)

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


class ServedModels:
    """The models an app serves, by name, in order: ``pagedserve serve`` serves one; the cluster's
    ingress (pagedserve.cluster) serves several and adds or drops them while it runs.

    ``state_for(name)`` is how a route finds the engine for a request's ``model``: no name means
    the first model (as vLLM's first served name), a LoRA adapter's name its base model, an
    unknown one is a 404 in OpenAI's shape.
    """

    def __init__(self, states: list[ServerState] | None = None) -> None:
        self._states: dict[str, ServerState] = {s.model_name: s for s in states or []}

    def add(self, state: ServerState) -> None:
        self._states[state.model_name] = state

    def remove(self, name: str) -> ServerState | None:
        return self._states.pop(name, None)

    def states(self) -> list[ServerState]:
        return list(self._states.values())

    def names(self) -> list[str]:
        return list(self._states)

    def state_for(self, name: str | None) -> ServerState:
        if not self._states:
            raise APIError("no model is being served yet", 503, code="model_not_ready")
        if name is None:
            return self.states()[0]
        state = self._states.get(name)
        if state is None:  # a LoRA adapter's name: its base model's state serves it
            state = next((s for s in self._states.values() if name in s.lora_modules), None)
        if state is None:
            raise model_not_found(name, self.names())
        return state


def model_not_found(name: str, served: list[str]) -> APIError:
    names = ", ".join(repr(n) for n in served)
    return APIError(
        f"the model {name!r} does not exist; this server serves {names}",
        404,
        param="model",
        code="model_not_found",
    )
