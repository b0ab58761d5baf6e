"""Tensor parallelism over torch.distributed: NCCL on GPUs, gloo on CPU.

With ``tensor_parallel_size > 1`` the engine builds a ``TensorParallelExecutor`` instead of a
``ModelRunner``; it answers the same ``execute(scheduler_output) -> (logits, request_ids)``,
``num_blocks`` and ``device``, and adds ``shutdown()``; its failures raise
``pagedserve.engine.errors.TensorParallelError``. One rank keeps the single-process path.
"""

from pagedserve.engine.distributed.executor import TensorParallelExecutor

__all__ = ["TensorParallelExecutor"]
