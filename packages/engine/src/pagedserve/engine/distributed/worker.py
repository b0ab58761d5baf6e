"""A worker: ranks 1..world_size-1, each holding its part of the model and cache (its pipeline
stage's layers, its tensor-parallel shard of them).

    RANK=1 WORLD_SIZE=2 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 \\
        python -m pagedserve.engine.distributed.worker

The engine starts these itself on one machine. On other machines, start one per rank with the
environment above (LOCAL_RANK picks the GPU; torchrun sets all of it). A worker needs nothing
else: rank 0 sends it the model and cache configs after the rendezvous (the model folder must
exist at the same path on every machine) and the layout (``tensor_parallel_size`` x
``pipeline_parallel_size``, each stage's layers). Then it loops: receive a step's batch, run the
forward on its part (taking part in its stage's all-reduces and gather, receiving the previous
stage's hidden states and sending its own to the next), until rank 0 says stop.
A failed collective (rank 0 gone, a timeout) ends the process with a non-zero exit code.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import traceback

import torch
import torch.distributed as dist

from pagedserve.engine.distributed.group import ParallelGroups, memory_of_ranks
from pagedserve.engine.distributed.step_channel import StepReceiver
from pagedserve.engine.model_runner import ModelRunner

logger = logging.getLogger("pagedserve.engine.worker")


def _required_env(name: str) -> str:
    if name not in os.environ:
        raise SystemExit(f"pagedserve worker: the environment variable {name} is not set")
    return os.environ[name]


def run_worker() -> None:
    rank, world_size = int(_required_env("RANK")), int(_required_env("WORLD_SIZE"))
    if not 0 < rank < world_size:
        raise SystemExit(f"pagedserve worker: RANK must be in [1, {world_size}), got {rank}")
    torch.set_num_threads(int(os.environ.get("PAGEDSERVE_TP_THREADS", "1")))
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if torch.cuda.is_available():  # NCCL binds this process to its GPU at the rendezvous
        local_rank %= torch.cuda.device_count()
        torch.cuda.set_device(local_rank)
    group = ParallelGroups.join(
        rank, world_size, _required_env("MASTER_ADDR"), int(_required_env("MASTER_PORT"))
    )
    try:
        configs = [None]
        dist.broadcast_object_list(configs, src=0, group=group.control)
        model_config, cache_config = configs[0]
        if model_config.torch_device.type == "cuda":
            model_config = dataclasses.replace(model_config, device=f"cuda:{local_rank}")
        runner = ModelRunner(model_config, cache_config, group.parallel_context(model_config))
        memory_of_ranks(group, runner)
        group.finish_startup()
        receiver = StepReceiver(group, runner.device)
        while (step := receiver.receive()) is not None:
            runner.execute_model(step.model_input, step.blocks_to_copy)
    finally:
        group.close()


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    try:
        run_worker()
    except Exception:  # rank 0 reports the failure to the user; this is the detail
        rank = os.environ.get("RANK", "?")
        print(f"pagedserve worker rank {rank} failed:", file=sys.stderr)
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
