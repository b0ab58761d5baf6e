"""A `vllm serve` command line, run as `pagedserve serve` on the default model (SmolLM2-135M-
Instruct), serves what vLLM's would: the flags vLLM users pass are implemented or accepted,
vLLM's metric names and routes answer, and a stream ends with its usage."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from pagedserve.server.testing import live_server

MODEL = "SmolLM2-135M-Instruct"
VLLM_COMMAND_LINE = [
    "--max-model-len", "1024",
    "--uvicorn-log-level", "info",
    "--disable-uvicorn-access-log",
    "--trust-remote-code",
    "--disable-log-requests",
    "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    "--enable-force-include-usage",
    "--return-tokens-as-token-ids",
    "--enable-server-load-tracking",
    "--show-hidden-metrics-for-version", "0.10",
    "--metrics-prefix", "vllm",
    "-tp", "1",
]  # fmt: skip
ACCESS_LINE = re.compile(r'"GET /health HTTP/1\.1" 200')


@pytest.mark.slow
def test_a_vllm_command_line_serves_as_vllm_does(tiny_checkpoint):
    with live_server(None, *VLLM_COMMAND_LINE) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        chunks = list(
            client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=8, logprobs=True, stream=True
            )
        )
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
        tokens = [t.token for c in chunks if c.choices and c.choices[0].logprobs
                  for t in c.choices[0].logprobs.content]  # fmt: skip
        assert len(tokens) == 8 and all(t.startswith("token_id:") for t in tokens)
        assert httpx.get(server.url + "/load").json() == {"server_load": 0}
        batch = httpx.post(
            server.url + "/v1/chat/completions/batch",
            json={"model": MODEL, "messages": [messages, messages], "max_tokens": 4},
            timeout=60,
        ).json()
        assert [c["index"] for c in batch["choices"]] == [0, 1]
        metrics = httpx.get(server.url + "/metrics").text
        assert f'vllm:request_success_total{{finished_reason="length",model_name="{MODEL}"}}' in (
            metrics
        )
        assert "pagedserve:" not in metrics
        log = server.log()
    assert not ACCESS_LINE.search(log)  # /health was polled until the server was up
    # the control: at the same log level, without the flag, uvicorn logs each request
    with live_server(tiny_checkpoint("llama"), "--log-level", "info") as control:
        log = control.log()
    assert ACCESS_LINE.search(log)
