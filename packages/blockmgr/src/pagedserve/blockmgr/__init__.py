"""pagedserve.blockmgr: the paged KV cache.

Block pool with reference counts and an LRU of freed-but-cached blocks, chained prefix hashes,
the KVCacheManager the scheduler talks to, and (in submodules that import torch or numpy) the
KV cache tensors and sizing, the step layout and the copy-on-write kernel.
"""

from pagedserve.blockmgr.block_pool import BlockPool, BlockPoolExhausted, KVBlock
from pagedserve.blockmgr.config import CacheConfig
from pagedserve.blockmgr.kv_cache_manager import (
    KVCacheManager,
    PrefixCacheStats,
    StalePrefixHitError,
)
from pagedserve.blockmgr.prefix_hash import extend_block_hashes, hash_block

__all__ = [
    "BlockPool",
    "BlockPoolExhausted",
    "CacheConfig",
    "KVBlock",
    "KVCacheManager",
    "PrefixCacheStats",
    "StalePrefixHitError",
    "extend_block_hashes",
    "hash_block",
]
