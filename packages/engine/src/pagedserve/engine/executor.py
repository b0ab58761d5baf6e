"""The engine's model executor: one model runner in this process (``CPUModelRunner`` on a CPU,
``ModelRunner`` elsewhere; ``PoolingModelRunner`` for a pooling model), or rank 0 of a tensor-
and pipeline-parallel group (``DistributedExecutor``)
behind the same interface, as vLLM picks a single-process or a multiprocess executor from the
parallel config."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagedserve.blockmgr import CacheConfig
from pagedserve.engine.config import EngineArgs
from pagedserve.engine.cpu_runner import CPUModelRunner
from pagedserve.engine.distributed import DistributedExecutor
from pagedserve.engine.model_runner import ModelRunner
from pagedserve.engine.pooling_runner import PoolingModelRunner
from pagedserve.models import ModelConfig

if TYPE_CHECKING:
    from pagedserve.engine.spec_decode.draft_model import DraftModelProposer


def create_runner(
    args: EngineArgs,
    model_config: ModelConfig,
    cache_config: CacheConfig,
    extra_block_bytes: int = 0,
    drafter: DraftModelProposer | None = None,
    profile_images: Sequence = (),
) -> ModelRunner | DistributedExecutor:
    """The runner for ``args``; ``extra_block_bytes``: a draft model's KV bytes per block, which
    share the KV memory budget (on rank 0 only under tensor parallelism); ``drafter``: that
    draft model, which the runner runs at the start of each step; ``profile_images``: the
    images a step may encode at most, which a GPU's memory profile runs through the tower (a
    vision-language model runs on one rank)."""
    lora_config = args.create_lora_config()
    if model_config.runner_type == "pooling":  # prefill steps only: no decode graphs
        return PoolingModelRunner(model_config, cache_config)
    if args.tensor_parallel_size == args.pipeline_parallel_size == 1:  # LoRA: no decode graphs
        graphs = args.cuda_graph_config() if lora_config is None else None
        cpu = model_config.torch_device.type == "cpu"
        return (CPUModelRunner if cpu else ModelRunner)(
            model_config,
            cache_config,
            graph_config=graphs,
            lora_config=lora_config,
            extra_block_bytes=extra_block_bytes,
            drafter=drafter,
            profile_images=profile_images,
        )
    return DistributedExecutor(
        model_config,
        cache_config,
        args.tensor_parallel_size,
        args.pipeline_parallel_size,
        args.pp_layer_partition,
        extra_block_bytes,
        drafter,
        args.distributed_executor_backend,
    )
