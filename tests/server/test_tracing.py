"""OpenTelemetry traces, end to end: a real server (--otlp-traces-endpoint) exports to a real
OTLP/HTTP receiver started here, whose requests are decoded with opentelemetry-proto. A span per
request carries the caller's traceparent, vLLM's attribute names and the events of the request's
life; without the flag nothing of OpenTelemetry is imported."""

from __future__ import annotations

import gzip
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from pagedserve.server.config import ServerConfig
from pagedserve.server.testing import live_server

trace_service_pb2 = pytest.importorskip(
    "opentelemetry.proto.collector.trace.v1.trace_service_pb2",
    reason="opentelemetry-proto is not installed",
)

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_SPAN_ID = "b7ad6b7169203331"
SERVER_KIND = 2  # opentelemetry.proto.trace.v1.Span.SPAN_KIND_SERVER


class Receiver(ThreadingHTTPServer):
    """An OTLP/HTTP trace receiver on a free port: keeps every span posted to /v1/traces."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), ReceiverHandler)
        self.spans: list = []
        self.paths: list[str] = []
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def wait_for(self, count: int, timeout: float = 30.0) -> list:
        deadline = time.monotonic() + timeout
        while len(self.spans) < count and time.monotonic() < deadline:
            time.sleep(0.05)
        return list(self.spans)


class ReceiverHandler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
        self.server.paths.append(self.path)
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                self.server.spans.extend(scope_spans.spans)
        answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args) -> None:
        pass


def attributes(span) -> dict:
    values = {}
    for attribute in span.attributes:
        value = attribute.value
        kind = value.WhichOneof("value")
        if kind == "array_value":
            values[attribute.key] = [v.string_value for v in value.array_value.values]
        else:
            values[attribute.key] = getattr(value, kind)
    return values


@pytest.fixture(scope="module")
def traced(tiny_path):
    receiver = Receiver()
    env = {"OTEL_BSP_SCHEDULE_DELAY": "100"}  # export within 0.1 s, not 5
    args = ("--max-model-len", "256", "--otlp-traces-endpoint", receiver.url)
    with live_server(tiny_path, *args, env=env) as server:
        yield server, receiver
    receiver.shutdown()


def test_a_request_span_carries_the_callers_trace_and_vllms_attributes(traced):
    server, receiver = traced
    before = len(receiver.spans)
    started_ns = time.time_ns()
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0}
    traceparent = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"
    answer = httpx.post(
        server.url + "/v1/chat/completions", json=body, headers={"traceparent": traceparent}
    ).json()
    (span,) = receiver.wait_for(before + 1)[before:]
    assert receiver.paths[-1] == "/v1/traces"  # the collector's address, the standard path added
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_SPAN_ID
    assert span.name == "llm_request" and span.kind == SERVER_KIND
    found = attributes(span)
    # the engine request's id: the server's own (not the response's id), and the prompt's index
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}-0", found["gen_ai.request.id"])
    assert found["gen_ai.response.model"] == answer["model"]
    assert found["gen_ai.usage.prompt_tokens"] == answer["usage"]["prompt_tokens"]
    assert found["gen_ai.usage.completion_tokens"] == answer["usage"]["completion_tokens"] == 5
    assert found["gen_ai.request.max_tokens"] == 5 and found["gen_ai.request.temperature"] == 0
    assert found["gen_ai.response.finish_reasons"] == ["length"]
    queue, ttft, e2e = (
        found[f"gen_ai.latency.{n}"] for n in ("time_in_queue", "time_to_first_token", "e2e")
    )
    assert 0 <= queue <= ttft <= e2e < 30
    events = {event.name: event.time_unix_nano for event in span.events}
    assert list(events) == ["scheduled", "first_token", "finished"]
    assert started_ns <= span.start_time_unix_nano <= events["scheduled"] <= events["first_token"]
    assert events["first_token"] <= events["finished"] == span.end_time_unix_nano <= time.time_ns()
    assert abs((span.end_time_unix_nano - span.start_time_unix_nano) / 1e9 - e2e) < 1e-3


def test_a_streamed_request_without_a_traceparent_starts_its_own_trace(traced):
    server, receiver = traced
    before = len(receiver.spans)
    body = {"prompt": "Once upon", "max_tokens": 7, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as response:
        assert response.status_code == 200
        response.read()
    (span,) = receiver.wait_for(before + 1)[before:]
    assert span.parent_span_id == b"" and span.trace_id.hex() != TRACE_ID
    assert attributes(span)["gen_ai.usage.completion_tokens"] == 7  # the deltas, added up


def test_without_the_flag_nothing_of_opentelemetry_is_imported(tiny_path):
    script = f"""
import sys
from starlette.testclient import TestClient
from pagedserve.server.app import build_app
from pagedserve.server.config import ServerConfig
from pagedserve.server.testing import make_engine
engine = make_engine({tiny_path!r})
client = TestClient(build_app(engine, ServerConfig(), "m"))
answer = client.post("/v1/completions", json={{"prompt": "Hi", "max_tokens": 2}})
assert answer.status_code == 200, answer.text
print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_the_endpoint_is_an_otlp_http_url(monkeypatch):
    assert (
        ServerConfig(otlp_traces_endpoint="http://c:4318").otlp_traces_endpoint
        == "http://c:4318/v1/traces"
    )
    kept = "https://c/otlp/v1/traces"
    assert ServerConfig(otlp_traces_endpoint=kept).otlp_traces_endpoint == kept
    with pytest.raises(ValueError, match="not gRPC"):
        ServerConfig(otlp_traces_endpoint="grpc://c:4317")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc"):
        ServerConfig(otlp_traces_endpoint="http://c:4318")
