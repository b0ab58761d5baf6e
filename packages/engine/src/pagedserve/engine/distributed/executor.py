"""DistributedExecutor: rank 0 of a tensor- and pipeline-parallel group, in the engine's process.

The engine talks to it as it talks to a ``ModelRunner`` (``execute``, ``input_batch``,
``num_blocks``, ``device``): rank 0 keeps the scheduler and the sampling state, flattens each
step, broadcasts the batch to every other rank (``step_channel``) and runs its own part of the
forward alongside them. Within a pipeline stage the row-parallel all-reduces and the LM head's
gather join the tensor-parallel shards inside the model; between stages the hidden states go
from rank to rank (group.py). Rank 0 holds the last stage, so the logits end where they are
sampled: only rank 0 samples.

With P pipeline stages the engine keeps up to P steps in flight (``max_steps_in_flight``):
``submit`` lays a step out and starts its broadcast, and returns at once; ``collect`` runs
rank 0's part of it (the last stage: it waits for the hidden states of the stage before) and
samples. So while rank 0 finishes step N, the first stage already computes step N+1; with one
step at a time each stage would idle (P - 1) / P of every step (the pipeline "bubble").
The scheduler gives no request a second step while its first is in flight
(scheduler/in_flight.py); docs/parallelism.md has the figures.

Workers are ``python -m pagedserve.engine.distributed.worker`` processes, started here, one per
rank 1..world_size-1, on this machine (launch.py; rendezvous on 127.0.0.1 at a free port unless
MASTER_ADDR and MASTER_PORT are set), or Ray actors placed over a Ray cluster's nodes with
``backend="ray"`` (ray_workers.py). When ``WORLD_SIZE`` is set in the environment the workers
are started elsewhere (other machines, torchrun) and this process joins as rank 0 of that group.

A worker that exits, or a collective that times out, fails the step with a
``DistributedError`` (an ``EngineError``) that says which rank and why; the group is then
unusable and the engine must be restarted. It never hangs. Since the workers' wait for the next
step is bounded by the same timeout, an idle engine (no step in flight) sends them a keep-alive
message every quarter timeout (a background thread; a lock keeps it from interleaving with a
step).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagedserve.blockmgr import CacheConfig
from pagedserve.engine.distributed.group import (
    ParallelGroups,
    ParallelLayout,
    collective_timeout,
    memory_of_ranks,
)
from pagedserve.engine.distributed.launch import Rendezvous, WorkerProcesses
from pagedserve.engine.distributed.ray_workers import RayWorkers
from pagedserve.engine.distributed.step_channel import SentStep, Step, StepSender
from pagedserve.engine.errors import DistributedError
from pagedserve.engine.input_batch import InputBatch
from pagedserve.engine.model_input import ModelInput
from pagedserve.engine.model_runner import ModelRunner
from pagedserve.engine.outputs import ModelRunnerOutput
from pagedserve.engine.sample_step import LogitsLayout
from pagedserve.models import ModelConfig, ParallelContext
from pagedserve.models.loader import MODEL_CLASSES
from pagedserve.models.pipeline import partition_layers
from pagedserve.models.registry import ARCHITECTURES
from pagedserve.scheduler import SchedulerOutput

logger = logging.getLogger("pagedserve.engine")

STOP_GRACE_S = 10.0  # how long shutdown waits for workers to exit before killing them


def plan_layout(
    model_config: ModelConfig,
    tp_size: int,
    pp_size: int = 1,
    layer_partition: str | None = None,
    backend: str = "mp",
) -> ParallelLayout:
    """The ranks' layout for the model, or ValueError now if it cannot be split so.

    Builds rank 0's part (the last stage's shard) on the meta device (no memory, no weights),
    so every layer's own divisibility check runs before any process is started. With the
    local (``mp``) backend on CUDA, this machine must have a GPU per rank.
    """
    if tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp_size}")
    architecture = ARCHITECTURES[model_config.hf_architecture]
    for size, name, supported in (
        (tp_size, "tensor", architecture.tensor_parallel),
        (pp_size, "pipeline", architecture.pipeline_parallel),
    ):
        if size > 1 and not supported:
            served = [n for n, a in ARCHITECTURES.items() if getattr(a, f"{name}_parallel")]
            raise ValueError(
                f"{model_config.hf_architecture} runs without {name} parallelism "
                f"({name}_parallel_size 1); {name} parallelism serves {', '.join(served)}"
            )
    stage_layers = partition_layers(model_config.num_layers, pp_size, layer_partition)
    layout = ParallelLayout(tp_size, pp_size, tuple(stage_layers) if pp_size > 1 else None)
    model_cls = MODEL_CLASSES[model_config.arch]
    with torch.device("meta"):
        stage = layout.pipeline_stage(0)
        model_cls(model_config, ParallelContext(tp_rank=0, tp_size=tp_size, stage=stage))
    local = backend == "mp" and "WORLD_SIZE" not in os.environ
    if model_config.torch_device.type == "cuda" and local:
        available = torch.cuda.device_count()
        if layout.world_size > available:
            raise ValueError(
                f"tensor_parallel_size x pipeline_parallel_size = {layout.world_size} needs "
                f"{layout.world_size} GPUs; {available} seen"
            )
    return layout


@dataclass
class SubmittedStep:
    """A step handed to the ranks: its batch and logits layout (None: nothing to run) and
    its broadcast under way."""

    output: SchedulerOutput
    prepared: tuple[ModelInput, LogitsLayout] | None
    sent: SentStep


class DistributedExecutor:
    """Rank 0: schedules in this process, runs its part here (the last stage's first shard),
    drives the workers' parts. ``rank_memory``: what each rank holds, gathered at start-up."""

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        tp_size: int,
        pp_size: int = 1,
        layer_partition: str | None = None,
        extra_block_bytes: int = 0,
        drafter=None,
        backend: str = "mp",
    ):
        layout = plan_layout(model_config, tp_size, pp_size, layer_partition, backend)
        self.workers, rv = _start_workers(layout.world_size, model_config, backend)
        self._finalizer = weakref.finalize(self, self.workers.kill)
        self.group: ParallelGroups | None = None
        self._failed: DistributedError | None = None
        try:
            self.group = ParallelGroups.join(
                0, layout.world_size, rv.addr, rv.port, layout, self._raise_if_worker_exited
            )
            configs = [(model_config, cache_config)]
            dist.broadcast_object_list(configs, src=0, group=self.group.control)
            self.driver = ModelRunner(  # a draft model's cache lives on rank 0 only
                model_config,
                cache_config,
                self.group.parallel_context(model_config),
                extra_block_bytes=extra_block_bytes,
                drafter=drafter,
            )
            self.rank_memory = memory_of_ranks(self.group, self.driver)
            self.group.finish_startup()
        except Exception as e:
            error = self._failure("starting the distributed group", e)
            self._abort()
            if isinstance(e, RuntimeError):  # a worker died, a collective failed
                raise error from e
            raise  # a bad model folder, a timeout at the rendezvous: the error as it is
        self.sender = StepSender(self.group)
        self.max_steps_in_flight = pp_size  # a step per stage (the module docstring)
        self._num_in_flight = 0  # submitted, not yet collected
        self._lock = threading.Lock()  # one message sequence at a time: a step or a keep-alive
        self._last_sent = time.monotonic()
        self._closing = threading.Event()
        self._keep_alive_thread = threading.Thread(
            target=self._keep_alive, name="pagedserve-keep-alive", daemon=True
        )
        self._keep_alive_thread.start()
        logger.info(
            "%d ranks (tensor parallel %d x pipeline parallel %d), %d KV blocks each",
            layout.world_size, tp_size, pp_size, self.num_blocks,
        )  # fmt: skip
        for memory in self.rank_memory:
            logger.info("%s", memory)

    @property
    def num_blocks(self) -> int:
        return self.driver.num_blocks

    @property
    def device(self) -> torch.device:
        return self.driver.device

    @property
    def input_batch(self) -> InputBatch:
        return self.driver.input_batch

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """One step on every rank, sampled on rank 0."""
        return self.collect(self.submit(output))

    @torch.inference_mode()
    def submit(self, output: SchedulerOutput) -> SubmittedStep:
        """Lay the step out and start sending it to every rank; returns without waiting."""
        prepared = self.driver.begin_step(output)
        if prepared is None:  # nothing runnable: the workers have nothing to do
            return SubmittedStep(output, None, SentStep())
        model_input, _ = prepared
        with self._lock:
            self._raise_if_unusable()
            try:
                sent = self.sender.send(Step(model_input, output.blocks_to_copy))
            except Exception as e:
                self._fail("sending a step", e)
                raise self._failed from e
            self._num_in_flight += 1
            self._last_sent = time.monotonic()
        return SubmittedStep(output, prepared, sent)

    @torch.inference_mode()
    def collect(self, submitted: SubmittedStep) -> ModelRunnerOutput:
        """Rank 0's part of a submitted step (the last stage), then its sampling."""
        if submitted.prepared is None:
            return ModelRunnerOutput()
        model_input, layout = submitted.prepared
        with self._lock:
            self._raise_if_unusable()
            try:
                logits = self.driver.execute_model(model_input, submitted.output.blocks_to_copy)
                submitted.sent.wait()
            except Exception as e:
                self._fail("running a step", e)
                raise self._failed from e
            self._num_in_flight -= 1
        return self.driver.sample(layout, logits)

    def _raise_if_unusable(self) -> None:
        if self._failed is not None:
            raise DistributedError(f"the distributed group failed: {self._failed}")
        self._raise_if_worker_exited()

    def shutdown(self) -> None:
        """Stop the workers (a stop message, then a kill after a grace period) and the group."""
        self._closing.set()
        with self._lock:
            if self.group is None:
                return
            if self._failed is None and not self.workers.exited():
                try:
                    self.sender.stop()
                except Exception:  # a worker gone at the last moment: the kill below is enough
                    logger.warning("could not send the stop message to the workers")
            if not self.workers.wait(STOP_GRACE_S):
                logger.warning("workers did not stop in %.0f s", STOP_GRACE_S)
            self._abort()
        self._keep_alive_thread.join()

    def _keep_alive(self) -> None:
        """While idle, tell the workers every quarter timeout that rank 0 is still here."""
        interval = collective_timeout().total_seconds() / 4
        while not self._closing.wait(interval / 2):
            with self._lock:
                if self._failed is not None or self.group is None:
                    return
                if self._num_in_flight or time.monotonic() - self._last_sent < interval:
                    continue  # a step in flight: the workers are busy, not waiting
                try:
                    self._raise_if_worker_exited()
                    self.sender.keep_alive()
                except Exception as e:
                    if self._failed is None:
                        self._fail("idle", e)
                    return
                self._last_sent = time.monotonic()

    # ---- failure -------------------------------------------------------------------------

    def _raise_if_worker_exited(self) -> None:
        exited = self.workers.exited()
        if exited:
            self._failed = DistributedError(_describe_exits(exited))
            self._abort()
            raise self._failed

    def _fail(self, during: str, error: Exception) -> None:
        """Record why the group is unusable and tear it down (the caller holds the lock)."""
        self._failed = self._failure(during, error)
        logger.error("%s", self._failed)
        self._abort()

    def _failure(self, during: str, error: Exception) -> DistributedError:
        exited = self.workers.exited()
        if exited:
            reason = _describe_exits(exited)
        else:
            timeout = collective_timeout().total_seconds()
            reason = (
                f"{type(error).__name__}: {error} (no worker has exited: a collective timed out "
                f"or failed, or this rank's step raised; in-step collectives give up after "
                f"PAGEDSERVE_TP_TIMEOUT_S = {timeout:g} s)"
            )
        return DistributedError(f"distributed execution failed while {during}: {reason}")

    def _abort(self) -> None:
        self.workers.kill()
        if self.group is not None:
            self.group.close()
            self.group = None


def _start_workers(world_size: int, model_config: ModelConfig, backend: str):
    """Ranks 1..world_size-1 started (as processes here, or Ray actors) or left to whoever
    starts them (``WORLD_SIZE`` set), and where every rank meets rank 0."""
    rv = Rendezvous.from_environment(world_size)
    if backend == "ray":
        if rv.external_workers:
            raise ValueError(
                "WORLD_SIZE is set (the workers are started elsewhere): the ray backend places "
                "its own workers; unset it or use the mp backend"
            )
        cuda = model_config.torch_device.type == "cuda"
        workers, addr, port = RayWorkers.launch(world_size, cuda)
        return workers, Rendezvous(addr, port, external_workers=False)
    if rv.external_workers:
        return WorkerProcesses({}), rv
    return WorkerProcesses.launch(world_size, rv), rv


def _describe_exits(exited: dict[int, str]) -> str:
    return "worker " + ", ".join(f"rank {rank} {how}" for rank, how in sorted(exited.items()))
