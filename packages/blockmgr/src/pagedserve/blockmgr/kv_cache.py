"""The KV cache tensors, and how many blocks fit in a memory budget."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("pagedserve.blockmgr")

DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30  # 1 GiB: ~23k tokens of SmolLM2-135M in fp32


def bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one block takes across all layers, keys and values together."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size


def num_blocks_for_memory(memory_bytes: int, block_bytes: int) -> int:
    num_blocks = memory_bytes // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"a KV cache of {memory_bytes} bytes holds no block of {block_bytes} bytes; "
            "raise kv_cache_memory or lower block_size"
        )
    return num_blocks


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (k_cache, v_cache) pair per layer, each ``[num_blocks, block_size, Hkv, D]``.

    The caches start as zeros: attention never reads a slot before ``store_kv`` wrote it, and
    the tests that want to prove that fill unused slots with NaN themselves.
    """
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(num_layers)
    ]


def log_cache_size(num_blocks: int, block_size: int, max_model_len: int) -> None:
    """One start-up line, as vLLM prints it: tokens that fit and concurrency at max_model_len."""
    tokens = num_blocks * block_size
    logger.info(
        "KV cache: %d blocks of %d tokens (%d tokens); maximum concurrency for %d tokens per "
        "request: %.2fx",
        num_blocks,
        block_size,
        tokens,
        max_model_len,
        tokens / max_model_len,
    )
