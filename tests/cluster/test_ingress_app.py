"""The ingress's app without Ray: two models behind one app (the server's routes over engines
found by name), a model still loading, and /health and /metrics merged over replicas, each
series labelled with its replica."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray.serve")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from pagedserve.cluster.ingress import ClusterModels, cluster_app  # noqa: E402
from pagedserve.cluster.observability import ClusterMetrics  # noqa: E402
from pagedserve.cluster.replica import ReplicaStats  # noqa: E402
from pagedserve.server.config import ServerConfig  # noqa: E402
from pagedserve.server.state import ServerState  # noqa: E402
from pagedserve.server.testing import make_engine  # noqa: E402


class InProcessReplicas:
    """A RemoteEngine's surface over local engines: generation goes to the first one; each
    engine answers for a replica in the stats broadcast (``healthy`` can be switched off)."""

    def __init__(self, engines, names):
        self.engines, self.replica_names = engines, names
        first = engines[0]
        self.tokenizer, self.model_config = first.tokenizer, first.model_config
        self.scheduler_config, self.retries, self.healthy = first.scheduler_config, 0, True

    def generate(self, *args, **kwargs):
        return self.engines[0].generate(*args, **kwargs)

    async def abort(self, request_id):
        await self.engines[0].abort(request_id)

    async def replica_stats(self, drain=True):
        return [
            ReplicaStats(name, "node-a", 0, e.get_stats(drain), 0, 0, self.healthy)
            for name, e in zip(self.replica_names, self.engines)
        ]


@pytest.fixture(scope="module")
def app_and_models(tiny_checkpoint):
    engines = {
        "alpha": [make_engine(tiny_checkpoint("llama")), make_engine(tiny_checkpoint("llama"))],
        "beta": [make_engine(tiny_checkpoint("qwen2"))],
    }
    models = ClusterModels()
    models.order = ["alpha", "beta", "gamma"]
    config = ServerConfig()
    remotes = {}
    for name, replicas in reversed(engines.items()):  # come up out of order
        remotes[name] = InProcessReplicas(replicas, [f"{name}-r{i}" for i in range(len(replicas))])
        models.add(ServerState(engine=remotes[name], config=config, model_name=name))
    models.loading["gamma"] = "model-gamma"
    yield cluster_app(models, config, ClusterMetrics(models)), remotes
    for replicas in engines.values():
        for engine in replicas:
            asyncio.run(engine.shutdown())


def test_one_app_serves_each_model_by_name_in_the_configs_order(app_and_models):
    app, _ = app_and_models
    client = TestClient(app)
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["alpha", "beta"]
    body = {"prompt": "hello there", "max_tokens": 4, "temperature": 0}
    alpha = client.post("/v1/completions", json={"model": "alpha", **body}).json()
    beta = client.post("/v1/completions", json={"model": "beta", **body}).json()
    default = client.post("/v1/completions", json=body).json()  # no model: the first one
    assert alpha["model"] == "alpha" and beta["model"] == "beta" and default["model"] == "alpha"
    assert alpha["choices"][0]["text"] == default["choices"][0]["text"]
    assert alpha["choices"][0]["text"] != beta["choices"][0]["text"]  # two different models
    tokens = client.post("/tokenize", json={"model": "beta", "prompt": "hello"}).json()
    assert tokens["count"] > 0


def test_unknown_and_loading_models_are_a_404_and_a_503(app_and_models):
    app, _ = app_and_models
    client = TestClient(app)
    missing = client.post(
        "/v1/chat/completions",
        json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"
    assert "'alpha', 'beta'" in missing.json()["error"]["message"]
    loading = client.post("/v1/completions", json={"model": "gamma", "prompt": "x"})
    assert loading.status_code == 503 and loading.headers["retry-after"]
    assert loading.json()["error"]["code"] == "model_loading"


def test_metrics_merge_every_replica_under_its_label_and_health_follows_the_replicas(
    app_and_models,
):
    app, remotes = app_and_models
    client = TestClient(app)
    client.post("/v1/completions", json={"model": "alpha", "prompt": "a b c", "max_tokens": 2})
    text = client.get("/metrics").text
    assert text.count("# HELP pagedserve:num_requests_running ") == 1  # one family, merged
    families = {f.name: f for f in text_string_to_metric_families(text)}
    running = {
        (s.labels["model_name"], s.labels["replica"])
        for s in families["pagedserve:num_requests_running"].samples
    }
    assert running == {("alpha", "alpha-r0"), ("alpha", "alpha-r1"), ("beta", "beta-r0")}
    replicas = {
        s.labels["model_name"]: s.value for s in families["pagedserve:cluster_replicas"].samples
    }
    assert replicas == {"alpha": 2, "beta": 1}
    generated = {
        s.labels["replica"]: s.value
        for s in families["pagedserve:generation_tokens"].samples
        if s.name.endswith("_total")
    }
    assert generated["alpha-r0"] >= 2 and generated["alpha-r1"] == 0  # per replica, not summed
    health = client.get("/health")
    assert health.status_code == 503  # gamma is still loading
    assert health.json()["models"]["alpha"]["status"] == "ok"
    assert health.json()["models"]["gamma"]["status"] == "loading"
    remotes["beta"].healthy = False
    assert client.get("/health").json()["models"]["beta"]["status"] == "down"
    remotes["beta"].healthy = True
