"""EngineArgs: every knob of the engine in one place, the same names in Python and on the CLI.

Each field carries its help text (``option``); the CLI builds ``--kebab-case`` flags from the
fields' type hints, defaults and help, so a new knob needs no CLI code.

``EngineArgs(...).create_configs()`` splits them into one dataclass per concern: the model
(pagedserve.models.ModelConfig), the KV cache (pagedserve.blockmgr.CacheConfig) and the scheduler
(pagedserve.scheduler.SchedulerConfig); ``cuda_graph_config()`` gives the model runner's
decode-graph settings; ``create_speculative_config()`` the proposer's (spec_decode/config.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from pagedserve.blockmgr import CacheConfig
from pagedserve.engine.batch_invariance import batch_invariant_from_env, check_batch_invariant
from pagedserve.engine.cuda_graph import CUDAGraphConfig
from pagedserve.models import ModelConfig
from pagedserve.scheduler import SchedulerConfig

if TYPE_CHECKING:
    from pagedserve.engine.lora.config import LoRAConfig
    from pagedserve.engine.spec_decode.config import SpeculativeConfig


class ConfigFieldError(ValueError):
    """An invalid field of a config given as vLLM's JSON (``speculative_config``,
    ``kv_transfer_config``): ``param`` names it as ``<config>.<field>``."""

    config_name = "config"

    def __init__(self, field_name: str, message: str) -> None:
        self.param = f"{self.config_name}.{field_name}"
        super().__init__(f"{self.param}: {message}")


def config_dict(value, error: type[ConfigFieldError]) -> dict:
    """A config given as a dict or as its JSON text (the command line's), as a dict."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise error("(json)", f"not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise error("(type)", f"expected a dict, got {type(value).__name__}")
    return value


def option(default, help: str, **metadata):
    """A config field with its help text: the CLI builds its flag from the field's type hint,
    default and this text, so the three are written once, here."""
    return field(default=default, metadata={"help": help, **metadata})


@dataclass
class EngineArgs:
    model: str = field(metadata={"help": "Hugging Face model folder"})
    tokenizer: str | None = option(None, "tokenizer folder (default: the model's)")
    dtype: str = option("auto", "weights and activations: auto, float32, float16, bfloat16")
    quantization: str | None = option(
        None,
        "int8 or fp8: quantize at load time; awq, gptq or fp8: the checkpoint's stored format "
        "(default: what its quantization_config says)",
    )
    device: str = option("auto", "auto (CUDA if present, else CPU), cuda or cpu")
    num_cpu_threads: int | None = option(
        None,
        "threads of the CPU work (torch's pool; numba's attention follows it, up to "
        "NUMBA_NUM_THREADS); default: OMP_NUM_THREADS, else every core the process may use "
        "(its CPU affinity, capped by its cgroup's CPU quota), lowered between steps to the "
        "cores other processes leave free",
    )
    seed: int = option(0, "seed of the engine's random source (per-request seeds override it)")
    max_model_len: int | None = option(
        None, "longest sequence, prompt plus completion (default: the model's)"
    )
    block_size: int = option(16, "tokens per KV-cache block")
    kv_cache_memory: int | None = option(
        None, "bytes for the KV cache on CPU, e.g. 2GiB, 512MB or 1073741824", unit="bytes"
    )
    kv_cache_dtype: str = option(
        "auto",
        "what the KV cache stores: auto (the model's dtype), float32, float16, bfloat16, fp8 "
        "(e4m3) or q8_0 (llama.cpp's blocks: int8, a scale per 32); a 16-bit cache under an "
        "fp32 model holds twice the tokens, an 8-bit one about four times",
    )
    gpu_memory_utilization: float = option(0.9, "fraction of free GPU memory for the KV cache")
    num_gpu_blocks_override: int | None = option(
        None, "exact number of KV blocks (overrides the memory settings)"
    )
    enable_prefix_caching: bool = option(
        True, "share the KV blocks of common prompt prefixes between requests"
    )
    max_num_seqs: int = option(64, "most sequences in one batch")
    max_num_batched_tokens: int | None = option(
        None, "token budget of one step (prefill chunks + decodes)"
    )
    long_prefill_token_threshold: int = option(0, "most tokens of one prompt per step (0: no cap)")
    enable_chunked_prefill: bool = option(True, "split long prompts over several steps")
    scheduling_policy: str = option(
        "fcfs", "fcfs, or priority (a request's 'priority' field, lower first)"
    )
    background_priority: int | None = option(
        None,
        "requests at this priority value or above are background work (needs --scheduling-policy "
        "priority): they yield every step in which a more important request reads its prompt "
        "(serve: --batch-priority unless given)",
    )
    max_num_waiting: int = option(
        1024, "most requests waiting in the queue; beyond it the server answers 503"
    )
    max_num_waiting_tokens: int = option(
        0, "most tokens waiting in the queue (0: no cap, else >= max_model_len); beyond it, 503"
    )
    generation_config: str = option(
        "auto",
        "auto (the model's generation_config.json sets eos ids and sampling defaults), vllm "
        "(its eos ids only) or a folder holding a generation_config.json",
    )
    runner: str = option(
        "auto",
        "auto, generate or pooling: what the model serves (auto: a pooling architecture such as "
        "BertModel pools, any other generates)",
    )
    convert: str = option(
        "auto",
        "auto, none, embed or classify: serve a generative model as an embedder (last-token "
        "pooling) or a classifier (its score head); implies --runner pooling",
    )
    tensor_parallel_size: int = option(1, "number of devices to shard the model over")
    pipeline_parallel_size: int = option(
        1,
        "number of pipeline stages to cut the model's layers into, each stage "
        "tensor_parallel_size devices (one process per device)",
    )
    distributed_executor_backend: str = option(
        "mp",
        "how the ranks of tensor/pipeline parallelism start: mp (worker processes on this "
        "machine) or ray (Ray actors placed over the nodes of a Ray cluster)",
    )
    pp_layer_partition: str | None = option(
        None,
        "decoder layers per pipeline stage, comma-separated, e.g. 10,14 (default: an even "
        "split; VLLM_PP_LAYER_PARTITION sets it too)",
    )
    enforce_eager: bool = option(False, "run every step eagerly: no CUDA graphs for decode steps")
    max_logprobs: int = option(
        20, "most logprobs (and prompt logprobs) a request may ask for (-1: the whole vocabulary)"
    )
    speculative_config: dict | None = option(
        None,
        'speculative decoding, as vLLM\'s JSON: {"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5} or '
        '{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}',
        unit="json",
    )

    kv_offload_memory: int | None = option(
        None,
        "bytes of host memory that keep the KV blocks the engine computes (KV offloading): a "
        "prompt whose prefix the KV cache has evicted loads it back instead of recomputing it, "
        "e.g. 8GiB (default: none)",
        unit="bytes",
    )
    kv_offload_dir: str | None = option(
        None,
        "a folder that keeps the KV blocks the engine computes on disk (KV offloading): a "
        "restarted server with the same folder still hits the prefixes it saw (default: none)",
    )
    kv_offload_disk: int | None = option(
        None,
        "bytes of block files kept in --kv-offload-dir, least recently used out (default: 4GiB)",
        unit="bytes",
    )
    kv_transfer_config: dict | None = option(
        None,
        'disaggregated prefill/decode, as vLLM\'s JSON: {"kv_connector": "TCPConnector", '
        '"kv_role": "kv_producer", "kv_ip": "127.0.0.1", "kv_port": 14579} on the prefill '
        'engine, {"kv_connector": "TCPConnector", "kv_role": "kv_consumer"} on the decode engine',
        unit="json",
    )

    enable_lora: bool = option(False, "serve LoRA adapters (PEFT format) beside the base model")
    max_loras: int = option(1, "most distinct LoRA adapters in one batch (device slots)")
    max_lora_rank: int = option(16, "largest LoRA rank an adapter may have")
    max_cpu_loras: int | None = option(
        None, "LoRA adapters kept read in host memory, LRU (default: max_loras)"
    )
    limit_mm_per_prompt: dict | None = option(
        None,
        'most images one prompt may carry, as vLLM\'s JSON: {"image": 2} (default: 4 for a model '
        "that takes images; a text model takes none)",
        unit="json",
    )
    mm_processor_kwargs: dict | None = option(
        None,
        "settings for the model's image processor over its folder's, as vLLM's JSON: "
        '{"max_pixels": 802816} caps Qwen2-VL\'s tokens an image (a key the processor does '
        "not take, or one the model's tower depends on, is refused at start)",
        unit="json",
    )
    allowed_local_media_path: str | None = option(
        None,
        "a folder whose images a request may name by local path (file:// URLs); without it "
        "only data: URLs are read (no request ever makes the server fetch a remote URL)",
    )
    encoder_cache_size: int | None = option(
        None,
        "image embeddings (in tokens) kept between steps, so a prompt chunked over several "
        "steps and a repeated image run the vision encoder once; also the most image tokens "
        "encoded in one step (default: max_num_batched_tokens, at least one image's)",
    )
    batch_invariant: bool = option(
        False,
        "compute every row in an order that does not depend on the other rows of its step: a "
        "request gets the same bits alone or in any batch, chunk or prefix hit "
        "(VLLM_BATCH_INVARIANT=1 turns it on too)",
    )

    def __post_init__(self) -> None:
        if self.pp_layer_partition is not None and self.pipeline_parallel_size == 1:
            raise ValueError(
                f"pp_layer_partition {self.pp_layer_partition!r} splits pipeline stages: give "
                "pipeline_parallel_size > 1 with it"
            )
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError(
                f"distributed_executor_backend {self.distributed_executor_backend!r}: "
                "pagedserve starts its ranks as local processes (mp) or Ray actors (ray)"
            )
        if not self.batch_invariant:
            self.batch_invariant = batch_invariant_from_env()
        if self.speculative_config is not None:  # a bad config fails here, before any loading
            self.create_speculative_config()
        if self.enable_lora:
            self.create_lora_config()
            for name in ("tensor_parallel_size", "pipeline_parallel_size"):
                if getattr(self, name) > 1:
                    raise ValueError(f"enable_lora does not support {name} > 1 yet")
        from pagedserve.engine.kv_connector.config import KVTransferConfig, check_connector_args

        check_connector_args(self)  # KV offloading / transfer: what rules them out, named
        if self.kv_transfer_config is not None:
            KVTransferConfig.from_dict(self.kv_transfer_config)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def _check_pooling(self) -> None:
        """What a pooling model cannot run with: it generates nothing to speculate on or to
        adapt, and it runs on one device."""
        refused = {
            "speculative_config": self.speculative_config is not None,
            "enable_lora": self.enable_lora,
            "tensor_parallel_size": self.tensor_parallel_size > 1,
            "pipeline_parallel_size": self.pipeline_parallel_size > 1,
            "kv_offload_memory": self.kv_offload_memory is not None,
            "kv_offload_dir": self.kv_offload_dir is not None,
            "kv_transfer_config": self.kv_transfer_config is not None,
        }
        for name, set_ in refused.items():
            if set_:
                raise ValueError(f"{name} is not supported with a pooling model (--runner pooling)")

    def create_speculative_config(self) -> SpeculativeConfig | None:
        from pagedserve.engine.spec_decode.config import SpeculativeConfig

        if self.speculative_config is None:
            return None
        return SpeculativeConfig.from_dict(self.speculative_config)

    def create_lora_config(self) -> LoRAConfig | None:
        from pagedserve.engine.lora.config import LoRAConfig

        if not self.enable_lora:
            return None
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)

    def cuda_graph_config(self) -> CUDAGraphConfig:
        return CUDAGraphConfig(max_num_seqs=self.max_num_seqs, enforce_eager=self.enforce_eager)

    def create_configs(self) -> tuple[ModelConfig, CacheConfig, SchedulerConfig]:
        model_config = ModelConfig(
            model=self.model,
            dtype=self.dtype,
            device=self.device,
            max_model_len=self.max_model_len,
            seed=self.seed,
            quantization=self.quantization,
            generation_config=self.generation_config,
            runner=self.runner,
            convert=self.convert,
            batch_invariant=self.batch_invariant,
        )
        if model_config.runner_type == "pooling":
            self._check_pooling()
        if self.batch_invariant:
            check_batch_invariant(model_config)
        max_len = model_config.max_model_len
        # an encoder reads each prompt whole in one step: never chunked, never a cached prefix
        encoder = model_config.is_encoder_only
        chunked = self.enable_chunked_prefill and not encoder
        budget = self.max_num_batched_tokens or (2048 if chunked else max(2048, max_len))
        if encoder and budget < max_len:
            raise ValueError(
                f"max_num_batched_tokens ({budget}) must be at least max_model_len ({max_len}) "
                "for an encoder model: its prompts are read whole, in one step"
            )
        cache_config = CacheConfig(
            block_size=self.block_size,
            kv_cache_memory=self.kv_cache_memory,
            gpu_memory_utilization=self.gpu_memory_utilization,
            num_blocks=self.num_gpu_blocks_override,
            enable_prefix_caching=self.enable_prefix_caching and not encoder,
            profile_num_tokens=budget,
            cache_dtype=self.kv_cache_dtype,
        )
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_len,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            enable_chunked_prefill=chunked,
            policy=self.scheduling_policy,
            max_num_waiting=self.max_num_waiting,
            max_num_waiting_tokens=self.max_num_waiting_tokens,
            max_loras=self.max_loras if self.enable_lora else 0,
            background_priority=self.background_priority,
            encoder_cache_size=self.encoder_cache_size or 0,
        )
        return model_config, cache_config, scheduler_config
