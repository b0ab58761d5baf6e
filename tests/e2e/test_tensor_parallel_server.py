"""``pagedserve serve --tensor-parallel-size 2`` (and ``--pipeline-parallel-size 2``): a real
server whose engine holds rank 0 and starts one worker process; the official openai client gets
the single-process greedy answers, and when the server stops (SIGTERM) its worker goes with it;
when the worker dies, the engine is dead and the server says so with 503s."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from pagedserve.engine import LLM, SamplingParams
from pagedserve.server.testing import live_server

pytestmark = pytest.mark.slow  # a server and a worker process: ~15 s

NAME = "tiny-tp"
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Explain paged attention."}]
ENGINE_ARGS = dict(max_model_len=512, kv_cache_memory=4 << 20)


def _worker_pids(parent: int) -> list[int]:
    """Processes whose parent is ``parent`` and whose command line is a pagedserve worker."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and b"pagedserve.engine.distributed.worker" in cmdline:
            pids.append(int(proc.name))
    return pids


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":  # exited, not yet reaped by its (already gone) parent
            return True
        time.sleep(0.1)
    return False


def _one_process_answers(path: str) -> tuple[str, str]:
    """The greedy completion of PROMPT and chat answer to MESSAGES, offline, one process."""
    offline = LLM(model=path, **ENGINE_ARGS)
    greedy = SamplingParams(temperature=0, max_tokens=16)
    completion = offline.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0].text
    return completion, offline.chat(MESSAGES, greedy, use_tqdm=False)[0].outputs[0].text


def _serve_args(parallel_flag: str) -> tuple[str, ...]:
    return (parallel_flag, "2", "--served-model-name", NAME, "--max-model-len", "512",
            "--kv-cache-memory", "4MiB")  # fmt: skip


def _complete(client: openai.OpenAI) -> str:
    completion = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=16, temperature=0)
    return completion.choices[0].text


def test_server_with_two_ranks_answers_the_openai_client(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    expected_completion, expected_chat = _one_process_answers(path)
    with live_server(path, *_serve_args("--tensor-parallel-size")) as server:
        workers = _worker_pids(server.process.pid)
        assert len(workers) == 1, server.log()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        assert _complete(client) == expected_completion
        stream = client.chat.completions.create(
            model=NAME, messages=MESSAGES, max_tokens=16, temperature=0, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == expected_chat
        server.terminate()
        assert server.process.wait(timeout=60) == 0, server.log()
        assert _gone(workers[0], timeout=30), "the worker outlived the server"


def test_server_with_two_stages_answers_and_a_dead_stage_is_a_503(tiny_checkpoint):
    """``--pipeline-parallel-size 2``: the same answers; the first stage's worker killed, the
    request in hand fails, /health says dead (503), and the next request is a 503."""
    path = tiny_checkpoint("llama")
    expected, _ = _one_process_answers(path)
    with live_server(path, *_serve_args("--pipeline-parallel-size")) as server:
        workers = _worker_pids(server.process.pid)
        assert len(workers) == 1, server.log()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        assert _complete(client) == expected
        os.kill(workers[0], signal.SIGKILL)
        assert _gone(workers[0], timeout=30)
        with pytest.raises(openai.APIError):
            _complete(client)
        health = httpx.get(server.url + "/health", timeout=30)
        assert health.status_code == 503 and health.json()["status"] == "dead", health.text
        with pytest.raises(openai.APIStatusError) as refused:
            _complete(client)
        assert refused.value.status_code == 503
