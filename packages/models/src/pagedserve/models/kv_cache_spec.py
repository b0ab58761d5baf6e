"""What a model keeps in the paged KV cache, per layer and token: the shape the engine sizes and
allocates.

An attention layer caches keys and values: two tensors per layer, each ``[num_blocks,
block_size, Hkv, D]`` (the KV cache contract), Hkv the KV heads this tensor-parallel rank holds.
Multi-head latent attention (DeepSeek-V2/V3) caches one latent per token instead, shared by all
heads: the normalised compressed KV and the rotated shared key, ``kv_lora_rank +
qk_rope_head_dim`` values. That is one tensor per layer, ``[num_blocks, block_size, 1,
kv_lora_rank + qk_rope_head_dim]``, and no values: each head's key and value are projections
of the latent (docs/mla.md has the arithmetic). Every rank holds the whole latent, since each
rank's heads read all of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kernels.kv_q8 import Q8_CACHE_DTYPE, row_width
from pagedserve.models.config import ModelConfig
from pagedserve.models.parallel import kv_heads_per_rank
from pagedserve.models.pipeline import PipelineStage


@dataclass(frozen=True)
class KVCacheSpec:
    """One rank's cache: ``num_layers`` layers of ``tensors_per_layer`` tensors (2: keys and
    values; 1: a latent), each ``[num_blocks, block_size, num_kv_heads, head_size]``."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    tensors_per_layer: int

    @property
    def is_latent(self) -> bool:
        """One tensor per layer: MLA's latent cache (``kv_caches[i] == (latent_cache,)``)."""
        return self.tensors_per_layer == 1

    def block_shape(
        self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None
    ) -> tuple[int, int, int, int]:
        """A cache tensor's shape; its last dimension a head's row (q8_0: with its scales)."""
        return (num_blocks, block_size, self.num_kv_heads, self.row_elements(dtype))

    def row_elements(self, dtype: torch.dtype | None) -> int:
        """Elements of one head's row: ``head_size``, or a q8_0 row's bytes (kernels/kv_q8.py:
        int8 elements, then a 2-byte scale per 32)."""
        return row_width(self.head_size) if dtype == Q8_CACHE_DTYPE else self.head_size

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Cache bytes one token takes, across every layer and tensor."""
        element_size = torch.empty((), dtype=dtype).element_size()
        per_layer = self.tensors_per_layer * self.num_kv_heads * self.row_elements(dtype)
        return self.num_layers * per_layer * element_size


def kv_cache_spec(
    config: ModelConfig, tp_size: int = 1, stage: PipelineStage | None = None
) -> KVCacheSpec:
    """The cache of ``config``'s model on one of ``tp_size`` ranks of pipeline ``stage`` (its
    layers only): a latent for every config that names a ``kv_lora_rank`` (DeepSeek-V2/V3),
    keys and values of this rank's KV heads otherwise."""
    c = config.hf_config
    num_layers = len((stage or PipelineStage()).layer_range(config.num_layers))
    if c.get("kv_lora_rank"):
        latent = int(c["kv_lora_rank"]) + int(c["qk_rope_head_dim"])
        return KVCacheSpec(num_layers, 1, latent, tensors_per_layer=1)
    heads = kv_heads_per_rank(config.num_kv_heads, tp_size)
    return KVCacheSpec(num_layers, heads, config.head_dim, tensors_per_layer=2)
