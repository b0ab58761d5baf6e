"""TensorParallelExecutor: rank 0 of a tensor-parallel group, in the engine's own process.

The engine talks to it as it talks to a ``ModelRunner`` (``execute``, ``input_batch``,
``num_blocks``, ``device``): rank 0 keeps the scheduler and the sampling state, flattens each
step, broadcasts the batch to the workers (``step_channel``) and runs its own shard of the
forward alongside them; the row-parallel all-reduces and the LM head's gather join the shards
inside the model. Only rank 0 samples.

Workers are ``python -m pagedserve.engine.distributed.worker`` processes, started here, one per
rank 1..tp_size-1, on this machine (rendezvous on 127.0.0.1 at a free port unless MASTER_ADDR
and MASTER_PORT are set). When ``WORLD_SIZE`` is set in the environment the workers are started
elsewhere (other machines, torchrun) and this process joins as rank 0 of that group.

A worker that exits, or a collective that times out, fails the step with a
``TensorParallelError`` (an ``EngineError``) that says which rank and why; the group is then
unusable and the engine must be restarted. It never hangs. Since the workers' wait for the next
step is bounded by the same timeout, an idle engine sends them a keep-alive message every
quarter timeout (a background thread; a lock keeps it from interleaving with a step).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagedserve.blockmgr import CacheConfig
from pagedserve.engine.distributed.group import (
    TensorParallelGroup,
    collective_timeout,
    free_loopback_port,
)
from pagedserve.engine.distributed.step_channel import Step, StepSender
from pagedserve.engine.errors import TensorParallelError
from pagedserve.engine.input_batch import InputBatch
from pagedserve.engine.model_runner import ModelRunner
from pagedserve.engine.outputs import ModelRunnerOutput
from pagedserve.models import ModelConfig, ParallelContext
from pagedserve.models.loader import MODEL_CLASSES
from pagedserve.models.registry import ARCHITECTURES
from pagedserve.scheduler import SchedulerOutput

logger = logging.getLogger("pagedserve.engine")

STOP_GRACE_S = 10.0  # how long shutdown waits for workers to exit before killing them


def check_shardable(model_config: ModelConfig, tp_size: int) -> None:
    """Raise ValueError now if the model cannot be split over ``tp_size`` ranks.

    Builds rank 0's shard on the meta device (no memory, no weights), so every layer's own
    divisibility check runs before any process is started.
    """
    if tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp_size}")
    if tp_size > 1 and not ARCHITECTURES[model_config.hf_architecture].tensor_parallel:
        served = [name for name, a in ARCHITECTURES.items() if a.tensor_parallel]
        raise ValueError(
            f"{model_config.hf_architecture} runs on one device (tensor_parallel_size 1); "
            f"tensor parallelism serves {', '.join(served)}"
        )
    model_cls = MODEL_CLASSES[model_config.arch]
    with torch.device("meta"):
        model_cls(model_config, ParallelContext(tp_rank=0, tp_size=tp_size))
    if model_config.torch_device.type == "cuda" and "WORLD_SIZE" not in os.environ:
        available = torch.cuda.device_count()
        if tp_size > available:
            raise ValueError(
                f"tensor_parallel_size {tp_size} needs {tp_size} GPUs; {available} seen"
            )


@dataclass
class Rendezvous:
    addr: str
    port: int
    external_workers: bool  # True: the other ranks are started by someone else

    @classmethod
    def from_environment(cls, tp_size: int) -> Rendezvous:
        env = os.environ
        external = "WORLD_SIZE" in env
        if external and int(env["WORLD_SIZE"]) != tp_size:
            raise ValueError(
                f"WORLD_SIZE={env['WORLD_SIZE']} but tensor_parallel_size={tp_size}: they must match"
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
    def launch(cls, tp_size: int, rv: Rendezvous) -> WorkerProcesses:
        procs = {}
        threads = max(1, torch.get_num_threads() // tp_size)  # the cores, shared out
        for rank in range(1, tp_size):
            env = dict(os.environ)
            env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(tp_size),
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

    def exited(self) -> dict[int, int]:
        """rank -> exit code of every worker that is no longer running."""
        codes = {rank: p.poll() for rank, p in self.procs.items()}
        return {rank: code for rank, code in codes.items() if code is not None}

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


class TensorParallelExecutor:
    """Rank 0: schedules in this process, runs its shard here, drives the workers' shards."""

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        tp_size: int,
        extra_block_bytes: int = 0,
        drafter=None,
    ):
        check_shardable(model_config, tp_size)
        self.tp_size = tp_size
        rv = Rendezvous.from_environment(tp_size)
        if rv.external_workers:
            self.workers = WorkerProcesses({})
        else:
            self.workers = WorkerProcesses.launch(tp_size, rv)
        self._finalizer = weakref.finalize(self, self.workers.kill)
        self.group: TensorParallelGroup | None = None
        self._failed: TensorParallelError | None = None
        try:
            self.group = TensorParallelGroup.join(
                0, tp_size, rv.addr, rv.port, self._raise_if_worker_exited
            )
            configs = [(model_config, cache_config)]
            dist.broadcast_object_list(configs, src=0, group=self.group.control)
            self.driver = ModelRunner(  # a draft model's cache lives on rank 0 only
                model_config,
                cache_config,
                self.group.parallel_context(model_config.batch_invariant),
                extra_block_bytes=extra_block_bytes,
                drafter=drafter,
            )
            self.group.finish_startup()
        except Exception as e:
            error = self._failure("starting the tensor-parallel group", e)
            self._abort()
            if isinstance(e, RuntimeError):  # a worker died, a collective failed
                raise error from e
            raise  # a bad model folder, a timeout at the rendezvous: the error as it is
        self.sender = StepSender(self.group)
        self._lock = threading.Lock()  # one message sequence at a time: a step or a keep-alive
        self._last_sent = time.monotonic()
        self._closing = threading.Event()
        self._keep_alive_thread = threading.Thread(
            target=self._keep_alive, name="pagedserve-tp-keep-alive", daemon=True
        )
        self._keep_alive_thread.start()
        logger.info("tensor parallelism: %d ranks, %d KV blocks each", tp_size, self.num_blocks)

    @property
    def num_blocks(self) -> int:
        return self.driver.num_blocks

    @property
    def device(self) -> torch.device:
        return self.driver.device

    @property
    def input_batch(self) -> InputBatch:
        return self.driver.input_batch

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """One step on every rank, sampled on rank 0."""
        prepared = self.driver.begin_step(output)
        if prepared is None:  # nothing runnable: the workers have nothing to do
            return ModelRunnerOutput()
        model_input, layout = prepared
        with self._lock:
            if self._failed is not None:
                raise TensorParallelError(f"the tensor-parallel group failed: {self._failed}")
            self._raise_if_worker_exited()
            try:
                self.sender.send(Step(model_input, output.blocks_to_copy))
                logits = self.driver.execute_model(model_input, output.blocks_to_copy)
            except Exception as e:
                self._fail("running a step", e)
                raise self._failed from e
            self._last_sent = time.monotonic()
        return self.driver.sample(layout, logits)

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
                    logger.warning("could not send the stop message to the tensor-parallel workers")
            if not self.workers.wait(STOP_GRACE_S):
                logger.warning("tensor-parallel workers did not stop in %.0f s", STOP_GRACE_S)
            self._abort()
        self._keep_alive_thread.join()

    def _keep_alive(self) -> None:
        """While idle, tell the workers every quarter timeout that rank 0 is still here."""
        interval = collective_timeout().total_seconds() / 4
        while not self._closing.wait(interval / 2):
            with self._lock:
                if self._failed is not None or self.group is None:
                    return
                if time.monotonic() - self._last_sent < interval:
                    continue
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
            self._failed = TensorParallelError(_describe_exits(exited))
            self._abort()
            raise self._failed

    def _fail(self, during: str, error: Exception) -> None:
        """Record why the group is unusable and tear it down (the caller holds the lock)."""
        self._failed = self._failure(during, error)
        logger.error("%s", self._failed)
        self._abort()

    def _failure(self, during: str, error: Exception) -> TensorParallelError:
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
        return TensorParallelError(f"tensor parallelism failed while {during}: {reason}")

    def _abort(self) -> None:
        self.workers.kill()
        if self.group is not None:
            self.group.close()
            self.group = None


def _describe_exits(exited: dict[int, int]) -> str:
    parts = [f"rank {rank} exited with code {code}" for rank, code in sorted(exited.items())]
    return "tensor-parallel worker " + ", ".join(parts) + " (its log is on stderr above)"
