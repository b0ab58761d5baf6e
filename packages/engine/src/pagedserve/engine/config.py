"""EngineArgs: every knob of the engine in one place, the same names in Python and on the CLI.

``EngineArgs(...).create_configs()`` splits them into one dataclass per concern: the model
(pagedserve.models.ModelConfig), the KV cache (pagedserve.blockmgr.CacheConfig) and the scheduler
(pagedserve.scheduler.SchedulerConfig); ``cuda_graph_config()`` gives the model runner's
decode-graph settings.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from pagedserve.blockmgr import CacheConfig
from pagedserve.engine.cuda_graph import CUDAGraphConfig
from pagedserve.models import ModelConfig
from pagedserve.scheduler import SchedulerConfig


@dataclass
class EngineArgs:
    model: str
    tokenizer: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    max_num_waiting: int = 1024
    tensor_parallel_size: int = 1
    enforce_eager: bool = False

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def cuda_graph_config(self) -> CUDAGraphConfig:
        return CUDAGraphConfig(max_num_seqs=self.max_num_seqs, enforce_eager=self.enforce_eager)

    def create_configs(self) -> tuple[ModelConfig, CacheConfig, SchedulerConfig]:
        model_config = ModelConfig(
            model=self.model,
            dtype=self.dtype,
            device=self.device,
            max_model_len=self.max_model_len,
            seed=self.seed,
        )
        max_len = model_config.max_model_len
        budget = self.max_num_batched_tokens or (
            2048 if self.enable_chunked_prefill else max(2048, max_len)
        )
        cache_config = CacheConfig(
            block_size=self.block_size,
            kv_cache_memory=self.kv_cache_memory,
            gpu_memory_utilization=self.gpu_memory_utilization,
            num_blocks=self.num_gpu_blocks_override,
            enable_prefix_caching=self.enable_prefix_caching,
            profile_num_tokens=budget,
        )
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_len,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            enable_chunked_prefill=self.enable_chunked_prefill,
            policy=self.scheduling_policy,
            max_num_waiting=self.max_num_waiting,
        )
        return model_config, cache_config, scheduler_config
