"""RemoteEngine: a model's set of replicas, as the server's EngineClient.

The server's routes (request models, caps, chat templates, SSE, error shapes) run unchanged in
the ingress over this object: ``generate`` sends the request through the model's Serve handle
(whose router picks the replica) and streams the replica's outputs back.

Faults: a replica that dies before the request's first output (it was still waiting, or had
only been routed) is retried on another replica, up to ``max_retries`` times; one that dies
after output was streamed ends the stream with ``EngineDeadError`` naming the replica (the
server turns it into an error event, or a 503), since the text already sent cannot be unsent.
A request the engine refuses raises the engine's own error (a 400, 503, ...), as in-process.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, fields

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError

from pagedserve.cluster.replica import ModelDescription, ReplicaStart, ReplicaStats
from pagedserve.cluster.routing import ReplicaRequest
from pagedserve.engine import (
    EngineDeadError,
    EngineStats,
    PoolingParams,
    PoolingRequestOutput,
    RequestOutput,
    SamplingParams,
)

logger = logging.getLogger("pagedserve.cluster")
REPLICA_GONE = (ActorDiedError, ActorUnavailableError, RayActorError)
CONTROL_TIMEOUT_S = 10.0


@dataclass
class RouteSettings:
    """How the ingress routes one model's requests (from the config, reconfigured live)."""

    routing: str = "prefix"
    prefix_blocks: int = 1
    busy_threshold: int = 4


class RemoteEngine:
    """An EngineClient over one model's Serve deployment (every replica of it)."""

    def __init__(self, handle, description: ModelDescription, route: RouteSettings, max_retries=3):
        self.handle = handle
        self.tokenizer = description.tokenizer
        self.model_config = description.model_config
        self.scheduler_config = description.scheduler_config
        self.block_size = description.block_size
        self.image_placeholder = description.image_placeholder
        self.max_image_tokens = description.max_image_tokens
        self.args = description.args
        self.route = route
        self.max_retries = max_retries
        self.last_stats: list[ReplicaStats] = []
        self.retries = 0  # requests re-sent after their replica died before any output

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str,
        prompt: str | None = None,
        priority: int = 0,
        multi_modal_data: dict | None = None,
    ) -> AsyncIterator[RequestOutput]:
        request = self._request(prompt_token_ids, sampling_params, request_id, prompt, priority)
        request.multi_modal_data = multi_modal_data
        async for output in self._stream(request):
            yield output

    async def encode(
        self,
        prompt_token_ids: list[int],
        pooling_params: PoolingParams,
        request_id: str,
        prompt: str | None = None,
        priority: int = 0,
        token_type_ids: list[int] | None = None,
    ) -> AsyncIterator[PoolingRequestOutput]:
        """A pooling model's request (an embedding model beside a chat model), routed and
        retried as ``generate``'s."""
        request = self._request(prompt_token_ids, pooling_params, request_id, prompt, priority)
        request.token_type_ids = token_type_ids
        async for output in self._stream(request):
            yield output

    def _request(self, prompt_token_ids, params, request_id, prompt, priority) -> ReplicaRequest:
        return ReplicaRequest(
            list(prompt_token_ids),
            params,
            request_id,
            prompt,
            priority,
            routing=self.route.routing,
            block_size=self.block_size,
            prefix_blocks=self.route.prefix_blocks,
            busy_threshold=self.route.busy_threshold,
        )

    async def _stream(self, request: ReplicaRequest) -> AsyncIterator:
        """The replica's outputs for ``request`` (see the module docstring for its faults)."""
        request_id = request.request_id
        while True:
            stream = self.handle.options(stream=True).generate.remote(request)
            replica, started, finished = None, False, False
            try:
                async for item in stream:
                    if isinstance(item, ReplicaStart):
                        replica = item.replica_id
                        continue
                    started, finished = True, item.finished
                    yield item
                return
            except RayTaskError as error:  # the engine refused it: its own error, as in-process
                raise error.cause from None
            except REPLICA_GONE as error:
                if started or len(request.tried) >= self.max_retries:
                    raise _replica_died(request_id, replica, started) from error
                request.tried.add(replica or "")
                self.retries += 1
                logger.warning("replica %s died before %s started; retrying", replica, request_id)
            finally:
                if not finished:
                    stream.cancel()  # the caller left (or the replica died): nothing to wait for

    async def abort(self, request_id: str) -> None:
        """Abort on whichever replica holds the request (the others ignore the id)."""
        await self.handle.broadcast("abort", request_id).results_async(
            timeout_s=CONTROL_TIMEOUT_S, return_exceptions=True
        )

    async def replica_stats(self, drain: bool = True) -> list[ReplicaStats]:
        """Every running replica's stats (a replica that does not answer is left out)."""
        results = await self.handle.broadcast("stats", drain).results_async(
            timeout_s=CONTROL_TIMEOUT_S, return_exceptions=True
        )
        self.last_stats = [r for r in results if isinstance(r, ReplicaStats)]
        return self.last_stats

    async def check_health(self) -> None:
        stats = await self.replica_stats(drain=False)
        if not any(s.healthy for s in stats):
            raise EngineDeadError("no healthy replica of this model is running")

    def get_stats(self, drain: bool = True) -> EngineStats:
        """The sum over replicas of their last stats (counters add; KV usage is the mean)."""
        total = EngineStats()
        for replica in self.last_stats:
            for f in fields(EngineStats):
                value = getattr(replica.stats, f.name)
                if isinstance(value, int | float) and not isinstance(value, bool):
                    setattr(total, f.name, getattr(total, f.name) + value)
        if self.last_stats:
            total.kv_cache_usage /= len(self.last_stats)
        return total

    async def shutdown(self) -> None:
        """Nothing to stop here: the replicas belong to Ray Serve (the config removes them)."""


def _replica_died(request_id: str, replica: str | None, started: bool) -> EngineDeadError:
    where = f"replica {replica}" if replica else "its replica"
    if started:
        return EngineDeadError(
            f"{where} died while streaming request {request_id}; the text sent so far is all "
            "there is (resend the request: it goes to a healthy replica)"
        )
    return EngineDeadError(f"{where} died before request {request_id} started, on every retry")
