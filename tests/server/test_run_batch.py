"""``pagedserve run-batch``: every line of an OpenAI batch file answered once (bad ones with an
error line), the answers those of the server's own routes, a rerun resuming where a killed run
stopped, ``-`` for stdin and stdout."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
from starlette.testclient import TestClient

from pagedserve.server.app import build_app
from pagedserve.server.config import ServerConfig
from pagedserve.server.run_batch import answer_file
from pagedserve.server.testing import TINY_MODEL_NAME as MODEL
from pagedserve.server.testing import batch_line, greedy_requests

ARGS = ["--served-model-name", MODEL, "--max-model-len", "256", "--num-gpu-blocks-override", "128"]


def mixed_file(count: int) -> list[str]:
    """``count`` greedy requests, chat and completions in turn, then three lines that cannot
    run and one the route refuses."""
    lines = greedy_requests(count, MODEL, max_tokens=4)
    lines += [
        "{not json",
        batch_line("emb", "/v1/embeddings", {"model": MODEL, "input": "x"}),
        batch_line("r0", "/v1/completions", {"model": MODEL, "prompt": "again"}),
        batch_line("refused", "/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}),
    ]
    return lines


def by_key(records: list[dict]) -> dict[str, dict]:
    """Output lines by what they answer (an error line by its line number)."""
    keyed = {}
    for r in records:
        key = f"line {r['error']['line']}" if r["error"] else r["custom_id"]
        assert key not in keyed, f"{key} answered twice"
        keyed[key] = r
    return keyed


def check_answers(records: list[dict], count: int) -> None:
    answers = by_key(records)
    assert set(answers) == {f"r{i}" for i in range(count)} | {
        f"line {count + 1}",
        f"line {count + 2}",
        f"line {count + 3}",
        "refused",
    }
    for i in range(count):
        response = answers[f"r{i}"]["response"]
        assert (
            response["status_code"] == 200 and response["body"]["usage"]["completion_tokens"] == 4
        )
        assert response["request_id"] == response["body"]["id"]
    codes = [answers[f"line {count + k}"]["error"]["code"] for k in (1, 2, 3)]
    assert codes == ["invalid_json", "unsupported_url", "duplicate_custom_id"]
    assert answers["refused"]["response"]["status_code"] == 400


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pagedserve.server.cli", "run-batch", *args, *ARGS]
    return subprocess.run(command, input=stdin, capture_output=True, text=True, timeout=300)


def test_the_command_answers_every_line_of_a_file(tiny_path, tmp_path):
    (tmp_path / "in.jsonl").write_text("\n".join(mixed_file(10)) + "\n")
    done = run_cli("-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), tiny_path)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    check_answers(records, 10)
    assert "14 lines: 10 answered, 4 failed, 0 answered by an earlier run" in done.stderr
    assert "tok/s" in done.stderr  # the progress bar's rate


def test_the_command_reads_stdin_and_writes_stdout(tiny_path):
    done = run_cli("-i", "-", "-o", "-", tiny_path, stdin="\n".join(mixed_file(4)))
    assert done.returncode == 0, done.stderr
    check_answers([json.loads(line) for line in done.stdout.splitlines()], 4)


def test_a_rerun_answers_only_what_a_killed_run_left(engine, tmp_path):
    """A first run's output cut after some answers and half a line (as a kill leaves it): the
    rerun answers the rest, and the whole is every line once. The answers are the routes' own."""
    app = build_app(engine, ServerConfig(), MODEL)
    lines, output = mixed_file(12), tmp_path / "out.jsonl"
    first = asyncio.run(answer_file(app, lines, str(output), capacity=4))
    assert (first["succeeded"], first["failed"], first["skipped"]) == (12, 4, 0)
    whole = output.read_text().splitlines()
    output.write_text("\n".join(whole[:7]) + "\n" + whole[7][:30])
    again = asyncio.run(answer_file(app, lines, str(output), capacity=4))
    assert again["skipped"] == 7 and again["succeeded"] + again["failed"] == 9
    records = [json.loads(line) for line in output.read_text().splitlines()]
    check_answers(records, 12)
    # the same request sent to the route answers the same (greedy)
    first_chat = by_key(records)["r1"]["response"]["body"]["choices"][0]["message"]["content"]
    direct = TestClient(app).post("/v1/chat/completions", json=json.loads(lines[1])["body"]).json()
    assert direct["choices"][0]["message"]["content"] == first_chat


@pytest.mark.parametrize("flag", ["--host", "--api-key", "--batch-store"])
def test_the_server_options_of_listening_are_not_taken(flag, capsys):
    from pagedserve.server.cli import main

    with pytest.raises(SystemExit):
        main(["run-batch", "-i", "x", "-o", "y", flag, "v"])
    assert f"unrecognized arguments: {flag}" in capsys.readouterr().err
