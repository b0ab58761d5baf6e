"""Admission control and shutdown on a real uvicorn server: a full queue answers 503 with
Retry-After at once and recovers; SIGTERM drains (503 for newcomers, in-flight requests finish
up to --shutdown-timeout, the rest are aborted) and the process exits 0."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from pagedserve.server.testing import live_server

NAME = "tiny"


class Stream:
    """A streaming completion read in a background thread, event by event."""

    def __init__(self, server, max_tokens: int, prompt: str = "Stream") -> None:
        self.events: list[dict | str] = []
        self.first_event = threading.Event()
        body = {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
        body.update(stream=True, stream_options={"include_usage": True})
        self._thread = threading.Thread(target=self._read, args=(server, body), daemon=True)
        self._thread.start()

    def _read(self, server, body) -> None:
        self.status = None
        with httpx.stream(
            "POST", server.url + "/v1/completions", json=body, headers=server.headers, timeout=120
        ) as response:
            self.status = response.status_code
            for line in response.iter_lines():
                if line.startswith("data: "):
                    payload = line[len("data: ") :]
                    self.events.append(payload if payload == "[DONE]" else json.loads(payload))
                    self.first_event.set()
        self.first_event.set()

    def join(self, timeout: float = 120) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive()

    @property
    def finish_reasons(self) -> list[str]:
        return [
            c["finish_reason"]
            for e in self.events
            if isinstance(e, dict)
            for c in e.get("choices", [])
            if c["finish_reason"]
        ]


@pytest.mark.slow
def test_full_queue_answers_503_at_once_and_recovers(tiny_checkpoint):
    # Long enough (seconds of decoding) that the refusal is answered while it streams.
    path = tiny_checkpoint("llama", max_position_embeddings=4096)
    args = ("--served-model-name", NAME, "--max-model-len", "4096", "--max-num-seqs", "1")
    with live_server(path, *args, "--max-num-waiting", "1") as server:
        running = Stream(server, max_tokens=2000)
        assert running.first_event.wait(60)  # admitted and streaming: the one running slot
        assert running.status == 200, running.events
        waiting = Stream(server, max_tokens=8, prompt="Queued")  # the one waiting slot
        for _ in range(200):
            if server.metric("num_requests_waiting") == 1:
                break
        assert server.metric("num_requests_waiting") == 1
        refused = httpx.post(
            server.url + "/v1/completions",
            json={"model": NAME, "prompt": "One too many", "max_tokens": 4},
            timeout=30,
        )
        # Answered while the first request is still streaming: "at once", not after the queue.
        assert not running.finish_reasons
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "overloaded"
        running.join()
        waiting.join()
        assert running.finish_reasons == ["length"] and waiting.finish_reasons == ["length"]
        again = httpx.post(
            server.url + "/v1/completions",
            json={"model": NAME, "prompt": "Recovered", "max_tokens": 4, "ignore_eos": True},
            timeout=30,
        )
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 4


@pytest.mark.slow
def test_sigterm_drains_then_exits_zero(tiny_checkpoint):
    path = tiny_checkpoint("llama", max_position_embeddings=16384)
    args = ("--served-model-name", NAME, "--max-model-len", "16384", "--shutdown-timeout", "3")
    with live_server(path, *args, "--kv-cache-memory", "64MiB") as server:
        short = Stream(server, max_tokens=60, prompt="Short")  # finishes within the timeout
        endless = Stream(server, max_tokens=16000, prompt="Long")  # cannot: it is aborted
        assert short.first_event.wait(60) and endless.first_event.wait(60)
        assert short.status == endless.status == 200
        server.terminate()
        # Still listening while draining: newcomers get a 503 with Retry-After, /health says so.
        for _ in range(100):
            health = httpx.get(server.url + "/health", timeout=10)
            if health.status_code == 503:
                break
        assert health.json() == {"status": "draining"}
        refused = httpx.post(
            server.url + "/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=10
        )
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert refused.json()["error"]["code"] == "shutting_down"
        short.join()
        endless.join()
        assert short.finish_reasons == ["length"]
        assert short.events[-2]["usage"]["completion_tokens"] == 60
        assert short.events[-1] == "[DONE]"
        assert endless.events[-2]["error"]["code"] == "aborted"
        assert endless.events[-1] == "[DONE]"
        assert server.process.wait(timeout=60) == 0
