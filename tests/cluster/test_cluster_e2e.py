"""The cluster end to end, on a two-node Ray cluster started by this module (one for all its
tests): SmolLM2 with two replicas on the head node, a tiny random Llama (autoscaled, 1 to 2
replicas) pinned to the second node, one ingress. The official openai client talks to Ray
Serve's HTTP proxy as a user would.

The tests run in file order and share the deployment: parity and shapes first, then the
routing comparison, then the disruptive ones (a redeploy adding a model, a killed replica,
autoscaling), which are marked slow.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time

import httpx
import pytest

pytest.importorskip("ray.serve")

import openai  # noqa: E402
import ray  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from ray import serve  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from pagedserve.cluster.config import load_config  # noqa: E402
from pagedserve.cluster.deploy import DeployTimeoutError, deploy  # noqa: E402
from pagedserve.cluster.placement import replicas  # noqa: E402
from pagedserve.engine import AsyncLLM, EngineArgs  # noqa: E402
from pagedserve.models.testing_multimodal import (  # noqa: E402
    make_tiny_llava_checkpoint,
    tiny_test_images,
    transformers_llava_greedy,
)
from pagedserve.server.app import build_app  # noqa: E402
from pagedserve.server.config import ServerConfig  # noqa: E402
from pagedserve.server.testing import free_port, png_data_url  # noqa: E402

SMOL_ENGINE = {"max_model_len": 512, "num_gpu_blocks_override": 160, "max_num_seqs": 2}
TINY_ENGINE = {"max_model_len": 256, "num_gpu_blocks_override": 96}
TINY_AUTOSCALING = {
    "min_replicas": 1,
    "max_replicas": 2,
    "target_ongoing_requests": 1,
    "upscale_delay_s": 1.0,
    "downscale_delay_s": 3.0,
    "metrics_interval_s": 0.5,
    "look_back_period_s": 1.0,
}


def cluster_config(port: int, smol: str, tiny: str, smol_routing="prefix", extra=()) -> dict:
    return {
        "port": port,
        "models": [
            {
                "name": "smollm2",
                "engine": {"model": smol, **SMOL_ENGINE},
                "num_replicas": 2,
                "num_cpus": 1,
                "routing": smol_routing,
                "busy_threshold": 3,
            },
            {
                "name": "tiny",
                "engine": {"model": tiny, **TINY_ENGINE},
                "autoscaling": TINY_AUTOSCALING,
                "num_cpus": 0.5,
                "resources": {"node2": 1},
            },
            *extra,
        ],
    }


@pytest.fixture(scope="module")
def paths(default_model_path, tiny_checkpoint):
    return {"smollm2": default_model_path, "tiny": tiny_checkpoint("llama")}


@pytest.fixture(scope="module")
def cluster(paths):
    """Two Ray nodes on this machine, the config deployed; everything stopped afterwards."""
    # Ray's memory monitor kills the newest workers when the *machine* is nearly full, whoever
    # fills it; on a shared test machine that would be our replicas, mid-test.
    os.environ["RAY_memory_monitor_refresh_ms"] = "0"
    ray_cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 4, "include_dashboard": False}
    )
    ray_cluster.add_node(num_cpus=2, resources={"node2": 2})
    port = free_port()
    try:
        ray.init(address=ray_cluster.address, log_to_driver=False)
        deploy(load_config(cluster_config(port, paths["smollm2"], paths["tiny"])), timeout_s=600)
        yield {"port": port, "url": f"http://127.0.0.1:{port}", "ray": ray_cluster}
    finally:
        serve.shutdown()
        ray.shutdown()
        ray_cluster.shutdown()
        os.environ.pop("RAY_memory_monitor_refresh_ms", None)


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(
        base_url=cluster["url"] + "/v1", api_key="unused", max_retries=0, timeout=300
    )


def replica_stats(app: str) -> list:
    handle = serve.get_deployment_handle("engine", app)
    return handle.broadcast("stats", False).results(timeout_s=30)


def running_replicas(app: str) -> int:
    deployment = serve.status().applications[app].deployments["engine"]
    return deployment.replica_states.get("RUNNING", 0)


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"not within {timeout_s:.0f}s: {what}")


# ---- the same text as one engine alone --------------------------------------------------------


def reference_answers(path: str, engine_args: dict, bodies: list[tuple[str, dict]]) -> list[dict]:
    """What `pagedserve serve` of this model alone answers (its app in-process, no Ray)."""
    engine = AsyncLLM(EngineArgs(model=path, **engine_args))
    try:
        client = TestClient(build_app(engine, ServerConfig(), "ref"))
        return [client.post(route, json=body).json() for route, body in bodies]
    finally:
        asyncio.run(engine.shutdown())


PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.mark.parametrize("model", ["smollm2", "tiny"])
def test_each_model_answers_with_the_text_of_its_engine_alone(cluster, client, paths, model):
    engine_args = SMOL_ENGINE if model == "smollm2" else TINY_ENGINE
    common = {"max_tokens": 12, "temperature": 0}
    bodies = [
        ("/v1/completions", {"prompt": PROMPT, **common}),
        ("/v1/chat/completions", {"messages": MESSAGES, **common}),
    ]
    ref_completion, ref_chat = reference_answers(paths[model], engine_args, bodies)
    completion = client.completions.create(model=model, prompt=PROMPT, **common)
    chat = client.chat.completions.create(model=model, messages=MESSAGES, **common)
    assert completion.choices[0].text == ref_completion["choices"][0]["text"]
    assert chat.choices[0].message.content == ref_chat["choices"][0]["message"]["content"]
    assert completion.model == model and completion.usage.completion_tokens == 12
    # Streamed through the ingress in pieces: 64 tokens, since the tiny model's 12 take a few
    # milliseconds on CPU and can all exist before the first chunk is read (then merged into one)
    longer = {"max_tokens": 64, "temperature": 0, "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(model=model, prompt=PROMPT, **longer)
    stream = client.completions.create(model=model, prompt=PROMPT, stream=True, **longer)
    chunks = [c.choices[0].text for c in stream if c.choices]
    assert len(chunks) > 1 and "".join(chunks) == whole.choices[0].text


def test_unknown_model_is_a_404_in_openais_shape_and_models_lists_all(cluster, client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=1)
    error = caught.value.body
    assert error["code"] == "model_not_found" and error["type"] == "not_found_error"
    assert "'smollm2', 'tiny'" in error["message"] and error["param"] == "model"
    assert [m.id for m in client.models.list().data] == ["smollm2", "tiny"]
    assert client.models.retrieve("tiny").id == "tiny"


def test_health_and_metrics_cover_every_replica_on_both_nodes(cluster):
    health = httpx.get(cluster["url"] + "/health", timeout=60)
    assert health.status_code == 200, health.text
    models = health.json()["models"]
    smol = [r for r in models["smollm2"]["replicas"] if r["status"] == "ok"]
    tiny = [r for r in models["tiny"]["replicas"] if r["status"] == "ok"]
    assert len(smol) == 2 and len(tiny) >= 1
    assert all(r["torch_threads"] == 1 for r in smol + tiny)  # one core each, not both
    # the tiny model is pinned to the second node (its custom resource); SmolLM2's two replicas
    # do not both fit there, so two Ray nodes serve
    node2 = {n["NodeID"] for n in ray.nodes() if n["Alive"] and "node2" in n["Resources"]}
    assert {r["node"] for r in tiny} <= node2
    assert len({r["node"] for r in smol + tiny}) == 2
    text = httpx.get(cluster["url"] + "/metrics", timeout=60).text
    running = {
        (s.labels["model_name"], s.labels["replica"])
        for f in text_string_to_metric_families(text)
        if f.name == "pagedserve:num_requests_running"
        for s in f.samples
    }
    expected = {("smollm2", r["replica"]) for r in smol} | {("tiny", r["replica"]) for r in tiny}
    assert expected <= running


# ---- routing ----------------------------------------------------------------------------------


def prefix_counters(url: str, model: str) -> tuple[float, float]:
    """(hits, queries) in prompt tokens, summed over the model's replicas, from /metrics."""
    totals = {"pagedserve:prefix_cache_hits": 0.0, "pagedserve:prefix_cache_queries": 0.0}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=60).text):
        if family.name in totals:
            totals[family.name] += sum(
                s.value for s in family.samples if s.labels.get("model_name") == model
            )
    return totals["pagedserve:prefix_cache_hits"], totals["pagedserve:prefix_cache_queries"]


SYSTEM_TOPICS = ["astronomy", "cooking", "chess", "gardening", "sailing", "music"]


def shared_system_prompt_workload(client, topics: list[str], questions_each: int, seed: int):
    """Requests over a few shared system prompts, in a seeded random order, one at a time."""
    import random

    requests = [(t, q) for t in topics for q in range(questions_each)]
    random.Random(seed).shuffle(requests)
    for topic, q in requests:
        system = (
            f"You are a patient expert in {topic}. Answer in one short sentence, plainly, "
            f"without lists, and always mention {topic} by name when you answer a question."
        )
        client.chat.completions.create(
            model="smollm2",
            messages=[
                {"role": "system", "content": system},
                {"role": "user", "content": f"Question {q}: what is one fact about {topic}?"},
            ],
            max_tokens=1,
            temperature=0,
        )


def hit_rate(client, url: str, topics: list[str], seed: int) -> float:
    hits0, queries0 = prefix_counters(url, "smollm2")
    shared_system_prompt_workload(client, topics, questions_each=4, seed=seed)
    hits1, queries1 = prefix_counters(url, "smollm2")
    return (hits1 - hits0) / (queries1 - queries0)


def test_prefix_aware_routing_hits_the_prefix_cache_more_than_round_robin(cluster, client, paths):
    """The same two replicas, the policy switched by redeploying the config (the ingress is
    reconfigured in place; the replicas are not restarted), fresh system prompts per policy."""
    replicas = {s.replica_id for s in replica_stats("model-smollm2")}
    url, port = cluster["url"], cluster["port"]
    config = lambda routing: cluster_config(port, paths["smollm2"], paths["tiny"], routing)  # noqa: E731
    deploy(load_config(config("round_robin")), timeout_s=120)
    round_robin = hit_rate(client, url, SYSTEM_TOPICS[:3], seed=1)
    deploy(load_config(config("prefix")), timeout_s=120)
    prefix = hit_rate(client, url, SYSTEM_TOPICS[3:], seed=1)
    print(f"\nprefix-cache hit rate: round_robin {round_robin:.3f}, prefix {prefix:.3f}")
    assert prefix > round_robin + 0.05
    assert {s.replica_id for s in replica_stats("model-smollm2")} == replicas


# ---- the disruptive ones -----------------------------------------------------------------------


def stream_in_thread(client, model: str, max_tokens: int, outcome: dict, **extra):
    """Stream one completion in a thread; ``outcome`` gets its chunks' times, text and end."""

    def run():
        outcome["times"], text = [], []
        try:
            stream = client.completions.create(
                model=model,
                prompt=extra.pop("prompt", "Once upon a time"),
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
                **extra,
            )
            for chunk in stream:
                outcome["times"].append(time.monotonic())
                if chunk.choices:
                    text.append(chunk.choices[0].text)
                    outcome["finish_reason"] = chunk.choices[0].finish_reason
        except Exception as error:  # the test reads it
            outcome["error"] = error
        outcome["text"] = "".join(text)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow
def test_adding_a_model_by_redeploying_leaves_a_running_stream_alone(
    cluster, client, paths, tmp_path_factory
):
    """The added model takes images (a tiny LLaVA): its answer to a chat with a base64 picture,
    through the ingress, a Serve handle and its replica, is transformers' own."""
    llava = make_tiny_llava_checkpoint(tmp_path_factory.mktemp("llava"))
    third = {
        "name": "tiny-llava",
        "engine": {"model": str(llava), "dtype": "float32", **TINY_ENGINE},
        "num_cpus": 0.5,
    }
    before = {s.replica_id for s in replica_stats("model-smollm2")}
    outcome: dict = {}
    thread = stream_in_thread(client, "smollm2", 96, outcome)
    wait_for(lambda: outcome.get("times"), 120, "the stream's first chunk")
    started = time.monotonic()
    port = cluster["port"]
    deploy(load_config(cluster_config(port, paths["smollm2"], paths["tiny"], extra=[third])), 300)
    thread.join(timeout=300)
    assert "error" not in outcome and outcome["finish_reason"] == "length"
    assert outcome["times"][-1] > started  # it was still streaming while the config changed
    picture = tiny_test_images()[0]
    content = [
        {"type": "image_url", "image_url": {"url": png_data_url(picture)}},
        {"type": "text", "text": "What is this?"},
    ]
    answer = client.chat.completions.create(
        model="tiny-llava", messages=[{"role": "user", "content": content}], max_tokens=6,
        temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    prompt = "USER: <image>\nWhat is this? ASSISTANT:"  # the tiny LLaVA's chat template
    expanded, expected = transformers_llava_greedy(llava, prompt, [picture], 6)
    assert answer.choices[0].model_extra["token_ids"] == expected
    assert answer.usage.prompt_tokens == len(expanded)
    assert {s.replica_id for s in replica_stats("model-smollm2")} == before
    deploy(load_config(cluster_config(port, paths["smollm2"], paths["tiny"])), 300)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="tiny-llava", prompt="hi", max_tokens=1)


def test_status_lists_every_replica_with_its_process_and_node(cluster, capsys):
    """`pagedserve cluster status`: each application, and each replica's state, process id and
    node; the process ids are the replicas' own."""
    from pagedserve.cluster import cli

    apps = {"pagedserve", "model-smollm2", "model-tiny"}  # a model removed before: deleted
    wait_for(lambda: set(serve.status().applications) == apps, 120, "only the config's models")
    assert cli.main(["status"]) == 0
    sections: dict[str, list[str]] = {}
    replica_lines: list[str] = []
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("  "):
            replica_lines.append(line.strip())
        else:
            app, status = line.split(": ")
            assert status == "RUNNING", line
            sections[app] = replica_lines = []
    assert set(sections) == apps
    listed = {int(line.split("pid ")[1].split()[0]) for line in sections["model-smollm2"]}
    assert all(line.startswith("engine replica ALIVE: pid ") for line in sections["model-smollm2"])
    assert listed == {s.pid for s in replica_stats("model-smollm2")} and len(listed) == 2


@pytest.mark.slow
def test_a_replica_waiting_for_resources_is_reported_within_seconds(cluster, paths, capsys):
    """A model whose replica the head node could hold, but not now (3.5 CPUs; the other
    replicas hold some of its 4): reported in one line, with its demand and each node's free
    CPUs, seconds after the deploy, named again when the wait times out, and listed by
    `pagedserve cluster status` with what it waits for."""
    from pagedserve.cluster import cli

    greedy = {"name": "greedy", "engine": {"model": paths["tiny"], **TINY_ENGINE}, "num_cpus": 3.5}
    port, lines = cluster["port"], []
    config = load_config(cluster_config(port, paths["smollm2"], paths["tiny"], extra=[greedy]))
    started = time.monotonic()
    with pytest.raises(DeployTimeoutError, match="model-greedy: 1 replica"):
        deploy(config, timeout_s=30, report=lambda line: lines.append((time.monotonic(), line)))
    (at, line), *_ = lines
    # seconds on a quiet machine (~4 s); the margin is for a loaded one, where Serve's
    # controller itself is slow to create the replica it then reports waiting
    assert at - started < 25, lines
    assert line.startswith(
        "model-greedy: 1 replica(s) waiting for resources: each needs {CPU: 3.5}; "
        "free on the nodes: "
    )
    nodes = re.findall(r"\{CPU: ([\d.]+) of ([\d.]+)\}", line)
    assert sorted(float(total) for _, total in nodes) == [2.0, 4.0], line
    assert all(float(free) < 3.5 for free, _ in nodes), line  # why it waits
    assert cli.main(["status"]) == 0  # the waiting replica, and what it waits for
    assert "  engine replica PENDING_CREATION: not placed, needs {CPU: 3.5}" in (
        capsys.readouterr().out.splitlines()
    )
    deploy(load_config(cluster_config(port, paths["smollm2"], paths["tiny"])), 300)
    wait_for(lambda: not replicas({"model-greedy"}), 60, "the waiting replica gone")


@pytest.mark.slow
def test_a_killed_replica_ends_its_streams_clearly_and_comes_back_holding_nothing(cluster, client):
    """Eight streams sharing a prompt prefix crowd onto one replica (two run, the rest wait);
    killing its process ends the running ones with an error and sends the waiting ones to the
    other replica; Ray starts a replacement."""
    outcomes = [{} for _ in range(8)]
    prompt = "In a quiet village by the sea, an old fisherman told the children a story: "
    threads = [
        stream_in_thread(client, "smollm2", 48, o, prompt=prompt + f"part {i}.")
        for i, o in enumerate(outcomes)
    ]
    victim = wait_for(
        lambda: next((s for s in replica_stats("model-smollm2") if s.num_requests >= 3), None),
        120,
        "a replica with waiting requests",
    )
    wait_for(lambda: any(o.get("times") for o in outcomes), 120, "some stream to start")
    os.kill(victim.pid, signal.SIGKILL)
    # new requests meanwhile reach the healthy replica (one routed to the dead one is retried)
    for i in range(2):
        after = client.completions.create(model="smollm2", prompt=f"Then {i}", max_tokens=3)
        assert after.usage.completion_tokens == 3
    for thread in threads:
        thread.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a stream hung after its replica died"
    finished = [o for o in outcomes if "error" not in o and o.get("finish_reason") == "length"]
    died = [o for o in outcomes if "error" in o]
    assert len(finished) + len(died) == len(outcomes)
    assert finished, "the requests that had not started were not retried elsewhere"
    assert all("died" in str(o["error"]) for o in died), [str(o["error"]) for o in died]
    retries = wait_for(lambda: _retries(cluster["url"]), 30, "a retry in the metrics")
    assert retries >= 1
    wait_for(
        lambda: (
            len([s for s in replica_stats("model-smollm2") if s.healthy]) == 2
            and victim.replica_id not in {s.replica_id for s in replica_stats("model-smollm2")}
        ),
        240,
        "a replacement replica",
        interval_s=2,
    )
    for app in ("model-smollm2", "model-tiny"):
        assert all(s.blocks_held == 0 for s in replica_stats(app))


def _retries(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=60).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        if f.name == "pagedserve:cluster_request_retries"
        for s in f.samples
        if s.labels["model_name"] == "smollm2"
    )


@pytest.mark.slow
def test_autoscaling_adds_a_replica_under_a_burst_and_removes_it_after(cluster, client):
    assert running_replicas("model-tiny") == 1
    stop = threading.Event()

    def burst():
        while not stop.is_set():
            outcome: dict = {}
            stream_in_thread(client, "tiny", 200, outcome).join()

    workers = [threading.Thread(target=burst, daemon=True) for _ in range(4)]
    for w in workers:
        w.start()
    started = time.monotonic()
    try:
        wait_for(lambda: running_replicas("model-tiny") == 2, 240, "a second tiny replica", 1)
        up_s = time.monotonic() - started
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=120)
    idle = time.monotonic()
    wait_for(lambda: running_replicas("model-tiny") == 1, 120, "back to one tiny replica", 1)
    print(f"\nautoscaling: 1->2 in {up_s:.0f}s under load, 2->1 in {time.monotonic() - idle:.0f}s")
