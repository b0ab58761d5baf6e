"""The Batch API on a real ``pagedserve serve`` process, through the official openai client: a
server killed mid-batch and started again finishes the batch with no line lost or answered
twice; and a 500-line file gives the same (greedy) answers through the Batch API as through
``pagedserve run-batch``, with one error line per malformed line."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import time

import httpx
import openai
import pytest

from pagedserve.server.testing import batch_line, greedy_requests, live_server, wait_for_batch

pytestmark = pytest.mark.slow
MODEL = "tiny"
SERVE = ["--served-model-name", MODEL, "--max-model-len", "256", "--num-gpu-blocks-override", "256"]


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def upload(client: openai.OpenAI, lines: list[str]):
    data = io.BytesIO(("\n".join(lines) + "\n").encode())
    return client.files.create(file=("batch.jsonl", data), purpose="batch")


def records(client: openai.OpenAI, *file_ids: str | None) -> list[dict]:
    lines = []
    for file_id in file_ids:
        if file_id is not None:
            lines += client.files.content(file_id).text.splitlines()
    return [json.loads(line) for line in lines]


def requests_served(server) -> int:
    """Requests the server's engine finished (all finish reasons)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    found = re.findall(r"^pagedserve:request_success_total\{[^}]*\} (\S+)$", text, re.MULTILINE)
    return int(sum(float(value) for value in found))


def test_a_server_killed_mid_batch_finishes_it_after_a_restart(tiny_path, tmp_path):
    store = str(tmp_path / "store")
    args = [*SERVE, "--batch-store", store, "--max-num-seqs", "4", "--batch-max-seq-share", "0.5"]
    body = {"model": MODEL, "max_tokens": 64, "ignore_eos": True, "temperature": 0}
    lines = [
        batch_line(f"k{i}", "/v1/completions", {**body, "prompt": f"story {i}"}) for i in range(60)
    ]
    with live_server(tiny_path, *args) as first:
        client = client_of(first)
        batch = client.batches.create(
            input_file_id=upload(client, lines).id,
            endpoint="/v1/completions",
            completion_window="24h",
        )
        while (seen := client.batches.retrieve(batch.id).request_counts.completed) < 6:
            time.sleep(0.05)
        first.process.kill()  # SIGKILL: no drain, no shutdown, the answers in flight lost
        first.process.wait(timeout=30)
    assert seen < 60, "the batch finished before the kill: make its lines longer"
    with live_server(tiny_path, *args) as second:
        client = client_of(second)
        done = wait_for_batch(client, batch.id, timeout=300)
        assert done.status == "completed"
        assert (done.request_counts.completed, done.request_counts.failed) == (60, 0)
        answers = records(client, done.output_file_id, done.error_file_id)
        rerun = requests_served(second)
    ids = [record["custom_id"] for record in answers]
    assert sorted(ids) == sorted(f"k{i}" for i in range(60))  # each line once, none lost
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == 64 for r in answers)
    assert rerun <= 60 - seen  # resumed where it stopped, not started over


def mixed_lines(count: int) -> list[str]:
    """``count`` lines: greedy completion and chat requests in turn, every 25th malformed in
    one of five ways."""
    broken = [
        "{this is not JSON",
        json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}),
        json.dumps({"custom_id": "get", "method": "GET", "url": "/v1/completions", "body": {}}),
        batch_line("nowhere", "/v1/nowhere", {"prompt": "x"}),
        batch_line("streamed", "/v1/chat/completions", {"model": MODEL, "stream": True}),
    ]
    lines = greedy_requests(count, MODEL, max_tokens=3)
    for i in range(24, count, 25):
        lines[i] = broken[(i // 25) % len(broken)]
    return lines


def answer_text(record: dict) -> tuple:
    """What a greedy answer says: its text and why it ended, and its token counts."""
    body = record["response"]["body"]
    choice = body["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return (
        text,
        choice["finish_reason"],
        body["usage"]["prompt_tokens"],
        body["usage"]["completion_tokens"],
    )


def split(answers: list[dict]) -> tuple[dict[str, tuple], list[str]]:
    """(greedy answers by custom_id, the error codes of the malformed lines, sorted)."""
    good = {r["custom_id"]: answer_text(r) for r in answers if r["error"] is None}
    return good, sorted(r["error"]["code"] for r in answers if r["error"] is not None)


def test_a_500_line_file_answers_the_same_through_run_batch_and_the_batch_api(tiny_path, tmp_path):
    lines = mixed_lines(500)
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    command = [sys.executable, "-m", "pagedserve.server.cli", "run-batch", tiny_path, *SERVE]
    command += ["-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    offline = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    # The Batch API runs one endpoint per batch (OpenAI's rule): the completion lines in one,
    # the chat lines and the malformed ones in the other.
    completions = [
        line for line in lines if '"url": "/v1/completions"' in line and '"GET"' not in line
    ]
    rest = [line for line in lines if line not in completions]
    with live_server(tiny_path, *SERVE, "--batch-store", str(tmp_path / "store")) as server:
        client = client_of(server)
        online = []
        for endpoint, part in (("/v1/completions", completions), ("/v1/chat/completions", rest)):
            batch = client.batches.create(
                input_file_id=upload(client, part).id, endpoint=endpoint, completion_window="24h"
            )
            batch = wait_for_batch(client, batch.id, timeout=600)
            assert batch.status == "completed" and batch.request_counts.total == len(part)
            online += records(client, batch.output_file_id, batch.error_file_id)
    assert len(offline) == len(online) == 500
    offline_answers, offline_errors = split(offline)
    online_answers, online_errors = split(online)
    assert len(offline_answers) == 480 and offline_errors == online_errors
    kinds = ["invalid_json", "missing_custom_id", "invalid_method", "invalid_url", "invalid_body"]
    assert offline_errors == sorted(kinds * 4)
    assert offline_answers == online_answers
