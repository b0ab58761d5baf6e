"""A real ``pagedserve serve`` in a subprocess on a free 127.0.0.1 port, for end-to-end tests.

The server runs with one torch thread, so that it and the test's client share two cores; it is
always killed when the ``with`` block ends, however the test went.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import httpx

STARTUP_TIMEOUT_S = 180.0


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
