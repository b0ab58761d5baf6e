"""vLLM's ``kv_transfer_params`` over HTTP, and the decode server's prefill-first route, in
process (a prefill engine's app on a real uvicorn, a decode engine's app on a test client).

- A server without a transfer connector answers a request that sends them with a 400 naming
  the field; the batch chat route refuses them by name.
- A prefill engine's answer carries the transfer's handle at the top of the body.
- A decode app whose engine is wrapped in ``PrefillFirst`` answers chat and completions as the
  prefill engine alone does, its prompts' blocks fetched; with the prefill server unreachable
  it answers the same, computing the prompts itself.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.testclient import TestClient

from pagedserve.server.app import build_app
from pagedserve.server.config import ServerConfig
from pagedserve.server.disaggregated import HTTPPrefill, PrefillFirst
from pagedserve.server.testing import TINY_MODEL_NAME as MODEL
from pagedserve.server.testing import free_port, make_engine, uvicorn_in_thread

PROMPT_IDS = [(13 * i + 7) % 480 + 3 for i in range(40)]
CHAT = {"messages": [{"role": "user", "content": "What does a block table hold?"}]}
GREEDY = {"max_tokens": 8, "temperature": 0}


def _post(client: TestClient, route: str, body: dict):
    return client.post(route, json={"model": MODEL, **GREEDY, **body})


def test_a_server_without_a_transfer_connector_refuses_them(client):
    transfer = {"kv_transfer_params": {"do_remote_decode": True}}
    reply = _post(client, "/v1/completions", {"prompt": PROMPT_IDS, **transfer})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "kv_transfer_params"
    assert "--kv-transfer-config" in reply.json()["error"]["message"]
    batch = {"messages": [CHAT["messages"]], **transfer}
    reply = _post(client, "/v1/chat/completions/batch", batch)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "kv_transfer_params"


@pytest.fixture(scope="module")
def pair(tiny_path):
    producer = make_engine(tiny_path, kv_transfer_config={"kv_role": "kv_producer", "kv_port": 0})
    consumer = make_engine(tiny_path, kv_transfer_config={"kv_role": "kv_consumer"})
    prefill_app = build_app(producer, ServerConfig(), MODEL)
    with uvicorn_in_thread(prefill_app) as prefill_url:
        yield TestClient(prefill_app), prefill_url, consumer
    for engine in (producer, consumer):
        asyncio.run(engine.shutdown())


def _decode_client(consumer, prefill_url: str) -> TestClient:
    engine = PrefillFirst(consumer, HTTPPrefill(prefill_url), consumer.cache_config.block_size)
    return TestClient(build_app(engine, ServerConfig(), MODEL))


def test_a_prefill_answer_carries_the_transfer_handle(pair):
    prefill = pair[0]
    transfer = {"kv_transfer_params": {"do_remote_decode": True}, "max_tokens": 1}
    handle = _post(prefill, "/v1/completions", {"prompt": PROMPT_IDS, **transfer}).json()
    assert handle["kv_transfer_params"]["do_remote_prefill"] is True
    assert handle["kv_transfer_params"]["remote_num_blocks"] == 2  # 39 tokens before the last
    plain = _post(prefill, "/v1/completions", {"prompt": PROMPT_IDS}).json()
    assert "kv_transfer_params" not in plain


@pytest.mark.parametrize("reachable", [True, False])
def test_the_decode_route_answers_as_the_prefill_engine_alone(pair, reachable):
    prefill, prefill_url, consumer = pair
    url = prefill_url if reachable else f"http://127.0.0.1:{free_port()}"
    decode = _decode_client(consumer, url)
    stats = consumer.get_stats().kv_connector
    hits = stats.hit_tokens["remote"] if stats else 0
    prompt = PROMPT_IDS if reachable else PROMPT_IDS[::-1]  # unseen by the decode engine
    chat = {"messages": [{"role": "user", "content": f"Why blocks? ({reachable})"}]}
    for route, body in (("/v1/completions", {"prompt": prompt}), ("/v1/chat/completions", chat)):
        alone, answer = (_post(c, route, body).json() for c in (prefill, decode))
        assert json.dumps(answer["choices"]) == json.dumps(alone["choices"])
        assert "kv_transfer_params" not in answer
    fetched = consumer.get_stats().kv_connector.hit_tokens["remote"] - hits
    assert (fetched >= 32) if reachable else fetched == 0
