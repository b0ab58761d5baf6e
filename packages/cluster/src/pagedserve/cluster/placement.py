"""Where the replicas go: whether the cluster can place them, and where each one is now.

Ray places each replica (an actor) on a node that has its resources free: ``num_cpus``,
``num_gpus`` and any custom resource of its model's config. A replica that no node can take
waits (``PENDING_CREATION``) without end, and Ray Serve says so only in its own log files, after
30 s; the deploy then times out minutes later. So before deploying, ``placement_problems`` checks
what is certain from the config alone (a replica bigger than every node, or more replicas than
the whole cluster can hold), and while waiting, ``pending_replicas`` reads Ray's actor table for
the replicas still waiting, so that the operator hears of them within seconds, in one line
that names the demand and what the cluster has.

``replicas`` reads the same table for ``pagedserve cluster status``: every replica of every
application, its state, process id and node. (Ray's own ``ray list actors`` needs the dashboard's
API server, which a cluster started by ``pagedserve cluster serve`` leaves off.)
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

REPLICA_PREFIX = "SERVE_REPLICA::"  # Ray Serve's replica actor names: PREFIX + app#deployment#id


def replica_demands(schema: dict[str, Any]) -> list[tuple[str, int, dict[str, float]]]:
    """Per deployment of a Serve config (``build_serve_config``): its application, the replicas
    it starts with, and the resources one replica takes."""
    demands = []
    for app in schema["applications"]:
        for deployment in app["deployments"]:
            autoscaling = deployment.get("autoscaling_config") or {}
            replicas = deployment.get("num_replicas") or autoscaling.get(
                "initial_replicas", autoscaling.get("min_replicas", 1)
            )
            demand = actor_demand(deployment.get("ray_actor_options") or {})
            demands.append((app["name"], int(replicas), demand))
    return demands


def actor_demand(options: dict[str, Any]) -> dict[str, float]:
    """The resources an actor with these ``ray_actor_options`` takes (Ray's default: 1 CPU)."""
    wanted = {
        "CPU": options.get("num_cpus", 1),
        "GPU": options.get("num_gpus", 0),
        **(options.get("resources") or {}),
    }
    return {name: float(amount) for name, amount in wanted.items() if amount}


def placement_problems(schema: dict[str, Any], nodes: list[dict[str, float]]) -> list[str]:
    """What certainly keeps a replica of ``schema`` from being placed on ``nodes`` (each node's
    total resources): a replica that no node could hold even empty, or more of a resource in all
    than the nodes have together. Empty when the replicas may fit (Ray still packs them)."""
    problems = []
    needed: dict[str, float] = defaultdict(float)
    shares: dict[str, list[str]] = defaultdict(list)
    for app, replicas, demand in replica_demands(schema):
        if not replicas:
            continue
        if not any(_fits(demand, node) for node in nodes):
            problems.append(
                f"{app}: a replica needs {show_resources(demand)} and no node has that much "
                f"(nodes: {', '.join(show_resources(_relevant(node, demand)) for node in nodes) or 'none'})"
            )
        for name, amount in demand.items():
            needed[name] += replicas * amount
            shares[name].append(f"{app} {replicas} x {amount:g}")
    for name, amount in needed.items():
        have = sum(node.get(name, 0.0) for node in nodes)
        if 0 < have < amount:  # (no node with it at all: said above, per replica)
            problems.append(
                f"the replicas need {amount:g} {name} in all ({', '.join(shares[name])}) and the "
                f"cluster has {have:g}: {_ADVICE.get(name, _ADVICE[None])}"
            )
    return problems


_ADVICE = {
    "CPU": "lower num_replicas or num_cpus (torch_threads), or add a node",
    "GPU": "lower num_replicas or num_gpus, or add a node",
    None: "lower num_replicas, or give more nodes that resource (ray start --resources)",
}


@dataclass
class Replica:
    """One replica as Ray's actor table has it."""

    app: str
    deployment: str
    state: str  # ALIVE, PENDING_CREATION, RESTARTING, DEAD
    pid: int
    node_ip: str


def replicas(apps: set[str] | None = None) -> list[Replica]:
    """Every Serve replica of the connected cluster (of ``apps`` only, if given), live or
    waiting, sorted by application; the dead ones left out."""
    from ray._private import state

    found = []
    for info in state.actors().values():
        name = info.get("Name") or ""
        parts = name[len(REPLICA_PREFIX) :].rsplit("#", 2)  # the app name may hold a "#"
        if not name.startswith(REPLICA_PREFIX) or len(parts) < 3 or info.get("State") == "DEAD":
            continue  # not a replica of an application (or gone)
        app, deployment = parts[0], parts[1]
        if apps is None or app in apps:
            address = info.get("Address") or {}
            found.append(
                Replica(
                    app, deployment, info["State"], info.get("Pid", 0), address.get("IPAddress", "")
                )
            )
    return sorted(found, key=lambda r: (r.app, r.state, r.pid))


def deployment_demands() -> dict[tuple[str, str], dict[str, float]]:
    """The resources one replica of each running deployment asks for, by (application,
    deployment), as Serve's controller holds them (empty if it cannot say)."""
    from ray.serve.context import _get_global_client

    try:
        details = _get_global_client().get_serve_details()
    except Exception:  # noqa: BLE001 - no controller (nothing deployed): nothing to say
        return {}
    demands = {}
    for app_name, app in (details.get("applications") or {}).items():
        for name, deployment in (app.get("deployments") or {}).items():
            options = (deployment.get("deployment_config") or {}).get("ray_actor_options")
            demands[app_name, name] = actor_demand(options or {})
    return demands


def pending_report(app: str, num_pending: int, demand: dict[str, float]) -> str:
    """One line on replicas that wait for resources: the demand, and each node's free and total
    amounts of what it asks for (Ray places a replica on one node, so the sums would mislead)."""
    from ray._private import state

    free, total = state.available_resources_per_node(), state.total_resources_per_node()
    nodes = [
        "{" + ", ".join(f"{name}: {free.get(node, {}).get(name, 0):g} of {amount.get(name, 0):g}"
                        for name in demand) + "}"
        for node, amount in total.items()
    ]  # fmt: skip
    return (
        f"{app}: {num_pending} replica(s) waiting for resources: each needs {show_resources(demand)}; "
        f"free on the nodes: {', '.join(nodes)}"
    )


def _fits(demand: dict[str, float], node: dict[str, float]) -> bool:
    return all(node.get(name, 0.0) >= amount for name, amount in demand.items())


def _relevant(node: dict[str, float], demand: dict[str, float]) -> dict[str, float]:
    return {name: node.get(name, 0.0) for name in demand}


def show_resources(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{name}: {amount:g}" for name, amount in resources.items()) + "}"
