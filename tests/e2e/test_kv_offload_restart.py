"""The disk tier across restarts of a real server (``pagedserve serve --kv-offload-dir``, tiny
Llama, CPU).

- A server stopped as usual (SIGTERM) and started again on the same folder serves a prompt it
  saw from disk: the same answer, the hit counted in /metrics.
- A server killed (SIGKILL) while it saves blocks leaves nothing a restarted server serves
  torn: every answer is the one computed before, no block is refused, no temporary file is
  left behind.
"""

from __future__ import annotations

import signal

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.server.testing import live_server

pytestmark = pytest.mark.slow  # three real servers, one after the other

COMMON = ("--max-model-len", "256", "--block-size", "8", "--num-gpu-blocks-override", "64")


def _prompt(seed: int, length: int) -> list[int]:
    return [(31 * i + 7 * seed) % 480 + 3 for i in range(length)]


def _answer(server, prompt: list[int]) -> str:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    reply = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def _counter(server, name: str) -> dict[str, float]:
    """``pagedserve:<name>`` by its tier (or reason) label."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {
        sample.labels.get("tier", sample.labels.get("reason")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == f"pagedserve:{name}"
    }


def test_restarts_serve_seen_prefixes_from_disk_and_never_a_torn_block(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("llama")
    offload = ("--kv-offload-dir", str(tmp_path))
    seen = _prompt(0, 81)  # 10 full blocks before the last token
    with live_server(path, *COMMON, *offload) as first:
        cold = _answer(first, seen)
        first.terminate()  # SIGTERM: drained, the disk writer's queue written out
        assert first.process.wait(timeout=60) == 0
    many = [_prompt(seed, 120) for seed in range(1, 9)]
    with live_server(path, *COMMON, *offload) as second:
        assert _answer(second, seen) == cold
        assert _counter(second, "kv_connector_hit_tokens_total")["disk"] >= 80
        answers = [_answer(second, prompt) for prompt in many]
        second.process.send_signal(signal.SIGKILL)  # while its writer may still be saving
        second.process.wait(timeout=30)
    with live_server(path, *COMMON, *offload) as third:
        assert [_answer(third, prompt) for prompt in many] == answers
        assert not any(_counter(third, "kv_connector_rejected_blocks_total").values())
        assert not list(tmp_path.rglob("*.tmp"))
