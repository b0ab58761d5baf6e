"""Tensor and pipeline parallelism over torch.distributed: NCCL on GPUs, gloo on CPU.

With ``tensor_parallel_size`` or ``pipeline_parallel_size > 1`` the engine builds a
``DistributedExecutor`` instead of a ``ModelRunner``; it answers the same
``execute(scheduler_output)``, ``num_blocks`` and ``device``, and adds ``shutdown()`` and
``rank_memory``; its failures raise ``pagedserve.engine.errors.DistributedError``. One rank
keeps the single-process path. Its workers are local processes (launch.py) or Ray actors
(ray_workers.py); group.py holds the ranks' layout and collectives, step_channel.py the step's
broadcast, worker.py a worker's loop.
"""

from pagedserve.engine.distributed.executor import DistributedExecutor

__all__ = ["DistributedExecutor"]
