"""Start or join a Ray cluster, and deploy (or redeploy) a cluster config on it.

The config goes to Ray Serve's controller as one declarative document, the way ``serve run
config.yaml`` and ``serve deploy`` submit theirs: Serve then diffs it against what runs (the
imperative ``serve.run`` would restart every replica on each call). Applications the new
document leaves out are deleted, so removing a model from the file removes its replicas.
"""

from __future__ import annotations

import time

import ray
from ray import serve

from pagedserve.cluster.config import (
    INGRESS_APP,
    INGRESS_DEPLOYMENT,
    ClusterConfig,
    build_serve_config,
)


class DeployTimeoutError(TimeoutError):
    """The deployment did not come up in time; the message says what was still missing."""


def connect(address: str | None = None, **init_kwargs) -> None:
    """Join the Ray cluster at ``address`` ("auto": the one this node belongs to, or
    "HOST:PORT"), or without one start a new local head that lives as long as this process
    (``"local"``: never a running cluster found by chance)."""
    if ray.is_initialized():
        return
    init_kwargs.setdefault("include_dashboard", False)
    init_kwargs.setdefault("log_to_driver", False)
    ray.init(address=address or "local", **init_kwargs)


def deploy(config: ClusterConfig, timeout_s: float = 600.0) -> None:
    """Apply ``config`` to the connected cluster and wait until every model is served."""
    from ray.serve._private.api import serve_start
    from ray.serve.schema import ServeDeploySchema

    schema = build_serve_config(config, cluster_has_gpus=ray.cluster_resources().get("GPU", 0) > 0)
    client = serve_start(http_options=schema["http_options"], proxy_location=config.proxy_location)
    client.deploy_apps(ServeDeploySchema.model_validate(schema))
    wait_until_served(config, timeout_s)


def wait_until_served(config: ClusterConfig, timeout_s: float) -> None:
    """Every application RUNNING and the ingress serving every configured model."""
    deadline = time.monotonic() + timeout_s
    wanted = {m.app_name for m in config.models} | {INGRESS_APP}
    wanted |= {m.prefill_app_name for m in config.models if m.prefill is not None}
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
        if time.monotonic() > deadline:
            raise DeployTimeoutError(f"not served after {timeout_s:.0f}s: applications {statuses}")
        time.sleep(0.5)


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
