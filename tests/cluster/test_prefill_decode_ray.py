"""A prefill/decode pair deployed on a local Ray (one node): Serve's HTTP proxy answers a
completion as one engine alone does, the prompt prefilled by the prefill replica and its blocks
fetched over TCP by the decode replica (the cluster's /metrics counts them)."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest

pytest.importorskip("ray.serve")

import ray  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from ray import serve  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from pagedserve.cluster.config import load_config  # noqa: E402
from pagedserve.cluster.deploy import connect, deploy  # noqa: E402
from pagedserve.engine import AsyncLLM, EngineArgs  # noqa: E402
from pagedserve.server.app import build_app  # noqa: E402
from pagedserve.server.config import ServerConfig  # noqa: E402
from pagedserve.server.testing import free_port  # noqa: E402

pytestmark = pytest.mark.slow  # a local Ray and three replicas: about a minute

ENGINE = {"max_model_len": 256, "num_gpu_blocks_override": 64, "block_size": 8}
BODY = {"prompt": [(7 * i + 5) % 480 + 3 for i in range(45)], "max_tokens": 6, "temperature": 0}


def _remote_hits(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "pagedserve:kv_connector_hit_tokens_total"
        and sample.labels.get("tier") == "remote"
    )


def test_a_deployed_pair_answers_as_one_engine(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    engine = AsyncLLM(EngineArgs(model=path, **ENGINE))
    try:
        alone = TestClient(build_app(engine, ServerConfig(), "pd")).post(
            "/v1/completions", json=BODY
        )
    finally:
        asyncio.run(engine.shutdown())
    port = free_port()
    config = {"port": port, "models": [
        {"name": "pd", "engine": {"model": path, **ENGINE}, "num_cpus": 1, "prefill": {}}
    ]}  # fmt: skip
    os.environ["RAY_memory_monitor_refresh_ms"] = "0"
    try:
        connect(num_cpus=4)
        deploy(load_config(config), timeout_s=600)
        url = f"http://127.0.0.1:{port}"
        answer = httpx.post(url + "/v1/completions", json=BODY, timeout=300)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"] == alone.json()["choices"]
        assert _remote_hits(url) == 40
    finally:
        serve.shutdown()
        ray.shutdown()
        os.environ.pop("RAY_memory_monitor_refresh_ms", None)
