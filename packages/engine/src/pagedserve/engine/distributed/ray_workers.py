"""Workers as Ray actors, placed over the nodes of a Ray cluster (``--distributed-executor-backend
ray``, as vLLM's).

The engine's process stays rank 0, where it runs (on the head node, typically): it schedules and
samples and holds the last pipeline stage. Ranks 1..world_size-1 are actors, one per rank, in a
placement group of one bundle per rank (``PACK``: as many as fit on one node together, the rest
on the next nodes; a bundle asks for a GPU on CUDA, else for ``PAGEDSERVE_TP_THREADS`` CPUs).
Once placed, each actor says which node it landed on; ranks are handed out with the actors on
rank 0's node first, then node by node, so a stage's tensor-parallel ranks (consecutive ranks)
share a node where they can and the stages are what crosses between nodes.

Each actor then runs the same worker loop as a local worker process (worker.py), with the
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` it is given: the rendezvous is rank 0's
node address and a free port there, so every node must reach that address (and have pagedserve
and the model folder at the same path). An actor that dies (its node gone, killed) ends its
``run`` call with an error, which ``exited`` reports, as a local worker's exit code is; ``kill``
kills every actor and removes the placement group.

Ray is connected to as ``ray.init()`` finds it: ``RAY_ADDRESS``, else the cluster ``ray start``
last started on this machine, else a new local one.
"""

from __future__ import annotations

import os
import socket

import torch

PLACEMENT_TIMEOUT_S = 300.0  # how long to wait for the cluster to hold every bundle


class RankActor:
    """One rank's process on a Ray node (wrapped by ``ray.remote`` when launched)."""

    def node(self) -> tuple[str, str]:
        """The Ray node this actor runs on: its id and its address."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def run(self, env: dict[str, str]) -> int:
        """The worker loop until rank 0 says stop: 0, or 1 when it failed (logged here)."""
        from pagedserve.engine.distributed.worker import main

        os.environ.update(env)
        return main()


class RayWorkers:
    """Ranks 1..world_size-1 as Ray actors (``nodes``: rank -> the Ray node id it runs on);
    ``exited``, ``wait`` and ``kill`` as ``WorkerProcesses``. An actor runs one call at a
    time, and ``run`` lasts as long as the engine: nothing else is asked of it after."""

    def __init__(self, actors: dict, runs: dict, nodes: dict, placement_group) -> None:
        self.actors, self.runs, self.nodes = actors, runs, nodes
        self.placement_group = placement_group

    @classmethod
    def launch(cls, world_size: int, cuda: bool) -> tuple[RayWorkers, str, int]:
        """Place and start the actors; returns them and the rendezvous address and port."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            ray.init(log_to_driver=False)
        threads = int(
            os.environ.get("PAGEDSERVE_TP_THREADS") or max(1, torch.get_num_threads() // world_size)
        )
        bundle = {"GPU": 1.0} if cuda else {"CPU": float(threads)}
        group = placement_group([bundle] * (world_size - 1), strategy="PACK")
        ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            remove_placement_group(group)
            raise TimeoutError(
                f"the Ray cluster could not place {world_size - 1} workers of {bundle} within "
                f"{PLACEMENT_TIMEOUT_S:.0f} s: it has {ray.available_resources()} available"
            )
        actor_cls = ray.remote(RankActor)
        actors = [
            actor_cls.options(
                num_cpus=0 if cuda else threads,
                num_gpus=1 if cuda else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, i),
            ).remote()
            for i in range(world_size - 1)
        ]
        nodes = ray.get([a.node.remote() for a in actors])
        here = ray.get_runtime_context().get_node_id()
        order = sorted(range(len(actors)), key=lambda i: (nodes[i][0] != here, nodes[i]))
        address = ray.util.get_node_ip_address()
        port = _free_port(address)
        by_rank, runs, node_of = {}, {}, {}
        for rank, i in enumerate(order, start=1):
            env = dict(
                RANK=str(rank),
                LOCAL_RANK="0",  # on CUDA the actor sees the one GPU Ray gave it
                WORLD_SIZE=str(world_size),
                MASTER_ADDR=address,
                MASTER_PORT=str(port),
                PAGEDSERVE_TP_THREADS=str(threads),
            )
            by_rank[rank], node_of[rank] = actors[i], nodes[i][0]
            runs[rank] = actors[i].run.remote(env)
        return cls(by_rank, runs, node_of, group), address, port

    def exited(self) -> dict[int, str]:
        """rank -> how it ended, for every actor whose worker loop is over."""
        import ray

        ended = {}
        for rank, ref in self.runs.items():
            done, _ = ray.wait([ref], timeout=0)
            if not done:
                continue
            try:
                ended[rank] = f"exited with code {ray.get(ref)} (its log is in Ray's worker logs)"
            except ray.exceptions.RayError as e:
                ended[rank] = f"(a Ray actor) died: {type(e).__name__}"
        return ended

    def wait(self, timeout: float) -> bool:
        import ray

        _, pending = ray.wait(list(self.runs.values()), num_returns=len(self.runs), timeout=timeout)
        return not pending

    def kill(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if not ray.is_initialized():  # Ray went down first: its actors went with it
            return
        for actor in self.actors.values():
            ray.kill(actor)
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None
        self.actors = {}


def _free_port(address: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])
