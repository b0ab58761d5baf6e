"""Disaggregated prefill/decode with two real servers (``pagedserve serve``, tiny Llama, CPU):
a prefill server (kv_producer) and a decode server (kv_consumer) whose route sends each prompt
to the prefill server first; the blocks travel over TCP between the two processes.

- The decode server's greedy answers (completions and chat) equal the prefill server's own
  answers to the same requests (a single engine's), with the prompt's blocks fetched (its
  /metrics count remote hits; the prefill server's, bytes saved for transfer), and neither
  server holds a block afterwards.
- The prefill server killed between its prefill and the decode server's fetch: the decode
  server still answers right (it recomputes), promptly; killed for good: the decode server
  computes every prompt itself.
"""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.server.testing import free_port, live_server

pytestmark = pytest.mark.slow  # two real servers: ~20 s to start

COMMON = ("--max-model-len", "256", "--block-size", "8", "--num-gpu-blocks-override", "96")
PROMPT_IDS = [(17 * i + 5) % 480 + 3 for i in range(45)]  # 5 full blocks before the last token
CHAT = [{"role": "user", "content": "Tell me how paged attention reads a block table."}]


def _series(server, name: str) -> dict[tuple, float]:
    """The samples of ``pagedserve:<name>`` by their labels other than the model's."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"pagedserve:{name}":
                labels = tuple(
                    sorted((k, v) for k, v in sample.labels.items() if k != "model_name")
                )
                found[labels] = sample.value
    return found


def _completion(server, **body) -> dict:
    body = {"prompt": PROMPT_IDS, "max_tokens": 10, "temperature": 0, "ignore_eos": True, **body}
    reply = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _chat(server) -> str:
    body = {"messages": CHAT, "max_tokens": 10, "temperature": 0}
    reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"]


def _idle(server) -> bool:
    return _series(server, "kv_cache_usage_perc") == {(): 0.0}


@pytest.fixture(scope="module")
def pair(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    producer = {"kv_connector": "TCPConnector", "kv_role": "kv_producer", "kv_port": free_port()}
    with live_server(path, *COMMON, "--kv-transfer-config", json.dumps(producer)) as prefill:
        consumer = {
            "kv_connector": "TCPConnector",
            "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"prefill_url": prefill.url, "transfer_timeout": 5},
        }
        with live_server(path, *COMMON, "--kv-transfer-config", json.dumps(consumer)) as decode:
            yield prefill, decode


def test_decode_server_answers_as_a_single_engine_with_fetched_blocks(pair):
    prefill, decode = pair
    alone = _completion(prefill)["choices"][0]["text"]  # the prefill server, as one engine
    chat_alone = _chat(prefill)
    assert _completion(decode)["choices"][0]["text"] == alone
    assert _chat(decode) == chat_alone
    hits = _series(decode, "kv_connector_hit_tokens_total")
    assert hits[(("tier", "remote"),)] >= 40  # the completion's 5 blocks, and the chat's
    assert _series(prefill, "kv_connector_saved_bytes_total")[(("tier", "remote"),)] > 0
    assert _series(prefill, "kv_connector_tier_bytes")[(("tier", "remote"),)] == 0  # fetched
    assert _idle(prefill) and _idle(decode)


def test_prefill_server_killed_before_the_fetch_the_decode_server_recomputes(pair):
    prefill, decode = pair
    expected = _completion(decode, prompt=PROMPT_IDS[::-1])["choices"][0]["text"]
    handle = _completion(
        prefill, prompt=PROMPT_IDS[1:], max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )["kv_transfer_params"]
    assert handle["remote_num_blocks"] == 5
    failed = _series(decode, "kv_connector_failed_loads_total")[()]
    prefill.process.send_signal(signal.SIGKILL)
    prefill.process.wait(timeout=30)
    start = time.monotonic()
    answer = _completion(decode, prompt=PROMPT_IDS[1:], kv_transfer_params=handle)
    assert time.monotonic() - start < 30  # no hang: a refused connection, then a recompute
    assert _series(decode, "kv_connector_failed_loads_total")[()] == failed + 1
    # the prefill server is gone for good: the decode server computes prompts itself
    assert _completion(decode, prompt=PROMPT_IDS[::-1])["choices"][0]["text"] == expected
    recomputed = _completion(decode, prompt=PROMPT_IDS[1:])["choices"][0]["text"]
    assert answer["choices"][0]["text"] == recomputed
    assert _idle(decode)
