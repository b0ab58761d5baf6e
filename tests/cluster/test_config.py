"""The cluster's config file: what it accepts, what it refuses (naming the field), and the Ray
Serve config it becomes (resources per replica, autoscaling, the router, the ingress's models)."""

from __future__ import annotations

import pytest

pytest.importorskip("ray.serve")

from ray.serve.schema import ServeDeploySchema  # noqa: E402

from pagedserve.cluster.config import (  # noqa: E402
    ROUTER_CLASS,
    ClusterConfigError,
    build_serve_config,
    load_config,
)

YAML = """
port: 8123
routing: round_robin
server: {api_key: sk-test}
models:
  - name: big
    engine: {model: /models/big, tensor_parallel_size: 2, kv_cache_memory: 64MiB}
    autoscaling: {min_replicas: 1, max_replicas: 3, target_ongoing_requests: 2}
    torch_threads: 2
  - name: small
    engine: {model: /models/small}
    num_replicas: 2
    routing: prefix
    resources: {gpu_node: 1}
"""


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(YAML)
    return load_config(path)


def test_a_config_file_becomes_ray_serves_declarative_config(config):
    schema = build_serve_config(config, cluster_has_gpus=True)
    ServeDeploySchema.model_validate(schema)  # what `serve deploy` would accept
    apps = {a["name"]: a for a in schema["applications"]}
    assert set(apps) == {"pagedserve", "model-big", "model-small"}
    assert schema["http_options"]["port"] == 8123 and apps["pagedserve"]["route_prefix"] == "/"
    big = apps["model-big"]["deployments"][0]
    assert big["ray_actor_options"] == {"num_cpus": 4, "num_gpus": 2}  # TP 2 x 2 threads; 2 GPUs
    assert big["autoscaling_config"]["max_replicas"] == 3 and "num_replicas" not in big
    assert big["request_router_config"]["request_router_class"] == ROUTER_CLASS
    assert apps["model-big"]["args"]["engine"]["kv_cache_memory"] == 64 * 1024 * 1024
    small = apps["model-small"]["deployments"][0]
    assert small["num_replicas"] == 2
    assert small["ray_actor_options"] == {
        "num_cpus": 1,
        "num_gpus": 1,
        "resources": {"gpu_node": 1},
    }
    assert apps["model-small"]["route_prefix"] is None  # reached through the ingress only
    ingress = apps["pagedserve"]["deployments"][0]
    models = {m["name"]: m for m in ingress["user_config"]["models"]}
    assert models["big"]["routing"] == "round_robin" and models["small"]["routing"] == "prefix"
    assert apps["pagedserve"]["args"]["server"] == {"api_key": "sk-test"}


def test_no_gpus_means_no_gpu_request(config):
    schema = build_serve_config(config, cluster_has_gpus=False)
    big = next(a for a in schema["applications"] if a["name"] == "model-big")
    assert big["deployments"][0]["ray_actor_options"]["num_gpus"] == 0


def test_resizing_changes_only_the_replica_count_and_new_args_change_the_revision(config):
    """Serve restarts a model's replicas when its application's args change, and only then;
    the ingress re-reads a model when its revision changes."""
    before = build_serve_config(config)
    small = config.model("small")
    revision = small.revision
    small.num_replicas = 3
    after = build_serve_config(config)
    app = lambda s: next(a for a in s["applications"] if a["name"] == "model-small")  # noqa: E731
    assert app(before)["args"] == app(after)["args"] and small.revision == revision
    small.engine["max_model_len"] = 128
    assert small.revision != revision


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"models": []}, "non-empty list"),
        ({"modles": []}, "unknown field"),
        (
            {"models": [{"name": "a", "engine": {}}]},
            "engine.model \\(a model folder or a .gguf file\\) is required",
        ),
        ({"models": [{"name": "a", "engine": {"model": "/m", "dtyp": "x"}}]}, "dtyp"),
        ({"models": [{"name": "a", "engine": {"model": "/m"}, "replicas": 2}]}, "replicas"),
        ({"routing": "random", "models": [{"name": "a", "engine": {"model": "/m"}}]}, "routing"),
        (
            {"models": [{"name": "a", "engine": {"model": "/m"}}] * 2},
            "unique",
        ),
        ({"models": [{"name": "a/b", "engine": {"model": "/m"}}]}, "without '/'"),
    ],
)
def test_a_bad_config_is_refused_naming_what_is_wrong(change, message):
    data = {"models": [{"name": "a", "engine": {"model": "/m"}}], **change}
    with pytest.raises(ClusterConfigError, match=message):
        load_config(data)


def test_every_config_field_has_a_row_in_the_configuration_reference():
    from dataclasses import fields
    from pathlib import Path

    from pagedserve.cluster.config import ClusterConfig, ModelDeploymentConfig

    page = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    section = page.split("## Cluster config file", 1)[1].split("\n## ", 1)[0]
    rows = {
        line.split("|")[1].strip().strip("`")
        for line in section.splitlines()
        if line.startswith("| `")
    }
    names = {f.name for f in fields(ClusterConfig)} | {
        f.name for f in fields(ModelDeploymentConfig)
    }
    assert names <= rows, sorted(names - rows)


def test_the_cli_prints_ray_serves_config_and_plugs_into_pagedserves(tmp_path, capsys, monkeypatch):
    import argparse
    from importlib import metadata

    import yaml

    from pagedserve.cluster import cli
    from pagedserve.server import cli as server_cli

    path = tmp_path / "cluster.yaml"
    path.write_text(YAML)
    assert cli.main(["build", str(path)]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    ServeDeploySchema.model_validate(printed)
    assert [a["name"] for a in printed["applications"]] == [
        "pagedserve",
        "model-big",
        "model-small",
    ]
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: []\n")
    assert cli.main(["build", str(bad)]) == 2
    assert "non-empty list" in capsys.readouterr().err

    # `pagedserve cluster ...`: the server's parser takes the subcommand from the entry point
    entry = metadata.EntryPoint(
        name="cluster", value="pagedserve.cluster.cli:add_cluster_parser", group="pagedserve.cli"
    )
    monkeypatch.setattr(server_cli.metadata, "entry_points", lambda group: [entry])
    args = server_cli.build_parser().parse_args(["cluster", "deploy", str(path)])
    assert args.cluster_command == "deploy" and args.address == "auto"
    assert isinstance(args, argparse.Namespace)
    # and its failures are one line there too, not a traceback
    assert server_cli.main(["cluster", "build", str(bad)]) == 2
    assert capsys.readouterr().err == "pagedserve cluster: 'models' must be a non-empty list\n"
