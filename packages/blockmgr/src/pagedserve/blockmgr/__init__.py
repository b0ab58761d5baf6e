"""pagedserve.blockmgr: the paged KV cache.

Block pool with reference counts and an LRU of freed-but-cached blocks, chained prefix hashes,
the KVCacheManager the scheduler talks to, and the KV cache tensors.
"""

from pagedserve.blockmgr.block_pool import BlockPool, KVBlock
from pagedserve.blockmgr.config import CacheConfig
from pagedserve.blockmgr.kv_cache_manager import KVCacheManager, PrefixCacheStats
from pagedserve.blockmgr.prefix_hash import extend_block_hashes, hash_block

__all__ = [
    "BlockPool",
    "CacheConfig",
    "KVBlock",
    "KVCacheManager",
    "PrefixCacheStats",
    "extend_block_hashes",
    "hash_block",
]
