"""Two "hosts" on this machine: network namespaces joined by a veth link, each with its own
loopback and one address (10.77.0.1 and 10.77.0.2), reaching each other only over the link.

- The plain case: the engine (rank 0, the last pipeline stage) runs in one host; the first
  stage's worker is started by hand in the other (``RANK=1 ... python -m
  pagedserve.engine.distributed.worker``), with nothing but the rendezvous address in common.
  Neither sets ``GLOO_SOCKET_IFNAME``: the ranks find the interface that reaches the other host.
- Ray: a Ray head with no CPU in one host, a Ray worker node with two in the other; the engine,
  on the head's host, places its second rank with ``distributed_executor_backend="ray"``, and
  the actor lands on the other host.

Both give the single-process greedy tokens. The namespaces need root (``ip netns``); elsewhere
these tests skip.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pagedserve.engine import LLM, SamplingParams

pytestmark = pytest.mark.slow  # namespaces, a hand-started worker, a two-node Ray cluster

PROMPT = list(range(5, 22))
ENGINE = (
    "from pagedserve.engine import LLM, SamplingParams\n"
    + """
import json, sys, torch
torch.set_num_threads(1)
llm = LLM(model=sys.argv[1], pipeline_parallel_size=2, block_size=8, kv_cache_memory=8 << 20,
          distributed_executor_backend=sys.argv[2])
greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
tokens = llm.generate([{"prompt_token_ids": PROMPT}], greedy, use_tqdm=False)[0].outputs[0]
hosts, status = [], ""
if sys.argv[2] == "ray":
    import subprocess, time, ray
    address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    hosts = [address[node] for node in llm.engine.runner.workers.nodes.values()]
    ray_bin = sys.executable.rsplit("/", 1)[0] + "/ray"
    for _ in range(60):  # the autoscaler's view of usage lags a few seconds
        status = subprocess.run([ray_bin, "status"], capture_output=True, text=True).stdout
        if "placement groups" in status:
            break
        time.sleep(0.5)
llm.engine.runner.shutdown()
print(json.dumps({"tokens": tokens.token_ids, "worker_hosts": hosts, "ray_status": status}))
""".replace("PROMPT", repr(PROMPT))
)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def two_hosts():
    """``(run_in_a, run_in_b)``: Popen in each namespace; both removed afterwards."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    a, b = f"psA{os.getpid()}", f"psB{os.getpid()}"
    try:
        _ip("netns", "add", a)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"ip netns does not work here: {e.stderr.decode().strip()}")
    try:
        _ip("netns", "add", b)
        _ip("link", "add", "veth-ps-a", "type", "veth", "peer", "name", "veth-ps-b")
        for ns, dev, addr in ((a, "veth-ps-a", "10.77.0.1"), (b, "veth-ps-b", "10.77.0.2")):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

        def runner(ns):
            def run(command: list[str], env: dict[str, str], **kwargs) -> subprocess.Popen:
                return subprocess.Popen(
                    ["ip", "netns", "exec", ns, *command], env={**os.environ, **env}, **kwargs
                )

            return run

        yield runner(a), runner(b)
    finally:
        for ns in (a, b):  # the veth pair goes with its namespaces
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _one_process(path: str) -> list[int]:
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(model=path, block_size=8, kv_cache_memory=8 << 20)
    return (
        llm.generate([{"prompt_token_ids": PROMPT}], greedy, use_tqdm=False)[0].outputs[0].token_ids
    )


def _engine(run, path: str, backend: str, env: dict[str, str]) -> dict:
    engine = run(
        [sys.executable, "-c", ENGINE, path, backend], env, stdout=subprocess.PIPE, text=True
    )
    out, _ = engine.communicate(timeout=300)
    assert engine.returncode == 0, out
    return json.loads(out.strip().splitlines()[-1])


def test_two_stages_on_two_hosts_meet_over_the_link(tiny_checkpoint, two_hosts):
    run_a, run_b = two_hosts
    path = tiny_checkpoint("llama")
    meet = {"MASTER_ADDR": "10.77.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "2"}
    module = [sys.executable, "-m", "pagedserve.engine.distributed.worker"]
    worker = run_b(module, {**meet, "RANK": "1", "PAGEDSERVE_TP_THREADS": "1"})
    try:
        result = _engine(run_a, path, "mp", {**meet, "RANK": "0"})
        assert worker.wait(timeout=60) == 0  # stopped by rank 0, cleanly
    finally:
        if worker.poll() is None:
            worker.kill()
    assert result["tokens"] == _one_process(path)


def test_a_ray_worker_node_on_the_other_host_takes_the_first_stage(tiny_checkpoint, two_hosts):
    run_a, run_b = two_hosts
    path = tiny_checkpoint("llama")
    ray_bin = str(Path(sys.executable).with_name("ray"))
    ray_env = {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(16),
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    head = [ray_bin, "start", "--head", "--node-ip-address", "10.77.0.1", "--port", "6390"]
    session = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must be short
    head += ["--num-cpus", "0", "--include-dashboard", "false", "--temp-dir", session]
    node = [ray_bin, "start", "--address", "10.77.0.1:6390", "--node-ip-address", "10.77.0.2"]
    node += ["--num-cpus", "2"]
    try:
        for run, command in ((run_a, head), (run_b, node)):
            started = run(command, ray_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            assert started.wait(timeout=180) == 0, started.stdout.read().decode()
        result = _engine(run_a, path, "ray", {**ray_env, "RAY_ADDRESS": "10.77.0.1:6390"})
    finally:
        for run in (run_b, run_a):
            run([ray_bin, "stop", "--force"], ray_env, stdout=subprocess.DEVNULL).wait(60)
        shutil.rmtree(session, ignore_errors=True)
    assert result["worker_hosts"] == ["10.77.0.2"]
    # Ray's own tool sees the engine's placement group holding the worker's CPU
    assert "1.0/2.0 CPU (1.0 used of 1.0 reserved in placement groups)" in result["ray_status"]
    assert result["tokens"] == _one_process(path)
