"""A disaggregated prefill/decode pair in the cluster's config: two applications of one model
(decode replicas as kv_consumer, prefill replicas as kv_producer), and the ingress's app over
them answering as one engine, each prompt's blocks prefilled on the one and fetched by the
other (the replicas stood in for by local engines, the blocks over a real TCP socket)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray.serve")

from ray.serve.schema import ServeDeploySchema  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from pagedserve.cluster.config import ClusterConfigError, build_serve_config, load_config  # noqa: E402
from pagedserve.cluster.ingress import ClusterModels, DisaggregatedReplicas, cluster_app  # noqa: E402
from pagedserve.cluster.observability import ClusterMetrics  # noqa: E402
from pagedserve.server.config import ServerConfig  # noqa: E402
from pagedserve.server.state import ServerState  # noqa: E402
from pagedserve.server.testing import make_engine  # noqa: E402


def _pair(model: str, **prefill) -> dict:
    return {"models": [{"name": "pd", "engine": {"model": model}, "prefill": prefill}]}


def test_a_pair_is_two_applications_of_one_model(tiny_checkpoint):
    model = tiny_checkpoint("llama")
    config = load_config(_pair(model, num_replicas=2, engine={"max_num_seqs": 8}))
    serve_config = build_serve_config(config)
    ServeDeploySchema.model_validate(serve_config)
    apps = {app["name"]: app for app in serve_config["applications"]}
    assert set(apps) == {"pagedserve", "model-pd", "model-pd-prefill"}
    decode, prefill = apps["model-pd"], apps["model-pd-prefill"]
    assert decode["args"]["engine"]["kv_transfer_config"] == {"kv_role": "kv_consumer"}
    assert prefill["args"]["engine"]["kv_transfer_config"]["kv_role"] == "kv_producer"
    assert prefill["args"]["engine"]["max_num_seqs"] == 8
    assert prefill["deployments"][0]["num_replicas"] == 2
    (settings,) = apps["pagedserve"]["deployments"][0]["user_config"]["models"]
    assert settings["prefill_app_name"] == "model-pd-prefill"


@pytest.mark.parametrize(
    "prefill, message",
    [
        ({"replicas": 2}, "unknown field"),
        ({"engine": {"kv_transfer_config": {}}}, "kv_transfer_config"),
        ({"engine": {"kv_offload_memory": 1 << 20}}, "one or the other"),
        ({"engine": {"no_such_option": 1}}, "no_such_option"),
    ],
)
def test_a_bad_pair_is_refused_naming_what_is_wrong(tiny_checkpoint, prefill, message):
    with pytest.raises(ClusterConfigError, match=message):
        load_config(_pair(tiny_checkpoint("llama"), **prefill))


class LocalReplicas:
    """A RemoteEngine's surface over one local engine."""

    def __init__(self, engine):
        self.engine, self.retries = engine, 0
        self.tokenizer, self.model_config = engine.tokenizer, engine.model_config
        self.scheduler_config = engine.scheduler_config
        self.block_size = engine.cache_config.block_size
        self.image_placeholder, self.args = engine.image_placeholder, engine.args
        self.max_image_tokens = engine.max_image_tokens

    def generate(self, *args, **kwargs):
        return self.engine.generate(*args, **kwargs)

    async def abort(self, request_id):
        await self.engine.abort(request_id)

    async def replica_stats(self, drain=True):
        return [self.engine.get_stats(drain)]


def test_the_ingress_serves_a_pair_as_one_engine(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    alone = make_engine(path)
    decode = make_engine(path, kv_transfer_config={"kv_role": "kv_consumer"})
    producer = {"kv_role": "kv_producer", "kv_ip": "0.0.0.0", "kv_port": 0}
    prefill = make_engine(path, kv_transfer_config=producer)
    pair = DisaggregatedReplicas(LocalReplicas(decode), LocalReplicas(prefill))
    models, config = ClusterModels(), ServerConfig()
    models.order = ["pd", "alone"]
    models.add(ServerState(engine=pair, config=config, model_name="pd"))
    models.add(ServerState(engine=LocalReplicas(alone), config=config, model_name="alone"))
    client = TestClient(cluster_app(models, config, ClusterMetrics(models)))
    body = {"prompt": [(11 * i + 3) % 480 + 3 for i in range(50)], "max_tokens": 6}
    try:
        answers = [
            client.post("/v1/completions", json={"model": name, "temperature": 0, **body})
            for name in ("pd", "alone")
        ]
        assert [a.status_code for a in answers] == [200, 200]
        assert answers[0].json()["choices"] == answers[1].json()["choices"]
        assert decode.get_stats().kv_connector.hit_tokens["remote"] == 48
        assert len(asyncio.run(pair.replica_stats())) == 2  # both kinds in /metrics
    finally:
        for engine in (alone, decode, prefill):
            asyncio.run(engine.shutdown())
