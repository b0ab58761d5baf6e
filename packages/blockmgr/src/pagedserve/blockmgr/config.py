"""Configuration of the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

# The KV cache's element types, by vLLM's names; "auto" stores K/V in the model's dtype, "fp8"
# (also "fp8_e4m3") one byte an element, e4m3; "q8_0" (llama.cpp's name) int8 in groups of 32,
# each with its own scale.
CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "fp8", "fp8_e4m3", "q8_0")


@dataclass
class CacheConfig:
    """How the KV cache is laid out and sized.

    The cache is ``num_blocks`` blocks of ``block_size`` token slots per layer. Its size comes
    from ``num_blocks`` (``num_gpu_blocks_override``) when given, else from ``kv_cache_memory``
    bytes, else on a GPU from ``total * gpu_memory_utilization`` less what a profiling forward of
    the largest step (``profile_num_tokens``, the scheduler's token budget) needs, else (CPU)
    1 GiB. ``watermark``: the fraction of blocks a newly admitted request must leave free.
    ``cache_dtype``: what K and V are stored as (``auto``: the model's dtype); a 16-bit cache
    under an fp32 model halves the bytes per token while attention still computes in fp32, an
    fp8 (e4m3) one quarters them (pagedserve.kernels.kv_fp8), a q8_0 one takes 17/64 of them
    (int8 and a scale per 32: pagedserve.kernels.kv_q8).
    """

    block_size: int = 16
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    watermark: float = 0.01
    profile_num_tokens: int = 2048
    cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive bytes, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError("watermark must be in [0, 1)")
        if self.cache_dtype in ("fp8_e5m2", "fp8_inc", "fp8_ds_mla"):
            raise ValueError(
                f"cache_dtype {self.cache_dtype!r} is not implemented; fp8 (e4m3) and q8_0 are "
                "the 8-bit KV caches pagedserve stores"
            )
        if self.cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"cache_dtype must be one of {CACHE_DTYPES}, got {self.cache_dtype!r}")
        if self.profile_num_tokens < 1:
            raise ValueError(f"profile_num_tokens must be positive, got {self.profile_num_tokens}")
