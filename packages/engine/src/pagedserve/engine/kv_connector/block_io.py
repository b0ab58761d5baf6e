"""Whole KV blocks out of the paged cache and back in: the KV connector's only tensor work.

A block's record is every layer's key rows and then value rows for its ``block_size`` slots,
``[2 * num_layers, block_size, num_kv_heads, head_dim]`` in the cache's dtype, as raw bytes (a
uint8 numpy array on the host): whatever stores it (host memory, a file, a socket) moves
bytes, and only this module knows their shape. Runs on the engine thread only, between
forwards: a block being saved was written by a finished forward, and a block being loaded is
held by a request that no forward reads until its load is reported done.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.kernels.kv_fp8 import cache_bits


class KVBlockIO:
    """Copies blocks between the KV cache tensors (one ``(k_cache, v_cache)`` per layer, each
    ``[num_blocks, block_size, Hkv, W]``, W a head's row: D elements, or a q8_0 row's
    ``D + D / 16`` bytes) and host byte arrays."""

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        # fp8 caches as their bytes (views): torch copies no fp8 rows by index on a CPU
        self.kv_caches = [(cache_bits(k), cache_bits(v)) for k, v in kv_caches]
        kv_caches = self.kv_caches
        k_cache = kv_caches[0][0]
        self.device = k_cache.device
        self.dtype = k_cache.dtype
        self.block_shape = (2 * len(kv_caches), *k_cache.shape[1:])
        self.block_bytes = k_cache[0].nbytes * 2 * len(kv_caches)

    def gather(self, block_ids: list[int]) -> list[np.ndarray]:
        """Each block's bytes, one contiguous uint8 array per block (owned, not a view)."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        parts = [cache.index_select(0, ids) for layer in self.kv_caches for cache in layer]
        blocks = torch.stack(parts, dim=1).cpu().contiguous()  # [n, 2L, bs, Hkv, D]
        raw = blocks.view(torch.uint8).reshape(len(block_ids), self.block_bytes).numpy()
        return [row.copy() for row in raw]

    def scatter(self, block_ids: list[int], payloads: list[np.ndarray]) -> None:
        """Write each payload (as ``gather`` made it) into its block, every layer."""
        if not block_ids:
            return
        raw = torch.from_numpy(np.stack(payloads))
        blocks = raw.view(self.dtype).reshape(len(block_ids), *self.block_shape).to(self.device)
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for layer, (k_cache, v_cache) in enumerate(self.kv_caches):
            k_cache.index_copy_(0, ids, blocks[:, 2 * layer])
            v_cache.index_copy_(0, ids, blocks[:, 2 * layer + 1])
