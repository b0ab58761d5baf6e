"""The cluster's config file: which models, how many replicas of each, how requests are routed.

One YAML (or dict) describes the whole deployment; redeploying an edited file is how models are
added, resized or removed while the others keep serving. ``build_serve_config`` turns it into
Ray Serve's own declarative config (one application per model, one for the ingress), the same
document ``serve deploy`` takes, so Ray decides what a change costs: a new replica count or
autoscaling bound is applied in place, new engine arguments restart that model's replicas only,
and the ingress learns about the models through its ``user_config`` (reconfigured in place,
never restarted, so its open streams go on).

```yaml
host: 127.0.0.1          # the HTTP endpoint (Ray Serve's proxy)
port: 8000
proxy_location: HeadOnly # Ray Serve's HTTP proxies: HeadOnly, EveryNode (behind a balancer)
routing: prefix          # default for every model: prefix or round_robin
server: {api_key: null}  # ServerConfig fields, as for `pagedserve serve`
models:
  - name: smollm2        # the request's "model"
    engine: {model: /path/to/SmolLM2-135M-Instruct, kv_cache_memory: 256MiB}
    num_replicas: 2      # or autoscaling: {min_replicas, max_replicas, target_ongoing_requests}
    torch_threads: 1     # per replica; num_cpus defaults to torch_threads * its ranks (tp x pp)
  - name: smollm2-pd     # a disaggregated prefill/decode pair (docs/kv_connectors.md)
    engine: {model: /path/to/SmolLM2-135M-Instruct}   # the decode replicas'
    prefill: {num_replicas: 1, engine: {max_num_batched_tokens: 4096}}  # and their prefill ones
```

A model with ``prefill`` is two applications: its decode replicas (``model-<name>``, kv_consumer)
and its prefill replicas (``model-<name>-prefill``, kv_producer, the decode engine's arguments
with ``prefill.engine`` over them); the ingress sends each prompt to a prefill replica first and
then to a decode replica with the transfer's handle, the blocks going between the two over TCP.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

ROUTING_POLICIES = ("prefix", "round_robin")
INGRESS_APP = "pagedserve"
INGRESS_DEPLOYMENT = "ingress"
ENGINE_DEPLOYMENT = "engine"
ROUTER_CLASS = "pagedserve.cluster.router:ReplicaRouter"
ENGINE_APP_BUILDER = "pagedserve.cluster.replica:engine_app"
INGRESS_APP_BUILDER = "pagedserve.cluster.ingress:ingress_app"


class ClusterConfigError(ValueError):
    """A config file that cannot be deployed; the message names the field at fault."""


@dataclass
class ModelDeploymentConfig:
    """One served model: its engine arguments and the replicas that run them.

    ``num_gpus`` defaults to the replica's ranks on a cluster with GPUs (one replica's shards
    must sit on one node, and Ray places an actor's GPUs on one node), else 0. Its ranks are
    ``tensor_parallel_size`` x ``pipeline_parallel_size`` as worker processes of the replica,
    or the replica's own rank 0 alone when Ray places the others (``engine:
    {distributed_executor_backend: ray}``: a multi-node pipeline-parallel replica, whose
    workers reserve their own bundles).
    ``busy_threshold``: ongoing requests at which a prefix-preferred replica counts as busy and
    the less loaded of two candidates is taken instead. ``resources``: extra Ray resources a
    replica needs (a custom node label pins a model to certain nodes).
    """

    name: str
    engine: dict[str, Any]
    num_replicas: int = 1
    autoscaling: dict[str, Any] | None = None
    num_cpus: float | None = None
    num_gpus: float | None = None
    torch_threads: int = 1
    max_ongoing_requests: int = 32
    routing: str | None = None
    busy_threshold: int = 4
    prefix_blocks: int = 1
    resources: dict[str, float] = field(default_factory=dict)
    prefill: dict[str, Any] | None = None

    @property
    def ranks_in_replica(self) -> int:
        """The ranks that run inside a replica's actor (itself and its worker processes)."""
        if self.engine.get("distributed_executor_backend") == "ray":
            return 1
        tp = int(self.engine.get("tensor_parallel_size", 1))
        return tp * int(self.engine.get("pipeline_parallel_size", 1))

    @property
    def app_name(self) -> str:
        return f"model-{self.name}"

    @property
    def prefill_app_name(self) -> str | None:
        return f"model-{self.name}-prefill" if self.prefill is not None else None

    def engine_args(self, prefill: bool = False) -> dict[str, Any]:
        """The replicas' engine arguments: as given, or for a P/D pair the decode replicas'
        (kv_consumer) or the prefill replicas' (kv_producer, ``prefill.engine`` over them,
        its transfer server on every interface and a free port)."""
        if self.prefill is None:
            return self.engine
        if not prefill:
            return {**self.engine, "kv_transfer_config": {"kv_role": "kv_consumer"}}
        producer = {"kv_role": "kv_producer", "kv_ip": "0.0.0.0", "kv_port": 0}
        return {**self.engine, **self.prefill.get("engine", {}), "kv_transfer_config": producer}

    @property
    def revision(self) -> str:
        """A digest of what the replicas run: the ingress re-reads a model's tokenizer and
        limits when it changes."""
        text = json.dumps(
            [self.engine, self.torch_threads, self.prefill], sort_keys=True, default=str
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class ClusterConfig:
    models: list[ModelDeploymentConfig]
    host: str = "127.0.0.1"
    port: int = 8000
    routing: str = "prefix"
    server: dict[str, Any] = field(default_factory=dict)
    ingress_replicas: int = 1
    proxy_location: str = "HeadOnly"  # Ray Serve's: HeadOnly, EveryNode or Disabled

    def model(self, name: str) -> ModelDeploymentConfig:
        return next(m for m in self.models if m.name == name)


def load_config(source: str | Path | dict) -> ClusterConfig:
    """A config from a YAML file's path or a dict, checked before anything is deployed."""
    if isinstance(source, dict):
        data = source
    else:
        import yaml

        data = yaml.safe_load(Path(source).read_text())
    if not isinstance(data, dict):
        raise ClusterConfigError("the config must be a mapping with a 'models' list")
    return config_from_dict(data)


def config_from_dict(data: dict) -> ClusterConfig:
    known = {f.name for f in fields(ClusterConfig)}
    _reject_unknown(data, known, "the config")
    models = data.get("models")
    if not isinstance(models, list) or not models:
        raise ClusterConfigError("'models' must be a non-empty list")
    config = ClusterConfig(**{**data, "models": [_model_from_dict(m) for m in models]})
    _check(config)
    return config


def _model_from_dict(data) -> ModelDeploymentConfig:
    if not isinstance(data, dict) or "name" not in data or "engine" not in data:
        raise ClusterConfigError(f"each model needs a 'name' and an 'engine' mapping: {data!r}")
    known = {f.name for f in fields(ModelDeploymentConfig)}
    _reject_unknown(data, known, f"model {data['name']!r}")
    engine = dict(data["engine"])
    if "model" not in engine:
        raise ClusterConfigError(
            f"model {data['name']!r}: engine.model (a model folder or a .gguf file) is required"
        )
    engine["model"] = str(Path(engine["model"]).expanduser())
    if isinstance(engine.get("kv_cache_memory"), str):
        from pagedserve.server.cli import parse_size

        engine["kv_cache_memory"] = parse_size(engine["kv_cache_memory"])
    return ModelDeploymentConfig(**{**data, "engine": engine})


def _reject_unknown(data: dict, known: set[str], where: str) -> None:
    unknown = sorted(set(data) - known)
    if unknown:
        raise ClusterConfigError(f"{where}: unknown field(s) {unknown}; known: {sorted(known)}")


def _check(config: ClusterConfig) -> None:
    from pagedserve.engine import EngineArgs

    names = [m.name for m in config.models]
    if len(set(names)) != len(names):
        raise ClusterConfigError(f"model names must be unique, got {names}")
    for policy in [config.routing, *(m.routing for m in config.models if m.routing)]:
        if policy not in ROUTING_POLICIES:
            raise ClusterConfigError(f"routing must be one of {ROUTING_POLICIES}, got {policy!r}")
    for m in config.models:
        _reject_unknown(m.engine, EngineArgs.field_names(), f"model {m.name!r} engine")
        if m.prefill is not None:
            _check_prefill(m)
        if not m.name or "/" in m.name:
            raise ClusterConfigError(f"model name {m.name!r}: give a non-empty name without '/'")
        if m.num_replicas < 1 or m.torch_threads < 1 or m.prefix_blocks < 1:
            raise ClusterConfigError(
                f"model {m.name!r}: num_replicas, torch_threads and prefix_blocks must be >= 1"
            )


def _check_prefill(m: ModelDeploymentConfig) -> None:
    """A P/D pair's ``prefill``: its own fields only, both engines' arguments valid."""
    from pagedserve.engine import EngineArgs

    where = f"model {m.name!r} prefill"
    if not isinstance(m.prefill, dict):
        raise ClusterConfigError(f"{where}: a mapping (num_replicas, engine, torch_threads)")
    _reject_unknown(m.prefill, {"num_replicas", "engine", "torch_threads"}, where)
    _reject_unknown(m.prefill.get("engine", {}), EngineArgs.field_names(), f"{where} engine")
    if "kv_transfer_config" in m.engine or "kv_transfer_config" in m.prefill.get("engine", {}):
        raise ClusterConfigError(f"{where}: the pair sets kv_transfer_config itself; leave it out")
    if m.autoscaling or int(m.prefill.get("num_replicas", 1)) < 1:
        raise ClusterConfigError(f"{where}: num_replicas >= 1, and no autoscaling for a pair yet")
    for prefill in (False, True):
        try:
            EngineArgs(**m.engine_args(prefill))
        except (TypeError, ValueError) as e:
            raise ClusterConfigError(f"model {m.name!r}: {e}") from e


# ---- Ray Serve's config ------------------------------------------------------------------------


def routing_settings(config: ClusterConfig) -> list[dict[str, Any]]:
    """What the ingress needs per model (its user_config): where the replicas are, how to
    route to them, and the revision that tells it to re-read the model's description."""
    return [
        {
            "name": m.name,
            "app_name": m.app_name,
            "routing": m.routing or config.routing,
            "busy_threshold": m.busy_threshold,
            "prefix_blocks": m.prefix_blocks,
            "revision": m.revision,
            "prefill_app_name": m.prefill_app_name,
        }
        for m in config.models
    ]


def build_serve_config(config: ClusterConfig, cluster_has_gpus: bool = False) -> dict[str, Any]:
    """Ray Serve's declarative config (a ``ServeDeploySchema`` as a dict) for ``config``."""
    ingress = {
        "name": INGRESS_APP,
        "route_prefix": "/",
        "import_path": INGRESS_APP_BUILDER,
        "args": {"server": config.server},
        "deployments": [
            {
                "name": INGRESS_DEPLOYMENT,
                "num_replicas": config.ingress_replicas,
                "max_ongoing_requests": 4096,  # streams wait on the engines, not on the ingress
                "ray_actor_options": {"num_cpus": 0},
                "user_config": {"models": routing_settings(config)},
            }
        ],
    }
    return {
        "proxy_location": config.proxy_location,
        "http_options": {"host": config.host, "port": config.port},
        "applications": [
            ingress,
            *(_engine_app(m, cluster_has_gpus) for m in config.models),
            *(
                _engine_app(m, cluster_has_gpus, True)
                for m in config.models
                if m.prefill is not None
            ),
        ],
    }


def _engine_app(m: ModelDeploymentConfig, cluster_has_gpus: bool, prefill=False) -> dict[str, Any]:
    """One application of a model's engine replicas (a P/D pair's prefill ones: ``prefill``)."""
    num_gpus = m.num_gpus
    if num_gpus is None:
        wants_cuda = m.engine.get("device", "auto") in ("auto", "cuda")
        num_gpus = m.ranks_in_replica if (cluster_has_gpus and wants_cuda) else 0
    num_cpus = m.num_cpus if m.num_cpus is not None else m.torch_threads * m.ranks_in_replica
    actor_options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus}
    if m.resources:
        actor_options["resources"] = dict(m.resources)
    deployment: dict[str, Any] = {
        "name": ENGINE_DEPLOYMENT,
        "max_ongoing_requests": m.max_ongoing_requests,
        "ray_actor_options": actor_options,
        "health_check_period_s": 2.0,
        "health_check_timeout_s": 30.0,
        "graceful_shutdown_timeout_s": 10.0,
        "request_router_config": {"request_router_class": ROUTER_CLASS},
    }
    torch_threads = m.torch_threads
    if prefill:
        deployment["num_replicas"] = int(m.prefill.get("num_replicas", 1))
        torch_threads = int(m.prefill.get("torch_threads", m.torch_threads))
        actor_options["num_cpus"] = torch_threads * m.ranks_in_replica
    elif m.autoscaling:
        deployment["autoscaling_config"] = dict(m.autoscaling)
    else:
        deployment["num_replicas"] = m.num_replicas
    return {
        "name": m.prefill_app_name if prefill else m.app_name,
        "route_prefix": None,
        "import_path": ENGINE_APP_BUILDER,
        "args": {"engine": m.engine_args(prefill), "torch_threads": torch_threads},
        "deployments": [deployment],
    }


def as_dict(config: ClusterConfig) -> dict[str, Any]:
    return asdict(config)
