"""OpenAI's Files and Batch APIs through the official openai client, in process (the app's
lifespan runs, so its batch worker does): files in and out, OpenAI's objects and statuses,
request_counts, output and error files, cancelling, expiring; batch requests at the batch
priority, never more of them in the engine than their share of the sequences."""

from __future__ import annotations

import asyncio
import io
import json

import openai
import pytest
from starlette.testclient import TestClient

from pagedserve.server.app import build_app
from pagedserve.server.batch_runner import LineRunner, SequenceBudget, served_post_paths
from pagedserve.server.batch_store import BatchStore
from pagedserve.server.batch_worker import BatchWorker
from pagedserve.server.config import BATCH_PRIORITY, ServerConfig
from pagedserve.server.testing import TINY_MODEL_NAME as MODEL
from pagedserve.server.testing import batch_line, make_engine, wait_for_batch

CHAT = "/v1/chat/completions"


def chat_line(custom_id: str, content: str = "hi", **fields) -> str:
    messages = [{"role": "user", "content": content}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 3, "temperature": 0, **fields}
    return batch_line(custom_id, CHAT, body)


class RecordingEngine:
    """The engine, as the server sees it, recording each request's priority and how many
    requests of the batch priority run at once."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.priorities: dict[str, int] = {}
        self.batch_running = self.most_batch_running = 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    async def generate(
        self, prompt_token_ids, sampling_params, request_id, prompt=None, priority=0, **kw
    ):
        self.priorities[request_id] = priority
        batch = priority == BATCH_PRIORITY
        if batch:
            self.batch_running += sampling_params.n
            self.most_batch_running = max(self.most_batch_running, self.batch_running)
        try:
            async for output in self.engine.generate(
                prompt_token_ids, sampling_params, request_id, prompt, priority, **kw
            ):
                yield output
        finally:
            if batch:
                self.batch_running -= sampling_params.n


@pytest.fixture(scope="module")
def served(tiny_path, tmp_path_factory):
    """(the recording engine, an openai client) of an app whose lifespan runs for the module
    (it shuts its own engine down at the end); batch requests may hold 4 of 16 sequences."""
    engine = RecordingEngine(make_engine(tiny_path, scheduling_policy="priority"))
    store = tmp_path_factory.mktemp("batch-store")
    config = ServerConfig(batch_store=str(store), batch_max_seq_share=0.25)
    with TestClient(build_app(engine, config, MODEL)) as http:
        yield engine, openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http)


def upload(client: openai.OpenAI, lines: list[str], name: str = "requests.jsonl"):
    return client.files.create(file=(name, io.BytesIO("\n".join(lines).encode())), purpose="batch")


def results(client: openai.OpenAI, file_id: str | None) -> dict[str, dict]:
    if file_id is None:
        return {}
    records = [json.loads(line) for line in client.files.content(file_id).text.splitlines()]
    return {f"line {r['error']['line']}" if r["error"] else r["custom_id"]: r for r in records}


def test_a_batch_runs_to_completed_with_its_output_and_error_files(served):
    engine, client = served
    lines = [chat_line(f"q{i}", f"question {i}") for i in range(12)]
    lines += ["this is not JSON", chat_line("q0", "again"), chat_line("empty", messages=[])]
    file = upload(client, lines)
    assert (file.purpose, file.bytes, file.filename) == (
        "batch",
        len("\n".join(lines)),
        "requests.jsonl",
    )
    assert client.files.retrieve(file.id).id == file.id
    created = client.batches.create(
        input_file_id=file.id, endpoint=CHAT, completion_window="24h", metadata={"job": "t1"}
    )
    assert created.status == "validating" and created.metadata == {"job": "t1"}
    batch = wait_for_batch(client, created.id)
    assert batch.status == "completed"
    assert (
        batch.request_counts.total,
        batch.request_counts.completed,
        batch.request_counts.failed,
    ) == (15, 12, 3)
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    outputs, errors = results(client, batch.output_file_id), results(client, batch.error_file_id)
    assert set(outputs) == {f"q{i}" for i in range(12)}
    for record in outputs.values():
        assert record["response"]["status_code"] == 200 and record["error"] is None
        assert record["response"]["body"]["usage"]["completion_tokens"] == 3
    assert errors["line 13"]["error"]["code"] == "invalid_json"
    assert errors["line 14"]["error"]["code"] == "duplicate_custom_id"
    assert errors["empty"]["response"]["status_code"] == 400  # the route's own 400, as over HTTP
    assert errors["empty"]["response"]["body"]["error"]["param"] == "messages"
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"
    assert batch.id in [b.id for b in client.batches.list()]


def test_batch_requests_run_at_the_batch_priority_and_keep_to_their_share(served):
    engine, client = served
    file = upload(client, [chat_line(f"p{i}", n=1 + i % 2) for i in range(24)])
    batch = client.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h")
    interactive = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "now"}], max_tokens=2
    )
    assert wait_for_batch(client, batch.id).status == "completed"
    assert engine.most_batch_running == 4  # 0.25 of max_num_seqs 16: filled, never passed
    batch_ids = [rid for rid, p in engine.priorities.items() if p == BATCH_PRIORITY]
    assert len(batch_ids) >= 24
    # the one request of this module's that is not a batch line's ran at the default priority
    # (the engine's request ids are the server's own, not the response's id)
    others = [p for p in engine.priorities.values() if p != BATCH_PRIORITY]
    assert interactive.choices and others == [0]


def test_a_cancelled_batch_keeps_its_answers_so_far(served):
    _, client = served
    file = upload(client, [chat_line(f"c{i}", max_tokens=40, ignore_eos=True) for i in range(40)])
    batch = client.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h")
    wait_for_batch(client, batch.id, until=("in_progress",))
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    batch = wait_for_batch(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at
    answered = results(client, batch.output_file_id)
    assert len(answered) == batch.request_counts.completed < 40
    with pytest.raises(openai.ConflictError, match="cancelled cannot be cancelled"):
        client.batches.cancel(batch.id)


def test_what_the_batch_api_refuses(served):
    _, client = served
    text = io.BytesIO(b"{}")
    with pytest.raises(openai.BadRequestError, match="purpose must be 'batch'"):
        client.files.create(file=("x.jsonl", text), purpose="fine-tune")
    with pytest.raises(openai.NotFoundError, match="No such File object"):
        client.files.retrieve("file-nothing")
    with pytest.raises(openai.BadRequestError, match="no such file"):
        client.batches.create(input_file_id="file-nothing", endpoint=CHAT, completion_window="24h")
    file = upload(client, [chat_line("a")])
    with pytest.raises(openai.BadRequestError, match="does not serve /v1/embeddings"):
        client.batches.create(
            input_file_id=file.id, endpoint="/v1/embeddings", completion_window="24h"
        )
    with pytest.raises(openai.BadRequestError, match="output_expires_after"):
        client.batches.create(
            input_file_id=file.id,
            endpoint=CHAT,
            completion_window="24h",
            extra_body={"output_expires_after": {"anchor": "created_at", "seconds": 3600}},
        )
    with pytest.raises(openai.NotFoundError, match="No batch found"):
        client.batches.retrieve("batch_nothing")
    empty = upload(client, ["", "  "])
    failed = wait_for_batch(
        client,
        client.batches.create(input_file_id=empty.id, endpoint=CHAT, completion_window="24h").id,
    )
    assert failed.status == "failed" and failed.errors.data[0].code == "empty_file"


def test_a_file_goes_once_no_batch_needs_it(served):
    _, client = served
    file = upload(client, [chat_line("a")])
    assert file.id in [f.id for f in client.files.list(purpose="batch")]
    assert client.files.delete(file.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.content(file.id)


def test_a_batch_past_its_window_expires_with_an_error_line_per_request_not_run(
    tiny_path, tmp_path
):
    """The clock jumps 25 hours on once two lines are answered: those stay, every line not
    answered by then gets OpenAI's batch_expired error line."""
    engine = make_engine(tiny_path)
    app = build_app(engine, ServerConfig(), MODEL)
    lines = [chat_line(f"x{i}", max_tokens=200, ignore_eos=True) for i in range(30)]
    start = 1_000_000

    async def run() -> tuple[dict, list[dict]]:
        store = BatchStore.open(tmp_path)
        batch_id = ""

        def clock() -> float:
            answered = store.answer_counts(batch_id)[0] if batch_id else 0
            return start + (25 * 3600 if answered >= 2 else 0)

        runner = LineRunner(app)
        served = served_post_paths(app)
        worker = BatchWorker(store, runner, SequenceBudget(2), served, clock, expiry_check_s=0.01)
        file = store.add_file(io.BytesIO("\n".join(lines).encode()), "x.jsonl", "batch", 0)
        batch_id = worker.create(file["id"], CHAT, "24h", None)["id"]
        await worker.wait(batch_id)
        batch = store.get_batch(batch_id)
        errors = [json.loads(line) for line in store.read_lines(batch["error_file_id"])]
        await runner.aclose()
        store.close()
        return batch, errors

    try:
        batch, errors = asyncio.run(run())
    finally:
        asyncio.run(engine.shutdown())
    assert batch["status"] == "expired" and batch["expired_at"] == start + 25 * 3600
    counts = batch["request_counts"]
    assert counts["total"] == 30 and 2 <= counts["completed"] < 30
    assert counts["completed"] + counts["failed"] == 30 == counts["completed"] + len(errors)
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}


def test_a_server_with_an_api_key_runs_its_batch_lines_with_it(tiny_path, tmp_path):
    """The lines go through the app's gate like any request: with the server's key."""
    config = ServerConfig(batch_store=str(tmp_path), api_key="sk-batch")
    with TestClient(build_app(make_engine(tiny_path), config, MODEL)) as http:
        client = openai.OpenAI(
            base_url="http://testserver/v1", api_key="sk-batch", http_client=http
        )
        file = upload(client, [chat_line("k0"), chat_line("k1")])
        batch = client.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h")
        batch = wait_for_batch(client, batch.id)
        assert (batch.request_counts.completed, batch.request_counts.failed) == (2, 0)
        outsider = openai.OpenAI(base_url="http://testserver/v1", api_key="wrong", http_client=http)
        with pytest.raises(openai.AuthenticationError):
            outsider.batches.retrieve(batch.id)
