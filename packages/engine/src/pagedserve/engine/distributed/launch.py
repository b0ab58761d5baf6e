"""Where the workers come from: local processes (the default), or ranks started elsewhere.

``Rendezvous`` says where the ranks meet (``MASTER_ADDR:MASTER_PORT``, a free loopback port by
default) and whether this engine starts the workers itself. ``WorkerProcesses`` starts ranks
1..world_size-1 as ``python -m pagedserve.engine.distributed.worker`` processes on this
machine; ray_workers.py places them as Ray actors over a cluster instead. Both answer the
executor the same three questions: which ranks have ended and how (``exited``), ``wait`` for a
clean stop, and ``kill``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import torch

from pagedserve.engine.distributed.group import free_loopback_port


@dataclass
class Rendezvous:
    addr: str
    port: int
    external_workers: bool  # True: the other ranks are started by someone else

    @classmethod
    def from_environment(cls, world_size: int) -> Rendezvous:
        env = os.environ
        external = "WORLD_SIZE" in env
        if external and int(env["WORLD_SIZE"]) != world_size:
            raise ValueError(
                f"WORLD_SIZE={env['WORLD_SIZE']} but tensor_parallel_size x "
                f"pipeline_parallel_size = {world_size}: they must match"
            )
        if external and int(env.get("RANK", "0")) != 0:
            raise ValueError(
                f"this process has RANK={env['RANK']}: only rank 0 runs the engine; start the "
                "others with `python -m pagedserve.engine.distributed.worker`"
            )
        if "MASTER_ADDR" in env and "MASTER_PORT" in env:
            return cls(env["MASTER_ADDR"], int(env["MASTER_PORT"]), external)
        if external:
            raise ValueError("WORLD_SIZE is set: set MASTER_ADDR and MASTER_PORT too")
        return cls("127.0.0.1", free_loopback_port(), external)


class WorkerProcesses:
    """The worker processes this engine started (none when the workers are external)."""

    def __init__(self, procs: dict[int, subprocess.Popen]) -> None:
        self.procs = procs

    @classmethod
    def launch(cls, world_size: int, rv: Rendezvous) -> WorkerProcesses:
        procs = {}
        threads = max(1, torch.get_num_threads() // world_size)  # the cores, shared out
        for rank in range(1, world_size):
            env = dict(os.environ)
            env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world_size),
                MASTER_ADDR=rv.addr,
                MASTER_PORT=str(rv.port),
                PAGEDSERVE_TP_THREADS=env.get("PAGEDSERVE_TP_THREADS", str(threads)),
            )
            procs[rank] = subprocess.Popen(
                [sys.executable, "-m", "pagedserve.engine.distributed.worker"],
                env=env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C reaches rank 0, which stops the workers
            )
        return cls(procs)

    def exited(self) -> dict[int, str]:
        """rank -> how it ended, for every worker that is no longer running."""
        codes = {rank: p.poll() for rank, p in self.procs.items()}
        return {
            rank: f"exited with code {code} (its log is on stderr above)"
            for rank, code in codes.items()
            if code is not None
        }

    def wait(self, timeout: float) -> bool:
        try:
            for p in self.procs.values():
                p.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def kill(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        for p in self.procs.values():
            p.wait()
