"""A chat model and an embedding model behind the cluster's one endpoint: the config that
deploys them, and the ingress's app answering /v1/chat/completions from the first and
/v1/embeddings from the second (each route on the other model is a 400 naming the model)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray.serve")

from ray.serve.schema import ServeDeploySchema  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from pagedserve.cluster.config import build_serve_config, load_config  # noqa: E402
from pagedserve.cluster.ingress import ClusterModels, cluster_app  # noqa: E402
from pagedserve.cluster.observability import ClusterMetrics  # noqa: E402
from pagedserve.engine import AsyncLLM, EngineArgs  # noqa: E402
from pagedserve.server.config import ServerConfig  # noqa: E402
from pagedserve.server.state import ServerState  # noqa: E402
from pagedserve.server.testing import make_engine  # noqa: E402

YAML = """
models:
  - name: chat
    engine: {{model: {chat}, kv_cache_memory: 64MiB}}
  - name: embed
    engine: {{model: {embed}, runner: pooling}}
    num_replicas: 2
"""


class LocalReplica:
    """A RemoteEngine's surface over one local engine (generate and encode, as the replicas
    answer them)."""

    def __init__(self, engine):
        self.engine = engine
        self.tokenizer, self.model_config = engine.tokenizer, engine.model_config
        self.scheduler_config, self.retries = engine.scheduler_config, 0
        self.image_placeholder, self.args = engine.image_placeholder, engine.args
        self.max_image_tokens = engine.max_image_tokens

    def generate(self, *args, **kwargs):
        return self.engine.generate(*args, **kwargs)

    def encode(self, *args, **kwargs):
        return self.engine.encode(*args, **kwargs)

    async def abort(self, request_id):
        await self.engine.abort(request_id)

    async def replica_stats(self, drain=True):
        return []


def test_the_config_deploys_both_models(tmp_path, tiny_checkpoint, tiny_pooling_checkpoint):
    path = tmp_path / "cluster.yaml"
    chat, embed = tiny_checkpoint("llama"), tiny_pooling_checkpoint("bert")
    path.write_text(YAML.format(chat=chat, embed=embed))
    serve_config = build_serve_config(load_config(path))
    ServeDeploySchema.model_validate(serve_config)
    apps = {app["name"]: app for app in serve_config["applications"]}
    assert set(apps) == {"pagedserve", "model-chat", "model-embed"}
    assert apps["model-embed"]["args"]["engine"] == {"model": embed, "runner": "pooling"}


def test_one_endpoint_answers_chat_and_embeddings(tiny_checkpoint, tiny_pooling_checkpoint):
    engines = {
        "chat": make_engine(tiny_checkpoint("llama")),
        "embed": AsyncLLM(EngineArgs(model=tiny_pooling_checkpoint("bert"))),
    }
    models = ClusterModels()
    models.order = list(engines)
    config = ServerConfig()
    for name, engine in engines.items():
        models.add(ServerState(engine=LocalReplica(engine), config=config, model_name=name))
    client = TestClient(cluster_app(models, config, ClusterMetrics(models)))
    try:
        messages = [{"role": "user", "content": "hi"}]
        chat = client.post(
            "/v1/chat/completions", json={"model": "chat", "messages": messages, "max_tokens": 3}
        )
        assert chat.status_code == 200 and chat.json()["model"] == "chat"
        embedding = client.post("/v1/embeddings", json={"model": "embed", "input": ["a", "b"]})
        assert embedding.status_code == 200 and embedding.json()["model"] == "embed", embedding.text
        assert len(embedding.json()["data"]) == 2
        crossed = client.post("/v1/embeddings", json={"model": "chat", "input": "a"})
        assert crossed.status_code == 400 and crossed.json()["error"]["param"] == "model"
        crossed = client.post("/v1/chat/completions", json={"model": "embed", "messages": messages})
        assert crossed.status_code == 400 and crossed.json()["error"]["param"] == "model"
    finally:
        for engine in engines.values():
            asyncio.run(engine.shutdown())
