"""Whether a cluster can place a config's replicas, said before anything is deployed: a replica
bigger than every node, or more replicas than the nodes hold together, is named in one line
with its demand and what the nodes have; `pagedserve cluster serve` on a cluster it started
itself refuses such a config at once (exit 2) instead of waiting for its timeout."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("ray.serve")

from pagedserve.cluster.config import build_serve_config, load_config  # noqa: E402
from pagedserve.cluster.placement import placement_problems, replica_demands  # noqa: E402

NODE_2_CPUS = {"CPU": 2.0, "memory": 8e9, "node:__internal_head__": 1.0}


def schema(*models: dict) -> dict:
    return build_serve_config(load_config({"models": list(models)}))


def chat(**fields) -> dict:
    return {"name": "chat", "engine": {"model": "/models/chat"}, **fields}


def test_three_one_cpu_replicas_do_not_fit_a_two_core_node():
    problems = placement_problems(schema(chat(num_replicas=3)), [NODE_2_CPUS])
    assert problems == [
        "the replicas need 3 CPU in all (model-chat 3 x 1) and the cluster has 2: lower "
        "num_replicas or num_cpus (torch_threads), or add a node"
    ]
    assert placement_problems(schema(chat(num_replicas=2)), [NODE_2_CPUS]) == []
    assert placement_problems(schema(chat(num_replicas=3, num_cpus=0.5)), [NODE_2_CPUS]) == []


def test_a_replica_bigger_than_every_node_is_named_with_what_the_nodes_have():
    problems = placement_problems(schema(chat(resources={"worker_node": 1})), [NODE_2_CPUS])
    assert problems[0] == (
        "model-chat: a replica needs {CPU: 1, worker_node: 1} and no node has that much "
        "(nodes: {CPU: 2, worker_node: 0})"
    )
    two_nodes = [NODE_2_CPUS, {"CPU": 2.0, "worker_node": 1.0}]
    assert placement_problems(schema(chat(resources={"worker_node": 1})), two_nodes) == []
    (problem,) = placement_problems(
        schema(chat(num_replicas=2, resources={"worker_node": 1})), two_nodes
    )
    assert problem.endswith(
        "need 2 worker_node in all (model-chat 2 x 1) and the cluster has 1: lower "
        "num_replicas, or give more nodes that resource (ray start --resources)"
    )
    wide = schema(chat(engine={"model": "/m", "tensor_parallel_size": 2}, torch_threads=2))
    assert "a replica needs {CPU: 4}" in placement_problems(wide, two_nodes)[0]
    # a pipeline's ranks are the replica's worker processes (mp): all reserved by the replica
    staged = {"model": "/m", "tensor_parallel_size": 2, "pipeline_parallel_size": 2}
    assert (
        "a replica needs {CPU: 4}" in placement_problems(schema(chat(engine=staged)), two_nodes)[0]
    )
    # placed by Ray instead: the replica is rank 0 alone; its workers reserve their own bundles
    on_ray = schema(chat(engine={**staged, "distributed_executor_backend": "ray"}))
    assert placement_problems(on_ray, two_nodes) == []


def test_the_demand_counts_every_application_and_the_replicas_each_starts_with():
    config = schema(
        chat(num_replicas=2),
        {
            "name": "embed",
            "engine": {"model": "/models/embed"},
            "autoscaling": {"min_replicas": 2, "max_replicas": 4},
        },
    )
    demands = {app: (n, demand) for app, n, demand in replica_demands(config)}
    assert demands == {
        "pagedserve": (1, {}),  # the ingress takes no CPU
        "model-chat": (2, {"CPU": 1.0}),
        "model-embed": (2, {"CPU": 1.0}),
    }
    (problem,) = placement_problems(config, [NODE_2_CPUS])
    assert "need 4 CPU in all (model-chat 2 x 1, model-embed 2 x 1)" in problem


def test_serve_refuses_at_once_what_the_cluster_it_starts_cannot_place(tmp_path):
    """The operator's case from the issue: more one-CPU replicas than this machine has cores,
    on the local head that `cluster serve` starts: one line, exit 2, no timeout to wait for."""
    replicas = 1000  # more cores than any machine this runs on
    path = tmp_path / "cluster.yaml"
    path.write_text(
        f"models:\n  - name: chat\n    engine: {{model: /models/chat}}\n"
        f"    num_replicas: {replicas}\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "pagedserve.server.cli", "cluster", "serve", str(path)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("pagedserve cluster: the replicas cannot be placed: the replicas need")
    assert f"{replicas} CPU in all (model-chat {replicas} x 1)" in last
    assert "Traceback" not in done.stderr
