"""One engine replica: an AsyncLLM in a Ray Serve replica (a Ray actor, a process of its own).

Ray places the replica (its CPUs, GPUs and custom resources), restarts it when its process dies
or its health check fails, and scales the number of replicas; the replica runs the pagedserve
engine: paging, prefix cache, continuous batching, tensor parallelism over its own GPUs.

Threads: ``torch_threads`` caps torch's, OpenMP's and numba's pools before they are created, so
two replicas on a two-core node take one core each instead of fighting over both.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ray import serve

from pagedserve.cluster.config import ENGINE_DEPLOYMENT
from pagedserve.cluster.routing import ReplicaRequest


@dataclass
class ModelDescription:
    """What the ingress needs to serve a model whose engines run elsewhere: the tokenizer (for
    chat templates and token counts) and the limits requests are checked against."""

    tokenizer: Any
    model_config: Any
    scheduler_config: Any
    block_size: int
    image_placeholder: str | None = None  # None: the model takes no images
    max_image_tokens: int = 0  # the most placeholder rows one image expands to
    args: Any = None  # the replica's EngineArgs (image limits, the local media folder)


@dataclass
class ReplicaStart:
    """The first item of every stream: which replica took the request (a retry avoids it)."""

    replica_id: str


@dataclass
class ReplicaStats:
    """One replica's figures for the ingress's /metrics and /health."""

    replica_id: str
    node_id: str
    pid: int
    stats: Any  # EngineStats
    blocks_held: int
    num_requests: int
    healthy: bool
    error: str | None = None
    torch_threads: int = 0  # as the replica's torch sees it (limit_threads set it)


def limit_threads(num_threads: int) -> None:
    """Before torch or numba start their pools: every pool of this process gets num_threads."""
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ[name] = str(num_threads)
    import numba
    import torch

    torch.set_num_threads(num_threads)
    numba.set_num_threads(min(num_threads, numba.config.NUMBA_NUM_THREADS))


class EngineReplica:
    """A Serve deployment class: one AsyncLLM, its streams, its stats and its health."""

    def __init__(self, engine_args: dict[str, Any], torch_threads: int = 1) -> None:
        limit_threads(torch_threads)
        from pagedserve.engine import AsyncLLM, EngineArgs

        self.engine = AsyncLLM(EngineArgs(**engine_args))
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.num_requests = 0

    def describe(self) -> ModelDescription:
        return ModelDescription(
            tokenizer=self.engine.tokenizer,
            model_config=self.engine.model_config,
            scheduler_config=self.engine.scheduler_config,
            block_size=self.engine.cache_config.block_size,
            image_placeholder=self.engine.image_placeholder,
            max_image_tokens=self.engine.max_image_tokens,
            args=self.engine.args,
        )

    async def generate(self, request: ReplicaRequest) -> AsyncIterator[Any]:
        """``ReplicaStart``, then the request's cumulative RequestOutputs (a pooling request's
        one PoolingRequestOutput). A caller that goes away cancels this generator, and
        AsyncLLM aborts the request (its blocks are freed)."""
        from pagedserve.engine import PoolingParams

        self.num_requests += 1
        if isinstance(request.params, PoolingParams):  # a pooling model's one output
            outputs = self.engine.encode(
                request.prompt_token_ids, request.params, request.request_id, request.prompt,
                request.priority, token_type_ids=request.token_type_ids,
            )  # fmt: skip
        else:
            outputs = self.engine.generate(
                request.prompt_token_ids, request.params, request.request_id, request.prompt,
                request.priority, multi_modal_data=request.multi_modal_data,
            )  # fmt: skip
        try:
            yield ReplicaStart(self.replica_id)
            async for output in outputs:
                yield output
        finally:
            self.num_requests -= 1

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    def stats(self, drain: bool = True) -> ReplicaStats:
        import ray
        import torch

        manager = self.engine.engine.kv_cache_manager
        error = None if self.engine.dead_error is None else repr(self.engine.dead_error)
        return ReplicaStats(
            replica_id=self.replica_id,
            node_id=ray.get_runtime_context().get_node_id(),
            pid=os.getpid(),
            stats=self.engine.get_stats(drain),
            blocks_held=manager.num_blocks - manager.num_free_blocks,
            num_requests=self.num_requests,
            healthy=error is None,
            error=error,
            torch_threads=torch.get_num_threads(),
        )

    async def check_health(self) -> None:
        """Serve calls this every health_check_period_s: a dead engine loop fails it, and Serve
        replaces the replica."""
        await self.engine.check_health()

    async def __del__(self) -> None:
        await self.engine.shutdown()


def engine_app(args: dict[str, Any]):
    """The application builder that Ray Serve's config names (``import_path``)."""
    deployment = serve.deployment(EngineReplica, name=ENGINE_DEPLOYMENT)
    return deployment.bind(args["engine"], args.get("torch_threads", 1))
