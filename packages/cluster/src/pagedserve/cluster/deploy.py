"""Start or join a Ray cluster, and deploy (or redeploy) a cluster config on it.

The config goes to Ray Serve's controller as one declarative document, the way ``serve run
config.yaml`` and ``serve deploy`` submit theirs: Serve then diffs it against what runs (the
imperative ``serve.run`` would restart every replica on each call). Applications the new
document leaves out are deleted, so removing a model from the file removes its replicas.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import ray
from ray import serve

from pagedserve.cluster.config import (
    INGRESS_APP,
    INGRESS_DEPLOYMENT,
    ClusterConfig,
    ClusterConfigError,
    build_serve_config,
)
from pagedserve.cluster.placement import (
    pending_report,
    placement_problems,
    replica_demands,
    replicas,
)

PENDING_REPORT_S = 3.0  # a replica waiting this long for resources is reported


class DeployTimeoutError(TimeoutError):
    """The deployment did not come up in time; the message says what was still missing."""


class PlacementError(ClusterConfigError):
    """The cluster can never place the replicas as configured (placement.py)."""


def connect(address: str | None = None, **init_kwargs) -> None:
    """Join the Ray cluster at ``address`` ("auto": the one this node belongs to, or
    "HOST:PORT"), or without one start a new local head that lives as long as this process
    (``"local"``: never a running cluster found by chance)."""
    if ray.is_initialized():
        return
    init_kwargs.setdefault("include_dashboard", False)
    init_kwargs.setdefault("log_to_driver", False)
    ray.init(address=address or "local", **init_kwargs)


def deploy(
    config: ClusterConfig,
    timeout_s: float = 600.0,
    local: bool = False,
    report: Callable[[str], None] | None = None,
) -> None:
    """Apply ``config`` to the connected cluster and wait until every model is served.

    Replicas the cluster can certainly not place are refused before anything is deployed when
    the cluster is ``local`` (this process started it: no node will join); on a cluster that
    may grow they are reported (``report``, default: stderr) and waited for."""
    from ray.serve._private.api import serve_start
    from ray.serve.schema import ServeDeploySchema

    report = report or _to_stderr
    schema = build_serve_config(config, cluster_has_gpus=ray.cluster_resources().get("GPU", 0) > 0)
    nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
    problems = placement_problems(schema, nodes)
    if problems and local:
        raise PlacementError("the replicas cannot be placed: " + "; ".join(problems))
    for problem in problems:
        report(f"warning: {problem} (waiting, in case nodes join)")
    client = serve_start(http_options=schema["http_options"], proxy_location=config.proxy_location)
    client.deploy_apps(ServeDeploySchema.model_validate(schema))
    wait_until_served(config, timeout_s, schema, report)


def wait_until_served(
    config: ClusterConfig,
    timeout_s: float,
    schema: dict | None = None,
    report: Callable[[str], None] | None = None,
) -> None:
    """Every application RUNNING and the ingress serving every configured model. A replica
    that waits for resources more than ``PENDING_REPORT_S`` is reported at once, one line per
    application, and named again if the wait times out."""
    report = report or _to_stderr
    demands = {app: demand for app, _, demand in replica_demands(schema or {"applications": []})}
    deadline = time.monotonic() + timeout_s
    wanted = {m.app_name for m in config.models} | {INGRESS_APP}
    wanted |= {m.prefill_app_name for m in config.models if m.prefill is not None}
    pending_since: dict[str, float] = {}
    pending_lines: dict[str, str] = {}
    while True:
        statuses = {name: app.status for name, app in serve.status().applications.items()}
        failed = [n for n in wanted if statuses.get(n) == "DEPLOY_FAILED"]
        if failed:
            details = {n: serve.status().applications[n].message for n in failed}
            raise RuntimeError(f"deploying failed: {details}")
        if all(statuses.get(n) == "RUNNING" for n in wanted):
            ready = set(_ingress_models())
            if ready >= {m.name for m in config.models}:
                return
        for app, count in _count_pending(wanted).items():
            since = pending_since.setdefault(app, time.monotonic())
            if time.monotonic() - since >= PENDING_REPORT_S and app not in pending_lines:
                pending_lines[app] = pending_report(app, count, demands.get(app, {}))
                report(pending_lines[app])
        if time.monotonic() > deadline:
            waiting = "; ".join(pending_lines.values())
            raise DeployTimeoutError(
                f"not served after {timeout_s:.0f}s: applications {statuses}"
                + (f"; {waiting}" if waiting else "")
            )
        time.sleep(0.5)


def _count_pending(apps: set[str]) -> dict[str, int]:
    """How many replicas of each of ``apps`` wait for resources now."""
    counts: dict[str, int] = {}
    for replica in replicas(apps):
        if replica.state == "PENDING_CREATION":
            counts[replica.app] = counts.get(replica.app, 0) + 1
    return counts


def _to_stderr(line: str) -> None:
    print(f"pagedserve cluster: {line}", file=sys.stderr, flush=True)


def _ingress_models() -> list[str]:
    """The models the ingress serves now (none while it is still starting or redeploying)."""
    try:
        handle = serve.get_deployment_handle(INGRESS_DEPLOYMENT, INGRESS_APP)
        return handle.ready_models.remote().result(timeout_s=30)
    except Exception:  # noqa: BLE001 - not there yet: the caller polls again
        return []


def shutdown() -> None:
    """Remove every application and stop Serve (the Ray cluster itself stays up)."""
    serve.shutdown()
