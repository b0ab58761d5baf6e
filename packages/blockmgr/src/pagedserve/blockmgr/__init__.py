"""pagedserve.blockmgr: the paged KV cache.

Block pool with reference counts and an LRU of freed-but-cached blocks, chained prefix hashes,
the KVCacheManager the scheduler talks to, and (``slot_mapping``, with numpy) a step's layout.
Host bookkeeping only: the KV cache tensors and their sizing live in ``pagedserve.engine.kv_cache``
and the copy-on-write kernel in ``pagedserve.kernels``.
"""

from pagedserve.blockmgr.block_pool import BlockPool, BlockPoolExhausted, KVBlock
from pagedserve.blockmgr.config import CacheConfig
from pagedserve.blockmgr.kv_cache_manager import (
    KVCacheManager,
    PrefixCacheStats,
    StalePrefixHitError,
)
from pagedserve.blockmgr.no_kv_cache import NoKVCacheManager
from pagedserve.blockmgr.prefix_hash import ImagePlaceholder, extend_block_hashes, hash_block

__all__ = [
    "BlockPool",
    "BlockPoolExhausted",
    "CacheConfig",
    "ImagePlaceholder",
    "KVBlock",
    "KVCacheManager",
    "NoKVCacheManager",
    "PrefixCacheStats",
    "StalePrefixHitError",
    "extend_block_hashes",
    "hash_block",
]
