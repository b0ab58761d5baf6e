"""The KV cache tensors, how many blocks fit in a memory budget, the attention variants
compiled for them, and the block manager that keeps their bookkeeping. A model's
``KVCacheSpec`` (pagedserve.models.kv_cache_spec) says what each layer caches: keys and values,
or multi-head latent attention's one latent."""

from __future__ import annotations

import logging

import torch

from pagedserve.blockmgr import KVCacheManager, NoKVCacheManager
from pagedserve.engine.multimodal import reads_images_both_ways
from pagedserve.kernels import copy_blocks, mla_decode_warmup, paged_attention_warmup
from pagedserve.kernels.kv_fp8 import FP8_CACHE_DTYPE
from pagedserve.kernels.kv_q8 import Q8_CACHE_DTYPE
from pagedserve.models import KVCacheSpec, ModelConfig

logger = logging.getLogger("pagedserve.engine")

DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30  # 1 GiB: ~23k tokens of SmolLM2-135M in fp32


_CACHE_DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "fp8": FP8_CACHE_DTYPE, "fp8_e4m3": FP8_CACHE_DTYPE, "q8_0": Q8_CACHE_DTYPE,
}  # fmt: skip


def kv_cache_torch_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element type of the KV cache tensors: ``CacheConfig.cache_dtype``, or the model's
    dtype for ``auto``. Keys and values are cast to it as ``store_kv`` writes them (to fp8:
    saturated at ±448, per-tensor scale 1; q8_0: int8 rows, a scale per 32, as int8 tensors:
    kernels/kv_q8.py), and every attention path widens what it reads to fp32."""
    return model_dtype if cache_dtype == "auto" else _CACHE_DTYPES[cache_dtype]


def bytes_per_block(spec: KVCacheSpec, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers: keys and values together, or the latent."""
    return block_size * spec.bytes_per_token(dtype)


def num_blocks_for_memory(memory_bytes: int, block_bytes: int) -> int:
    """Whole blocks that fit in ``memory_bytes``; at least one, or a clear error."""
    num_blocks = memory_bytes // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"a KV cache of {memory_bytes} bytes holds no block of {block_bytes} bytes; "
            "raise kv_cache_memory or lower block_size"
        )
    return num_blocks


def gpu_kv_cache_budget(
    total_bytes: int, gpu_memory_utilization: float, peak_torch_bytes: int, non_torch_bytes: int
) -> int:
    """Bytes the KV cache may take on a GPU, after a profiling forward of the largest step.

    The engine may use ``total * gpu_memory_utilization`` of the device. Out of that come the
    peak that torch allocated during the profiling forward (weights and the activations of a
    full token budget, the profiling cache excluded) and what lives outside torch's allocator
    (the CUDA context, NCCL buffers); the rest is the KV cache's, as in vLLM.
    """
    usable = int(total_bytes * gpu_memory_utilization)
    budget = usable - peak_torch_bytes - non_torch_bytes
    if budget <= 0:
        gib = 1 << 30
        raise ValueError(
            f"no GPU memory left for the KV cache: {gpu_memory_utilization:.0%} of "
            f"{total_bytes / gib:.1f} GiB is {usable / gib:.2f} GiB, and the model's peak "
            f"({peak_torch_bytes / gib:.2f} GiB) plus non-torch memory ({non_torch_bytes / gib:.2f} "
            "GiB) take all of it; raise gpu_memory_utilization, lower max_num_batched_tokens, or "
            "use a smaller model"
        )
    return budget


def allocate_kv_caches(
    spec: KVCacheSpec,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[tuple[torch.Tensor, ...]]:
    """Per layer, a ``(k_cache, v_cache)`` pair each ``[num_blocks, block_size, Hkv, D]``, or
    for multi-head latent attention the one ``(latent_cache,)`` ``[num_blocks, block_size, 1,
    kv_lora_rank + rope_dim]`` (``spec.tensors_per_layer``).

    The caches start as zeros: attention never reads a slot before the layer stored into it,
    and the tests that want to prove that fill unused slots with NaN themselves.
    """
    if spec.is_latent and dtype in (FP8_CACHE_DTYPE, Q8_CACHE_DTYPE):
        raise ValueError(
            "kv_cache_dtype fp8 / q8_0: multi-head latent attention's cache is not stored in "
            "8 bits; use auto, float16 or bfloat16 with this model"
        )
    shape = spec.block_shape(num_blocks, block_size, dtype)
    return [
        tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.tensors_per_layer))
        for _ in range(spec.num_layers)
    ]


def copy_cache_blocks(kv_caches: list[tuple[torch.Tensor, ...]], src_to_dst: torch.Tensor) -> None:
    """Copy-on-write's block copies in every layer's cache tensors (keys and values, or the
    latent alone)."""
    values = [layer[1] for layer in kv_caches if len(layer) > 1]
    copy_blocks([layer[0] for layer in kv_caches], values, src_to_dst)


def warm_up_attention(
    config: ModelConfig,
    spec: KVCacheSpec,
    num_heads: int,
    block_size: int,
    cache_dtype: torch.dtype,
    device: torch.device,
) -> None:
    """On a GPU, compile every attention variant serving can launch over this cache now, not
    mid-request: paged attention's, or MLA's decode over a latent cache. ``num_heads``: the
    query heads of one rank."""
    if device.type != "cuda":
        return
    if spec.is_latent:
        kv_lora_rank = int(config.hf_config["kv_lora_rank"])
        mla_decode_warmup(
            num_heads, kv_lora_rank, spec.head_size - kv_lora_rank, config.torch_dtype,
            block_size, config.max_model_len, device, cache_dtype=cache_dtype,
        )  # fmt: skip
        return
    paged_attention_warmup(
        num_heads, spec.num_kv_heads, spec.head_size, config.torch_dtype, block_size,
        config.max_model_len, device, layer_windows=config.sliding_windows,
        logits_soft_cap=config.attention_logits_soft_cap, cache_dtype=cache_dtype,
        sinks=config.has_attention_sinks, batch_invariant=config.batch_invariant,
        key_limits=reads_images_both_ways(config),
    )  # fmt: skip


def log_cache_size(num_blocks: int, block_size: int, max_model_len: int) -> None:
    """One start-up line, as vLLM prints it: tokens that fit and concurrency at max_model_len.

    A cache smaller than one ``max_model_len`` sequence is allowed (tests shrink it on purpose
    to force preemption) but warned about: a request that long could never be admitted.
    """
    tokens = num_blocks * block_size
    if tokens < max_model_len:
        logger.warning(
            "the KV cache holds %d tokens, fewer than max_model_len (%d): a request of "
            "max_model_len tokens cannot run; lower max_model_len or give the cache more memory",
            tokens,
            max_model_len,
        )
    logger.info(
        "KV cache: %d blocks of %d tokens (%d tokens); maximum concurrency for %d tokens per "
        "request: %.2fx",
        num_blocks,
        block_size,
        tokens,
        max_model_len,
        tokens / max_model_len,
    )


def kv_cache_manager_for(
    model_config, cache_config, num_blocks: int, kv_connector=None
) -> KVCacheManager | NoKVCacheManager:
    """The blocks' bookkeeping for a model: none for an encoder, which has no KV cache
    (docs/pooling.md); else ``num_blocks`` blocks, prefix caching and the model's window. With
    a KV connector, its prefix hashes start from the connector's root (a store that outlives
    the process names a prefix as the restarted engine does), and the connector looks its
    blocks up by them."""
    cc = cache_config
    if model_config.is_encoder_only:
        return NoKVCacheManager(cc.block_size)
    window = model_config.kv_cache_window
    root = kv_connector.hash_root if kv_connector is not None else None
    manager = KVCacheManager(
        num_blocks, cc.block_size, cc.enable_prefix_caching, cc.watermark, window, root
    )
    if kv_connector is not None:
        kv_connector.bind_kv_cache_manager(manager)
    return manager
