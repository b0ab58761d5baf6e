"""A cluster replica that is a multi-node pipeline engine: ``engine: {pipeline_parallel_size:
2, distributed_executor_backend: ray}`` on a local Ray of two CPUs. The replica's actor is rank 0
(it reserves one CPU) and its engine places rank 1 in a placement group of its own (the other
CPU); Serve's HTTP proxy answers a completion as one engine alone does."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest

pytest.importorskip("ray.serve")

import ray  # noqa: E402
from ray import serve  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from pagedserve.cluster.config import load_config  # noqa: E402
from pagedserve.cluster.deploy import connect, deploy  # noqa: E402
from pagedserve.engine import AsyncLLM, EngineArgs  # noqa: E402
from pagedserve.server.app import build_app  # noqa: E402
from pagedserve.server.config import ServerConfig  # noqa: E402
from pagedserve.server.testing import free_port  # noqa: E402

pytestmark = pytest.mark.slow  # a local Ray, Serve, a replica and its worker actor: ~30 s

ENGINE = {"max_model_len": 256, "num_gpu_blocks_override": 64, "block_size": 8}
BODY = {"prompt": [(7 * i + 5) % 480 + 3 for i in range(45)], "max_tokens": 6, "temperature": 0}


def test_a_pipeline_replica_placed_by_ray_answers_as_one_engine(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    engine = AsyncLLM(EngineArgs(model=path, **ENGINE))
    try:
        alone = TestClient(build_app(engine, ServerConfig(), "pp")).post(
            "/v1/completions", json=BODY
        )
    finally:
        asyncio.run(engine.shutdown())
    staged = {**ENGINE, "pipeline_parallel_size": 2, "distributed_executor_backend": "ray"}
    port = free_port()
    config = {"port": port, "models": [{"name": "pp", "engine": {"model": path, **staged}}]}
    os.environ["RAY_memory_monitor_refresh_ms"] = "0"
    try:
        connect(num_cpus=2)  # the replica's one CPU and its worker's: nothing to spare
        deploy(load_config(config), timeout_s=600)
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=BODY, timeout=300)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"] == alone.json()["choices"]
        groups = ray.util.placement_group_table().values()
        assert [g["bundles"] for g in groups if g["state"] == "CREATED"] == [{0: {"CPU": 1.0}}]
    finally:
        serve.shutdown()
        ray.shutdown()
        os.environ.pop("RAY_memory_monitor_refresh_ms", None)
