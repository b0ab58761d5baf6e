"""Serving: the OpenAI-compatible server, the openai client, and /metrics.

Everything so far ran inside one Python process. A deployment runs `pagedserve serve`: an HTTP
server (Starlette under uvicorn) that speaks the OpenAI API, so any OpenAI client works against
it unchanged. Behind it, AsyncLLM runs the engine's step loop in the background; every request
becomes an async stream of text deltas, sent as server-sent events when the client streams. This
lesson starts the server on SmolLM2-135M-Instruct, talks to it with the official openai client —
a completion, a streamed chat, n=2 samples of one prompt — and reads the Prometheus metrics the
server exports. The server is always stopped at the end.
"""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
from openai import OpenAI

from pagedserve.models.default_model import ensure_default_model

# ## 1. Start the server
#
# This is what `pagedserve serve` (or `make serve`) does; we pick a free port on 127.0.0.1 and
# give the server one torch thread, so it and this client share the machine politely. The server
# is ready when GET /health answers 200.

with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
model = str(ensure_default_model())
command = [sys.executable, "-m", "pagedserve.server.cli", "serve", model, "--port", str(port)]
command += ["--served-model-name", "smollm2", "--log-level", "warning", "--max-model-len", "1024"]
env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
base_url = f"http://127.0.0.1:{port}"
print(f"== 1. pagedserve serve {os.path.basename(model)} --port {port} ==")


def wait_until_healthy(timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited: {server.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("the server did not become healthy")


try:
    start = time.perf_counter()
    wait_until_healthy()
    print(f"  healthy after {time.perf_counter() - start:.1f} s")

    # ## 2. Talk to it with the openai client
    #
    # The client needs only the base URL (and an API key, which our server ignores unless it was
    # started with --api-key). models.list() shows the served name; a completion continues text;
    # a chat completion goes through the model's chat template; stream=True delivers the reply
    # delta by delta, as the engine produces tokens.

    client = OpenAI(base_url=f"{base_url}/v1", api_key="not-needed")
    print(f"\n== 2. The OpenAI API ==\n  models: {[m.id for m in client.models.list().data]}")

    completion = client.completions.create(
        model="smollm2", prompt="The three primary colors are", max_tokens=12, temperature=0
    )
    print(
        f"  completion: {completion.choices[0].text!r} ({completion.usage.completion_tokens} tokens)"
    )

    print("  streamed chat: ", end="", flush=True)
    stream = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "In one sentence, what is a KV cache?"}],
        max_tokens=40,
        temperature=0,
        stream=True,
    )
    chunks = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            chunks += 1
            print(chunk.choices[0].delta.content, end="", flush=True)
    print(f"\n  ({chunks} streamed deltas)")

    # n=2 asks for two samples of the same prompt; the engine reads the prompt once and the two
    # sequences share its KV blocks (lesson 04). A seed makes the samples reproducible.
    samples = client.completions.create(
        model="smollm2",
        prompt="A good name for a cat is",
        max_tokens=6,
        n=2,
        temperature=1.0,
        seed=3,
    )
    print(f"  n=2 samples: {[c.text for c in samples.choices]}")

    # Bad input is refused with a 400 and a message that says what is wrong, in OpenAI's format.
    response = httpx.post(
        f"{base_url}/v1/completions", json={"model": "smollm2", "prompt": "hi", "temperature": -1}
    )
    print(f"  temperature=-1 -> HTTP {response.status_code}: {response.json()['error']['message']}")

    # ## 3. Read /metrics
    #
    # The server exports Prometheus metrics with vLLM's names under a pagedserve: prefix: requests
    # running and waiting, KV cache usage, prefix-cache queries and hits, preemptions, token
    # counters, and histograms of time to first token, time per output token and end-to-end
    # latency. A Prometheus server scrapes this page; here we just read a few lines.

    metrics = httpx.get(f"{base_url}/metrics").text
    wanted = (
        "pagedserve:num_requests_running",
        "pagedserve:kv_cache_usage_perc",
        "pagedserve:prompt_tokens_total",
        "pagedserve:generation_tokens_total",
        "pagedserve:prefix_cache_hits_total",
        "pagedserve:time_to_first_token_seconds_count",
        "pagedserve:time_to_first_token_seconds_sum",
        "pagedserve:request_success_total",
    )
    print("\n== 3. /metrics (a few of its series) ==")
    for line in metrics.splitlines():
        if line.startswith(wanted):
            print(f"  {line}")
finally:
    # ## 4. Stop the server
    #
    # SIGTERM starts a graceful drain: new requests get 503, in-flight ones finish, then the
    # process exits 0. We wait for it, and kill it if it does not go.
    server.send_signal(signal.SIGTERM)
    try:
        code = server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
        code = server.wait()
    print(f"\n== 4. Server stopped (exit code {code}) ==")
