"""Helpers for testing the server: a real ``pagedserve serve`` in a subprocess, and a small
in-process engine with probes of its KV cache.

``live_server(model, *args)`` starts the server on a free 127.0.0.1 port with one torch thread
(so that it and the test's client share two cores), waits for /health, and always kills it when
the ``with`` block ends, however the test went.
"""

from __future__ import annotations

import base64
import contextlib
import io
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass

import httpx

from pagedserve.engine import AsyncLLM, EngineArgs

STARTUP_TIMEOUT_S = 180.0
TINY_MODEL_NAME = "tiny-llama"  # the name in-process test apps serve their tiny model under


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class LiveServer:
    process: subprocess.Popen
    port: int
    log_path: str
    api_key: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def metric(self, name: str) -> float:
        """One unlabelled-by-reason series of /metrics (``pagedserve:<name>``)."""
        text = httpx.get(self.url + "/metrics", headers=self.headers, timeout=10).text
        match = re.search(rf"^pagedserve:{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
        assert match, f"pagedserve:{name} not in /metrics"
        return float(match.group(1))

    def terminate(self) -> None:
        self.process.send_signal(signal.SIGTERM)


@contextlib.contextmanager
def live_server(model: str | None, *args: str, api_key: str | None = None, env: dict | None = None):
    port = free_port()
    command = [sys.executable, "-m", "pagedserve.server.cli", "serve"]
    command += ([model] if model else []) + ["--port", str(port), "--log-level", "warning", *args]
    if api_key:
        command += ["--api-key", api_key]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    full_env.update(env or {})
    log = tempfile.NamedTemporaryFile("wb", prefix="pagedserve-serve-", suffix=".log", delete=False)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    server = LiveServer(process, port, log.name, api_key)
    try:
        _wait_healthy(server)
        yield server
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
        log.close()
        os.unlink(log.name)


def _wait_healthy(server: LiveServer) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"the server exited during startup:\n{server.log()}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server did not become healthy:\n{server.log()}")


# ---- in-process ------------------------------------------------------------------------------


@contextlib.contextmanager
def uvicorn_in_thread(app):
    """``app`` served by a real uvicorn (h11, as ``pagedserve serve`` runs it) in a thread of
    this process, on a free port; yields the base URL. For what only a real HTTP connection
    shows (keep-alive, ``Connection: close``), without a subprocess's model load."""
    import threading

    import uvicorn

    port = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, http="h11", lifespan="off", log_level="critical"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def make_engine(path: str, **overrides) -> AsyncLLM:
    """A small AsyncLLM for tests: max_model_len 256, 128 KV blocks, 16 sequences."""
    args = dict(model=path, max_model_len=256, num_gpu_blocks_override=128, max_num_seqs=16)
    args.update(overrides)
    return AsyncLLM(EngineArgs(**args))


def wait_engine_idle(engine: AsyncLLM, timeout: float = 10.0) -> None:
    """Wait until the engine thread has applied every abort (the cut requests are gone)."""
    deadline = time.monotonic() + timeout
    while engine.engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)


def blocks_held(engine: AsyncLLM) -> int:
    """KV blocks held by some sequence (cached-but-free prefix blocks count as free)."""
    manager = engine.engine.kv_cache_manager
    return manager.num_blocks - manager.num_free_blocks


# ---- batch files -------------------------------------------------------------------------------

FINAL_BATCH_STATUSES = ("completed", "failed", "expired", "cancelled")


def batch_line(custom_id: str, url: str, body: dict) -> str:
    """One line of an OpenAI batch file."""
    import json

    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def greedy_requests(count: int, model: str, max_tokens: int) -> list[str]:
    """``count`` batch lines of greedy requests (custom_id ``r<i>``), a completion and a chat
    request in turn."""
    lines = []
    for i in range(count):
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0}
        if i % 2:
            body["messages"] = [{"role": "user", "content": f"Tell me about item {i}"}]
            lines.append(batch_line(f"r{i}", "/v1/chat/completions", body))
        else:
            lines.append(batch_line(f"r{i}", "/v1/completions", {**body, "prompt": f"Item {i} is"}))
    return lines


def wait_for_batch(client, batch_id: str, timeout: float = 120.0, until=FINAL_BATCH_STATUSES):
    """Poll ``client.batches.retrieve`` (the openai client) until the batch's status is one of
    ``until``; the batch."""
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in until:
            return batch
        if time.monotonic() > deadline:
            raise TimeoutError(f"batch {batch_id} is still {batch.status}: {batch}")
        time.sleep(0.1)


def encoded_image(image, fmt: str = "PNG") -> bytes:
    """A PIL image's file bytes in ``fmt``."""
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    """``data`` as a base64 data: URL: what an image_url content part carries."""
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def png_data_url(image) -> str:
    """A PIL image as a PNG data: URL."""
    return data_url(encoded_image(image))


def png_header(width: int, height: int) -> bytes:
    """A PNG that declares ``width`` x ``height`` RGB pixels and holds a few bytes of data (a
    decompression bomb's header: tiny on the wire, huge once decoded)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * 64)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
