"""The ingress: one OpenAI-compatible endpoint in front of every model's replicas.

It is the server package's app (``assemble_app``: the same routes, request models, caps, SSE and
error shapes as ``pagedserve serve``) over a ``ServedModels`` whose engines are RemoteEngines,
one per model, with the cluster's own /health and /metrics in front. A request's ``model``
picks the RemoteEngine; its router picks the replica.

The set of models is the ingress deployment's ``user_config``: redeploying the config with a
model added, resized or removed reconfigures the running ingress in place (Ray Serve calls
``reconfigure``; the replica is not restarted), so the streams it carries go on. A model that is
configured but whose replicas are not up yet answers 503 (``model_loading``), not 404.

A disaggregated prefill/decode pair (a model with ``prefill`` in the config) is served by its
decode replicas' RemoteEngine wrapped in the server's ``PrefillFirst`` over its prefill
replicas' (``EnginePrefill``): each prompt is prefilled there first, and the decode replica
fetches its blocks with the handle (docs/kv_connectors.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from ray import serve
from starlette.routing import Route

from pagedserve.cluster.config import ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT
from pagedserve.cluster.observability import ClusterMetrics, cluster_health, cluster_metrics
from pagedserve.cluster.remote_engine import RemoteEngine, RouteSettings
from pagedserve.server.app import assemble_app
from pagedserve.server.config import ServerConfig
from pagedserve.server.disaggregated import EnginePrefill, PrefillFirst
from pagedserve.server.errors import APIError
from pagedserve.server.state import ServedModels, ServerState, now_s

logger = logging.getLogger("pagedserve.cluster")
METRICS_REFRESH_S = 10.0
DESCRIBE_RETRY_S = 1.0


class ClusterModels(ServedModels):
    """ServedModels that also knows the models still loading (a 503 for those, not a 404)."""

    def __init__(self) -> None:
        super().__init__()
        self.loading: dict[str, str] = {}  # name -> app name
        self.order: list[str] = []  # the config's order (models come up in any order)

    def states(self) -> list[ServerState]:
        rank = {name: i for i, name in enumerate(self.order)}
        return sorted(super().states(), key=lambda s: rank.get(s.model_name, len(rank)))

    def names(self) -> list[str]:
        return [s.model_name for s in self.states()]

    def state_for(self, name: str | None) -> ServerState:
        if name is not None and name in self.loading and name not in self.names():
            raise APIError(
                f"the model {name!r} is starting (its replicas are loading); retry shortly",
                503,
                code="model_loading",
                headers={"Retry-After": "5"},
            )
        return super().state_for(name)


class DisaggregatedReplicas(PrefillFirst):
    """A P/D pair's decode and prefill replicas as one model: each request as ``PrefillFirst``
    runs it, and every replica of both kinds in /metrics and /health."""

    def __init__(self, decode: RemoteEngine, prefill: RemoteEngine) -> None:
        super().__init__(decode, EnginePrefill(prefill), decode.block_size)
        self.prefill_replicas = prefill

    async def replica_stats(self, drain: bool = True):
        decode = await self.engine.replica_stats(drain=drain)
        return [*decode, *await self.prefill_replicas.replica_stats(drain=drain)]

    @property
    def retries(self) -> int:
        return self.engine.retries + self.prefill_replicas.retries


def cluster_app(models: ClusterModels, config: ServerConfig, metrics: ClusterMetrics):
    """The ingress's ASGI app: the server's, with /health and /metrics over every replica."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        refresher = asyncio.create_task(_refresh(metrics))
        try:
            yield
        finally:
            refresher.cancel()

    routes = [
        Route("/health", cluster_health, methods=["GET"]),
        Route("/metrics", cluster_metrics, methods=["GET"]),
    ]
    app = assemble_app(models, config, lifespan, routes)
    app.state.metrics = metrics
    return app


async def _refresh(metrics: ClusterMetrics) -> None:
    """Drain the replicas' finished-request latencies even when nobody scrapes."""
    while True:
        await asyncio.sleep(METRICS_REFRESH_S)
        try:
            await metrics.collect()
        except Exception:  # a metrics hiccup must never take the ingress down
            logger.exception("collecting replica metrics failed")


@serve.ingress()
class ClusterIngress:
    """The ingress deployment: the app above, and the model set from its user_config."""

    def __init__(self, server: dict[str, Any] | None = None) -> None:
        self.config = ServerConfig(**(server or {}))
        self.models = ClusterModels()
        self.metrics = ClusterMetrics(self.models)
        self.routes: dict[str, RouteSettings] = {}
        self.revisions: dict[str, str] = {}
        self.describing: dict[str, asyncio.Task] = {}

    def __serve_build_asgi_app__(self):
        return cluster_app(self.models, self.config, self.metrics)

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        wanted = {m["name"]: m for m in user_config.get("models", [])}
        self.models.order = list(wanted)
        for name in [n for n in {*self.models.names(), *self.models.loading} if n not in wanted]:
            self._forget(name)
        for name, settings in wanted.items():
            route = self.routes.setdefault(name, RouteSettings())
            route.routing = settings["routing"]
            route.prefix_blocks = settings["prefix_blocks"]
            route.busy_threshold = settings["busy_threshold"]
            if self.revisions.get(name) != settings["revision"]:
                self.revisions[name] = settings["revision"]
                self._describe_later(name, settings["app_name"], settings.get("prefill_app_name"))

    def ready_models(self) -> list[str]:
        """Models whose replicas answered (deploy waits for all of them)."""
        return self.models.names()

    def _forget(self, name: str) -> None:
        task = self.describing.pop(name, None)
        if task is not None:
            task.cancel()
        self.models.remove(name)
        self.models.loading.pop(name, None)
        self.routes.pop(name, None)
        self.revisions.pop(name, None)

    def _describe_later(self, name: str, app_name: str, prefill_app: str | None = None) -> None:
        """Ask a replica of the model for its tokenizer and limits, in the background (its
        replicas may still be loading); the model is served as soon as one answers (for a
        P/D pair, one of each kind)."""
        if name not in self.models.names():
            self.models.loading[name] = app_name
        previous = self.describing.pop(name, None)
        if previous is not None:
            previous.cancel()
        self.describing[name] = asyncio.create_task(self._describe(name, app_name, prefill_app))

    async def _describe(self, name: str, app_name: str, prefill_app: str | None) -> None:
        engine = await self._remote_engine(name, app_name)
        if prefill_app is not None:
            engine = DisaggregatedReplicas(engine, await self._remote_engine(name, prefill_app))
        self.models.add(
            ServerState(engine=engine, config=self.config, model_name=name, created=now_s())
        )
        self.models.loading.pop(name, None)
        self.describing.pop(name, None)

    async def _remote_engine(self, name: str, app_name: str) -> RemoteEngine:
        """The application's replicas as a RemoteEngine, once one of them answers."""
        while True:
            try:
                handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name)
                description = await handle.describe.remote()
                return RemoteEngine(handle, description, self.routes[name])
            except asyncio.CancelledError:
                raise
            except Exception as error:  # not deployed yet, or its replicas are starting
                logger.info("waiting for model %s (%s): %r", name, app_name, error)
                await asyncio.sleep(DESCRIBE_RETRY_S)


def ingress_app(args: dict[str, Any]):
    """The application builder that Ray Serve's config names (``import_path``)."""
    return serve.deployment(ClusterIngress, name=INGRESS_DEPLOYMENT).bind(args.get("server") or {})
