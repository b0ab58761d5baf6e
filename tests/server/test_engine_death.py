"""A dead engine: the request in flight and every later one get 503 (code engine_dead), and
/health turns 503, so that a supervisor restarts the process."""

from __future__ import annotations

import asyncio

from starlette.testclient import TestClient

from pagedserve.server.app import build_app
from pagedserve.server.testing import make_engine


def test_dead_engine_answers_503_and_health_says_so(tiny_path):
    engine = make_engine(tiny_path)

    def broken_step():
        raise RuntimeError("simulated device failure")

    engine.engine.step = broken_step
    client = TestClient(build_app(engine, model_name="tiny"), raise_server_exceptions=False)
    try:
        assert client.get("/health").json() == {"status": "ok"}
        for stream in (False, True, False):
            body = {"prompt": "Hello", "max_tokens": 4, "stream": stream}
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 503, response.text
            error = response.json()["error"]
            assert error["code"] == "engine_dead" and "simulated device failure" in error["message"]
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "dead"
    finally:
        asyncio.run(engine.shutdown())
