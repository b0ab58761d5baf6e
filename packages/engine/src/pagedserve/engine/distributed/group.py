"""The tensor-parallel process group over torch.distributed, and the collectives a model uses.

Three groups join the same ranks:

- the *default* group, made at the rendezvous, carries start-up: the configs that rank 0 sends,
  weight loading (ranks may be minutes apart) and the block count they agree on. Its timeout is
  ``PAGEDSERVE_TP_STARTUP_TIMEOUT_S`` (600 s).
- the *step* group carries the model's collectives (all-reduce, all-gather) and each step's
  tensors once the model is up: NCCL for CUDA tensors, gloo for CPU tensors
  (``"cpu:gloo,cuda:nccl"`` where CUDA exists, plain gloo elsewhere).
- the *control* group (gloo, CPU) carries the small pickled message that says what comes next
  (a step, a keep-alive, stop).

The step and control groups time out after ``PAGEDSERVE_TP_TIMEOUT_S`` (120 s by default):
inside a step the ranks are never more than a layer apart, so a collective that waits that long
means a rank is stuck or gone, and it fails instead of hanging. A rank that exits fails its
peers' collectives at once (gloo sees the closed connection). An idle engine keeps its workers'
wait short with keep-alive messages (see ``executor``).

Rendezvous is a TCP store at ``MASTER_ADDR:MASTER_PORT`` hosted by rank 0 (the ``env://``
variables, as torchrun sets them); ranks are ``RANK`` of ``WORLD_SIZE``. Each worker checks in
with a key; rank 0 polls for them and for dead local workers, so a worker that crashes while
starting is reported at once rather than after the start-up timeout.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from pagedserve.models import ParallelContext

DEFAULT_TIMEOUT_S = 120.0
DEFAULT_STARTUP_TIMEOUT_S = 600.0
JOIN_POLL_S = 0.05


def _seconds_from_env(name: str, default: float) -> timedelta:
    raw = os.environ.get(name, "")
    try:
        seconds = float(raw) if raw else default
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {raw!r}") from None
    if seconds <= 0:
        raise ValueError(f"{name} must be positive, got {raw!r}")
    return timedelta(seconds=seconds)


def collective_timeout() -> timedelta:
    """The in-step collective timeout: ``PAGEDSERVE_TP_TIMEOUT_S`` seconds, 120 by default."""
    return _seconds_from_env("PAGEDSERVE_TP_TIMEOUT_S", DEFAULT_TIMEOUT_S)


def startup_timeout() -> timedelta:
    """Rendezvous and loading: ``PAGEDSERVE_TP_STARTUP_TIMEOUT_S`` seconds, 600 by default."""
    return _seconds_from_env("PAGEDSERVE_TP_STARTUP_TIMEOUT_S", DEFAULT_STARTUP_TIMEOUT_S)


def backend() -> str:
    """NCCL for CUDA tensors where CUDA and NCCL exist; gloo for CPU tensors always."""
    if torch.cuda.is_available() and dist.is_nccl_available():
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it), for a single-machine rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TensorParallelGroup:
    """This process's membership of the tensor-parallel group: rank, size and the groups.

    Collectives run on the default group until ``finish_startup()``, then on the step group;
    every rank switches at the same point of the program, so they always agree.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.control = dist.new_group(backend="gloo", timeout=collective_timeout())
        self._steps = dist.new_group(timeout=collective_timeout())
        self._current: dist.ProcessGroup | None = None  # None: the default group

    @classmethod
    def join(
        cls,
        rank: int,
        world_size: int,
        addr: str,
        port: int,
        check_workers: Callable[[], None] = lambda: None,
    ) -> TensorParallelGroup:
        """Rendezvous with the other ranks; rank 0 calls ``check_workers`` while it waits."""
        if dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is already initialised in this process: one tensor-parallel "
                "engine per process (shut the previous one down first)"
            )
        timeout = startup_timeout()
        store = dist.TCPStore(
            addr, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False
        )
        if rank == 0:
            _wait_for_workers(store, world_size, timeout, check_workers)
        else:
            store.set(f"pagedserve/joined/{rank}", "1")
        dist.init_process_group(
            backend=backend(), store=store, rank=rank, world_size=world_size, timeout=timeout
        )
        return cls(rank, world_size)

    def finish_startup(self) -> None:
        """From now on collectives time out after ``PAGEDSERVE_TP_TIMEOUT_S``."""
        self._current = self._steps

    def parallel_context(self, batch_invariant: bool = False) -> ParallelContext:
        """The model's collectives; ``batch_invariant``: sums in rank order
        (:meth:`all_reduce_in_rank_order`)."""
        return ParallelContext(
            tp_rank=self.rank,
            tp_size=self.world_size,
            all_reduce=self.all_reduce_in_rank_order if batch_invariant else self.all_reduce,
            gather=self.all_gather_last_dim,
            reduce_min=self.min_over_ranks,
        )

    def broadcast(self, x: torch.Tensor) -> None:
        dist.broadcast(x, src=0, group=self._current)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (``x`` is a fresh activation nobody else holds)."""
        x = x.contiguous()
        dist.all_reduce(x, group=self._current)
        return x

    def all_reduce_in_rank_order(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks as ``((x_0 + x_1) + x_2) + ...`` for every element. An
        all-reduce's order follows where an element falls in the buffer (a ring reduces each
        chunk starting at another rank), and so the batch's size: with three ranks or more a
        row's sum would change with its batch. Every rank gathers all the parts and adds them
        in rank order instead (``world_size`` times the traffic of a ring's reduce-scatter)."""
        if x.numel() == 0:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self._current)
        total = parts[0]
        for part in parts[1:]:
            total += part
        return total

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` concatenated along the last dimension, in rank order."""
        shape = (*x.shape[:-1], x.shape[-1] * self.world_size)
        if x.numel() == 0:  # every rank has the same empty shape: nothing to exchange
            return x.new_empty(shape)
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self._current)
        return torch.cat(parts, dim=-1)

    def min_over_ranks(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)  # CPU: goes over gloo whatever the device
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._current)
        return int(t.item())

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _wait_for_workers(store, world_size: int, timeout: timedelta, check_workers) -> None:
    keys = [f"pagedserve/joined/{rank}" for rank in range(1, world_size)]
    deadline = time.monotonic() + timeout.total_seconds()
    while not store.check(keys):
        check_workers()
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"tensor-parallel workers did not join within {timeout.total_seconds():.0f} s "
                "(PAGEDSERVE_TP_STARTUP_TIMEOUT_S); are all ranks started with the same "
                "MASTER_ADDR, MASTER_PORT and WORLD_SIZE?"
            )
        time.sleep(JOIN_POLL_S)
