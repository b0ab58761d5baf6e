"""``pagedserve cluster serve|deploy|build CONFIG``: the cluster from the command line.

- ``serve``: start a Ray head here (or join one with ``--address``), deploy the config, print
  the endpoint, and keep running until interrupted; a Ray instance it started stops with it.
- ``deploy``: apply an edited config to a running cluster (``--address auto`` from one of its
  nodes) and return once every model is served: models added, resized or removed in place.
- ``build``: print the Ray Serve config the file becomes (for ``serve deploy``, or to read).
- ``status``: join a running cluster and print its models' applications and every replica: its
  state, process id and node (Ray's ``ray list actors`` needs the dashboard, which is off).

A deploy that cannot finish says why in one line: replicas the cluster can never place (before
anything is deployed, when ``serve`` started the cluster itself), replicas waiting for resources
(within seconds, with their demand and what the cluster has), a failed or timed-out deploy.

The server's CLI finds this subcommand through the ``pagedserve.cli`` entry point, so that the
server never imports the cluster.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Callable

from pagedserve.cluster.config import ClusterConfigError, build_serve_config, load_config


def add_cluster_parser(sub) -> None:
    cluster = sub.add_parser(
        "cluster",
        help="replicas of several models behind one OpenAI endpoint, on Ray Serve",
        description="Replicas of several models behind one OpenAI-compatible endpoint.",
    )
    commands = cluster.add_subparsers(dest="cluster_command", required=True)
    for name, func, help_ in (
        ("serve", cmd_serve, "start or join a Ray cluster, deploy, and keep serving"),
        ("deploy", cmd_deploy, "apply a config to a running cluster, then return"),
        ("build", cmd_build, "print the Ray Serve config that the file becomes"),
    ):
        parser = commands.add_parser(name, help=help_, description=help_)
        parser.add_argument("config", help="the cluster's YAML config file")
        if name != "build":
            parser.add_argument(
                "--address",
                default=None if name == "serve" else "auto",
                help="Ray cluster to join: auto (the one this node is part of) or HOST:PORT "
                "(default: serve starts a local head, deploy joins auto)",
            )
            parser.add_argument(
                "--timeout", type=float, default=600.0, help="seconds to wait for every model"
            )
        parser.set_defaults(func=_in_one_line(func))
    status = commands.add_parser(
        "status", help="models, replicas, their PIDs and nodes", description=cmd_status.__doc__
    )
    status.add_argument("--address", default="auto", help="Ray cluster to join (default: auto)")
    status.set_defaults(func=_in_one_line(cmd_status))


def _in_one_line(command: Callable[[argparse.Namespace], int]) -> Callable:
    """``command`` whose expected failures are one line on stderr, not a traceback: a bad
    config or a placement that can never be (exit 2), a deploy that failed or timed out (1)."""

    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except ClusterConfigError as error:
            print(f"pagedserve cluster: {error}", file=sys.stderr)
            return 2
        except (TimeoutError, RuntimeError) as error:
            print(f"pagedserve cluster: {error}", file=sys.stderr)
            return 1

    return run


def cmd_status(args: argparse.Namespace) -> int:
    """Print each application's status and every replica: state, process id, node."""
    from ray import serve

    from pagedserve.cluster.deploy import connect
    from pagedserve.cluster.placement import deployment_demands, replicas, show_resources

    connect(args.address)
    applications = serve.status().applications
    demands = deployment_demands()
    by_app: dict[str, list] = {}
    for replica in replicas():
        by_app.setdefault(replica.app, []).append(replica)
    for name, app in sorted(applications.items()):
        print(f"{name}: {getattr(app.status, 'value', app.status)}")
        for replica in by_app.get(name, []):
            if replica.pid:
                where = f"pid {replica.pid} on {replica.node_ip}"
            else:  # waiting to be placed: what it waits for
                demand = demands.get((replica.app, replica.deployment))
                where = "not placed" + (f", needs {show_resources(demand)}" if demand else "")
            print(f"  {replica.deployment} replica {replica.state}: {where}")
    if not applications:
        print("no applications deployed")
    return 0


def cmd_build(args: argparse.Namespace) -> int:
    import yaml

    schema = build_serve_config(load_config(args.config))
    yaml.safe_dump(schema, sys.stdout, sort_keys=False)
    return 0


def cmd_deploy(args: argparse.Namespace) -> int:
    from pagedserve.cluster.deploy import connect, deploy

    config = load_config(args.config)
    connect(args.address)
    deploy(config, timeout_s=args.timeout)
    print(f"deployed {[m.name for m in config.models]} at http://{config.host}:{config.port}/v1")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import ray

    from pagedserve.cluster.deploy import connect, deploy, shutdown

    config = load_config(args.config)
    connect(args.address)
    # after ray.init, which installs a SIGTERM handler of its own: stop as on Ctrl-C instead
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        deploy(config, timeout_s=args.timeout, local=args.address is None)
        print(f"serving {[m.name for m in config.models]} at http://{config.host}:{config.port}/v1")
        sys.stdout.flush()
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        if args.address is None:  # the Ray instance is this process's: stop it with us
            shutdown()
            ray.shutdown()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedserve")
    add_cluster_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["cluster", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
