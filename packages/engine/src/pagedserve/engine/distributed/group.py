"""The engine's process groups over torch.distributed, and the collectives a model uses.

The ranks are ``tp_size`` x ``pp_size``: tensor-parallel shards within each pipeline stage
(``ParallelLayout`` says which rank is which). Three groups join every rank:

- the *default* group, made at the rendezvous, carries start-up: the configs that rank 0 sends,
  weight loading (ranks may be minutes apart) and the block count they agree on. Its timeout is
  ``PAGEDSERVE_TP_STARTUP_TIMEOUT_S`` (600 s).
- the *step* group carries the model's collectives (all-reduce, all-gather) and each step's
  tensors once the model is up: NCCL for CUDA tensors, gloo for CPU tensors
  (``"cpu:gloo,cuda:nccl"`` where CUDA exists, plain gloo elsewhere).
- the *control* group (gloo, CPU) carries the small pickled message that says what comes next
  (a step, a keep-alive, stop).

Each stage's ranks have a group of their own (one for start-up, one for steps) for the
tensor-parallel all-reduces and gathers inside its layers; the hidden states go from stage to
stage by send/recv on a group of their own (the *links*, made like the step group).

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

import fcntl
import ipaddress
import os
import socket
import struct
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pagedserve.models import ModelConfig, ParallelContext
from pagedserve.models.pipeline import IntermediateTensors, PipelineStage

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


@contextmanager
def gloo_interface_towards(master_addr: str) -> Iterator[None]:
    """While the groups are made: ``GLOO_SOCKET_IFNAME`` (unless set) is the network interface
    this host reaches ``master_addr`` through, restored afterwards (the processes this one
    starts later, on other hosts perhaps, must not inherit it). Left alone, gloo binds to the
    address the host name resolves to, often 127.0.0.1 on a machine whose name is only in
    /etc/hosts: the ranks of other hosts could then never connect to this one. A loopback
    rendezvous (one machine) needs nothing."""
    if "GLOO_SOCKET_IFNAME" in os.environ or ipaddress.ip_address(master_addr).is_loopback:
        yield
        return
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((master_addr, 9))  # no packet is sent: this only picks the route
        local = probe.getsockname()[0]
    names = [name for _, name in socket.if_nameindex() if _interface_address(name) == local]
    if not names:  # no interface holds that address: gloo's own choice
        yield
        return
    os.environ["GLOO_SOCKET_IFNAME"] = names[0]
    try:
        yield
    finally:
        del os.environ["GLOO_SOCKET_IFNAME"]


def _interface_address(name: str) -> str | None:
    """The IPv4 address of interface ``name`` (Linux's SIOCGIFADDR), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
        except OSError:  # no IPv4 address on it
            return None
    return socket.inet_ntoa(packed[20:24])


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it), for a single-machine rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class ParallelLayout:
    """How the ranks split the model: ``tp_size`` ranks per pipeline stage, ``pp_size`` stages
    (``stage_layers``: each stage's decoder layers, decided by rank 0).

    Ranks are numbered stage group by stage group, ``tp_size`` consecutive ranks each, with
    rank 0's group holding the *last* stage (the LM head and the logits, which rank 0 samples
    from) and the following groups stages 0, 1, ...: with 2 stages of 2, ranks 0-1 run the
    last stage and ranks 2-3 the first.
    """

    tp_size: int
    pp_size: int = 1
    stage_layers: tuple[range, ...] | None = None  # None: one stage, every layer

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def stage_of(self, rank: int) -> int:
        return (rank // self.tp_size - 1) % self.pp_size

    def stage_ranks(self, stage: int) -> list[int]:
        first = ((stage + 1) % self.pp_size) * self.tp_size
        return list(range(first, first + self.tp_size))

    def pipeline_stage(self, rank: int) -> PipelineStage:
        index = self.stage_of(rank)
        if self.stage_layers is None:
            return PipelineStage()
        layers = self.stage_layers[index]
        return PipelineStage(index, self.pp_size, layers.start, layers.stop)

    def peer(self, rank: int, stage: int) -> int:
        """The rank of ``stage`` that holds the same tensor-parallel shard as ``rank``."""
        return self.stage_ranks(stage)[rank % self.tp_size]


class ParallelGroups:
    """This process's membership of the engine's process groups: its rank, the layout, and
    the groups its collectives run on.

    Collectives run on the start-up groups until ``finish_startup()``, then on the step
    groups; every rank switches at the same point of the program, so they always agree. A
    tensor-parallel collective (all-reduce, gather) runs over this rank's stage only; the
    step broadcast, the block-count minimum and the sends between stages over every rank.
    """

    def __init__(self, rank: int, layout: ParallelLayout) -> None:
        self.rank, self.layout = rank, layout
        self.world_size = layout.world_size
        self.tp_size = layout.tp_size
        self.stage = layout.pipeline_stage(rank)
        self.control = dist.new_group(backend="gloo", timeout=collective_timeout())
        # every rank creates every stage's group, in the same order (new_group is collective)
        startup = [dist.new_group(layout.stage_ranks(s)) for s in range(layout.pp_size)]
        self._steps = dist.new_group(timeout=collective_timeout())
        # the hidden states between stages: a group apart from the steps' broadcasts, since rank
        # 0 broadcasts step N+1 before it receives step N's hidden states, while the stage
        # before sends step N's before it receives N+1 (NCCL runs a group's operations in
        # the order each rank issued them: one group would deadlock; gloo matches by tag)
        self._links = dist.new_group(timeout=collective_timeout())
        steps = [
            dist.new_group(layout.stage_ranks(s), timeout=collective_timeout())
            for s in range(layout.pp_size)
        ]
        own = layout.stage_of(rank)
        self._stage_startup, self._stage_steps = startup[own], steps[own]
        self._current: dist.ProcessGroup | None = None  # None: the default group
        # time spent waiting for the previous stage's hidden states: this rank's bubble
        self.seconds_waiting_for_previous_stage = 0.0
        self._current_stage = self._stage_startup
        self._current_links: dist.ProcessGroup | None = None

    @classmethod
    def join(
        cls,
        rank: int,
        world_size: int,
        addr: str,
        port: int,
        layout: ParallelLayout | None = None,
        check_workers: Callable[[], None] = lambda: None,
    ) -> ParallelGroups:
        """Rendezvous with the other ranks; rank 0 gives the ``layout`` (every other rank
        receives it; none: one stage of ``world_size`` shards) and calls ``check_workers``
        while it waits."""
        if dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is already initialised in this process: one distributed "
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
        with gloo_interface_towards(addr):  # every gloo group is made inside
            dist.init_process_group(
                backend=backend(), store=store, rank=rank, world_size=world_size, timeout=timeout
            )
            message = [layout or ParallelLayout(world_size)]  # default: tensor parallel only
            dist.broadcast_object_list(message, src=0)
            return cls(rank, message[0])

    def finish_startup(self) -> None:
        """From now on collectives time out after ``PAGEDSERVE_TP_TIMEOUT_S``."""
        self._current, self._current_stage = self._steps, self._stage_steps
        self._current_links = self._links

    def parallel_context(self, config: ModelConfig) -> ParallelContext:
        """The model's collectives over this rank's stage (in rank order under
        ``config.batch_invariant``: :meth:`all_reduce_in_rank_order`) and the sends between
        stages of ``config``'s hidden states."""
        pipe = _StageLink(self, config) if self.layout.pp_size > 1 else None
        return ParallelContext(
            tp_rank=self.rank % self.tp_size,
            tp_size=self.tp_size,
            all_reduce=(
                self.all_reduce_in_rank_order if config.batch_invariant else self.all_reduce
            ),
            gather=self.all_gather_last_dim,
            reduce_min=self.min_over_ranks,
            stage=self.stage,
            send_to_next_stage=pipe.send if pipe else None,
            receive_from_previous_stage=pipe.receive if pipe else None,
        )

    def broadcast(self, x: torch.Tensor, async_op: bool = False):
        """From rank 0 to every rank (a step's batch); with ``async_op``, the work to wait on."""
        return dist.broadcast(x, src=0, group=self._current, async_op=async_op)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the stage's ranks, in place (``x`` is a fresh activation nobody else
        holds)."""
        x = x.contiguous()
        dist.all_reduce(x, group=self._current_stage)
        return x

    def all_reduce_in_rank_order(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the stage's ranks as ``((x_0 + x_1) + x_2) + ...`` for every element.
        An all-reduce's order follows where an element falls in the buffer (a ring reduces
        each chunk starting at another rank), and so the batch's size: with three ranks or more
        a row's sum would change with its batch. Every rank gathers all the parts and adds them
        in rank order instead (``tp_size`` times the traffic of a ring's reduce-scatter)."""
        if x.numel() == 0:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self._current_stage)
        total = parts[0]
        for part in parts[1:]:
            total += part
        return total

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Every stage rank's ``x`` concatenated along the last dimension, in rank order."""
        shape = (*x.shape[:-1], x.shape[-1] * self.tp_size)
        if x.numel() == 0:  # every rank has the same empty shape: nothing to exchange
            return x.new_empty(shape)
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self._current_stage)
        return torch.cat(parts, dim=-1)

    def min_over_ranks(self, value: int) -> int:
        """The smallest ``value`` over every rank of every stage."""
        t = torch.tensor([value], dtype=torch.int64)  # CPU: goes over gloo whatever the device
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._current)
        return int(t.item())

    def send(self, x: torch.Tensor, dst: int) -> None:
        dist.send(x, dst=dst, group=self._current_links)

    def receive_into(self, x: torch.Tensor, src: int) -> None:
        dist.recv(x, src=src, group=self._current_links)

    def gather_objects(self, value) -> list:
        """Every rank's ``value`` on every rank, in rank order (start-up facts: bytes held)."""
        values = [None] * self.world_size
        dist.all_gather_object(values, value, group=self._current)
        return values

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class _StageLink:
    """A step's ``IntermediateTensors`` from this rank to its peer in the next stage, and from
    its peer in the previous one: hidden states and residual stacked in one tensor, one send
    per step and stage boundary."""

    def __init__(self, groups: ParallelGroups, config: ModelConfig) -> None:
        layout, rank, stage = groups.layout, groups.rank, groups.stage.index
        self.groups = groups
        self.next = layout.peer(rank, stage + 1) if not groups.stage.is_last else None
        self.previous = layout.peer(rank, stage - 1) if not groups.stage.is_first else None
        self.hidden_size, self.dtype = config.hidden_size, config.torch_dtype
        self.device = config.torch_device

    def send(self, t: IntermediateTensors) -> None:
        both = torch.stack([t.hidden, t.residual])
        if both.dtype != self.dtype:  # the receiver reads the bytes as the model's dtype
            raise RuntimeError(f"a stage's output is {both.dtype}, the model's dtype {self.dtype}")
        self.groups.send(both, self.next)

    def receive(self, num_tokens: int) -> IntermediateTensors:
        shape = (2, num_tokens, self.hidden_size)
        both = torch.empty(shape, dtype=self.dtype, device=self.device)
        start = time.perf_counter()
        self.groups.receive_into(both, self.previous)
        self.groups.seconds_waiting_for_previous_stage += time.perf_counter() - start
        return IntermediateTensors(both[0], both[1])


def _wait_for_workers(store, world_size: int, timeout: timedelta, check_workers) -> None:
    keys = [f"pagedserve/joined/{rank}" for rank in range(1, world_size)]
    deadline = time.monotonic() + timeout.total_seconds()
    while not store.check(keys):
        check_workers()
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"workers did not join within {timeout.total_seconds():.0f} s "
                "(PAGEDSERVE_TP_STARTUP_TIMEOUT_S); are all ranks started with the same "
                "MASTER_ADDR, MASTER_PORT and WORLD_SIZE?"
            )
        time.sleep(JOIN_POLL_S)


@dataclass(frozen=True)
class RankMemory:
    """What one rank holds once loaded: its layers, its weights' and its KV cache's bytes."""

    rank: int
    stage: int
    layers: range
    weight_bytes: int
    kv_cache_bytes: int

    def __str__(self) -> str:
        mib = 1 << 20
        return (
            f"rank {self.rank}: stage {self.stage}, layers {self.layers.start}-"
            f"{self.layers.stop - 1}, weights {self.weight_bytes / mib:.1f} MiB, KV cache "
            f"{self.kv_cache_bytes / mib:.1f} MiB"
        )


def memory_of_ranks(groups: ParallelGroups, runner) -> list[RankMemory]:
    """Every rank's ``RankMemory``, in rank order (a collective: every rank calls it once its
    runner is built)."""
    model, config = runner.model, runner.model_config
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    weight_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    kv_bytes = sum(t.numel() * t.element_size() for layer in runner.kv_caches for t in layer)
    layers = groups.stage.layer_range(config.num_layers)
    mine = RankMemory(groups.rank, groups.stage.index, layers, weight_bytes, kv_bytes)
    return groups.gather_objects(mine)
