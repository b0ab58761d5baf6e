"""/health and /metrics over every replica of every model.

/metrics reuses the server's exporter (``EngineMetrics``, the same families and buckets as
``pagedserve serve``) once per replica, fed with the stats each replica returns to a broadcast,
and merges their families into one exposition with a ``replica`` label on every series, plus a
few of the cluster's own: replicas per model, blocks held per replica, requests retried after
their replica died. A replica that stops answering drops out (its series end, as Prometheus
expects of an instance that is gone).

/health asks every replica (a broadcast): 200 while each model has at least one healthy
replica, 503 otherwise, with each replica's status, node and blocks in the body.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedserve.server.metrics import PREFIX, EngineMetrics


class _StatsView:
    """The EngineMetrics' ``engine``: hands over one replica's latest stats exactly once."""

    def __init__(self) -> None:
        self.stats = None

    def get_stats(self, drain: bool = True):
        stats = self.stats
        self.stats = replace(
            stats, finished_requests=[], iteration_tokens=[], inter_token_latencies=[]
        )
        return stats


class ClusterMetrics:
    """Per-replica exporters, refreshed from broadcasts; ``render()`` is the merged body."""

    def __init__(self, models) -> None:
        self.models = models  # ServedModels of RemoteEngines
        self.exporters: dict[tuple[str, str], EngineMetrics] = {}
        self.replica_stats: dict[tuple[str, str], object] = {}
        self._lock = asyncio.Lock()

    async def collect(self) -> None:
        """One broadcast per model: every replica's stats into its exporter (drained once)."""
        async with self._lock:
            seen: dict[tuple[str, str], object] = {}
            for state in self.models.states():
                for replica in await state.engine.replica_stats(drain=True):
                    seen[(state.model_name, replica.replica_id)] = replica
            for key, replica in seen.items():
                exporter = self.exporters.get(key)
                if exporter is None:
                    max_len = self.models.state_for(key[0]).engine.scheduler_config.max_model_len
                    exporter = EngineMetrics(_StatsView(), key[0], max_model_len=max_len)
                    self.exporters[key] = exporter
                exporter.engine.stats = replica.stats
                exporter.in_flight = lambda r=replica: r.num_requests
                exporter.refresh()
            self.exporters = {k: v for k, v in self.exporters.items() if k in seen}
            self.replica_stats = seen

    def render(self) -> bytes:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_MergedCollector(self))
        return generate_latest(registry)


class _MergedCollector:
    def __init__(self, metrics: ClusterMetrics) -> None:
        self.metrics = metrics

    def collect(self):
        families: dict[str, Metric] = {}
        for (_, replica_id), exporter in self.metrics.exporters.items():
            for family in exporter.registry.collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = Metric(family.name, family.documentation, family.type, family.unit)
                    families[family.name] = merged
                merged.samples += [
                    s._replace(labels={**s.labels, "replica": replica_id}) for s in family.samples
                ]
        yield from families.values()
        yield from self._cluster_families()

    def _cluster_families(self):
        replicas = GaugeMetricFamily(
            PREFIX + "cluster_replicas", "Replicas answering, per model.", labels=["model_name"]
        )
        blocks = GaugeMetricFamily(
            PREFIX + "replica_blocks_held",
            "KV blocks held by some sequence (cached-but-free prefix blocks count as free).",
            labels=["model_name", "replica"],
        )
        retries = CounterMetricFamily(
            PREFIX + "cluster_request_retries",
            "Requests re-sent to another replica after theirs died before any output.",
            labels=["model_name"],
        )
        counts: dict[str, int] = {}
        for (model, replica_id), stats in self.metrics.replica_stats.items():
            counts[model] = counts.get(model, 0) + 1
            blocks.add_metric([model, replica_id], stats.blocks_held)
        for state in self.metrics.models.states():
            replicas.add_metric([state.model_name], counts.get(state.model_name, 0))
            retries.add_metric([state.model_name], state.engine.retries)
        yield from (replicas, blocks, retries)


async def cluster_metrics(request: Request) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    metrics: ClusterMetrics = request.app.state.metrics
    await metrics.collect()
    return Response(await asyncio.to_thread(metrics.render), media_type=CONTENT_TYPE_LATEST)


async def cluster_health(request: Request) -> Response:
    """Each model's replicas as they answer now; 503 unless every model has a healthy one."""
    models = request.app.state.models
    report: dict[str, dict] = {}
    for state in models.states():
        replicas = [
            {
                "replica": s.replica_id,
                "node": s.node_id,
                "status": "ok" if s.healthy else "dead",
                "blocks_held": s.blocks_held,
                "num_requests": s.num_requests,
                "torch_threads": s.torch_threads,
                **({"error": s.error} if s.error else {}),
            }
            for s in await state.engine.replica_stats(drain=False)
        ]
        healthy = any(r["status"] == "ok" for r in replicas)
        report[state.model_name] = {"status": "ok" if healthy else "down", "replicas": replicas}
    for name in models.loading:
        report[name] = {"status": "loading", "replicas": []}
    ok = bool(report) and all(m["status"] == "ok" for m in report.values())
    body = {"status": "ok" if ok else "degraded", "models": report}
    return JSONResponse(body, status_code=200 if ok else 503)
