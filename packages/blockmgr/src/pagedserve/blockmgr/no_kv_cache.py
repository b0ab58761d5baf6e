"""The block manager of a model without a KV cache (an encoder: BERT and its family).

An encoder reads each sequence whole in one step with bidirectional attention and keeps no
keys or values for a later step, so there are no blocks to give out, share or free. The
scheduler still asks the same questions of its block manager (may this chunk run? which blocks
does it use?); this manager answers them for a cache of no blocks: every allocation succeeds
with an empty block table, no prefix is ever cached, usage is 0. So the scheduler has one code
path, and a pooling request on an encoder is limited by the token budget and ``max_num_seqs``
alone (vLLM runs encoder-only models with no KV cache groups, to the same effect).
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.blockmgr.kv_cache_manager import PrefixCacheStats

_NO_BLOCKS: list[int] = []


class NoKVCacheManager:
    """``KVCacheManager``'s interface over a cache of no blocks (see the module docstring)."""

    num_blocks = 0
    num_free_blocks = 0
    watermark_blocks = 0
    enable_prefix_caching = False
    sliding_window = None

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.prefix_cache_stats = PrefixCacheStats()

    def usage(self) -> float:
        return 0.0

    def block_ids(self, seq_id: str) -> list[int]:
        return _NO_BLOCKS

    def get_block_table(self, seq_id: str) -> list[int]:
        return []

    def get_computed_blocks(self, token_ids: Sequence[int], cache_salt=None, lora_int_id=0,
                            images=()):  # fmt: skip
        """No prefix is cached: nothing computed, so every token runs."""
        return [], 0

    def allocate_slots(self, seq_id: str, token_ids, num_computed_tokens, num_new_tokens,
                       computed_blocks=(), cache_salt=None, lora_int_id=0,
                       delay_caching=False, images=()) -> bool:  # fmt: skip
        return True

    def cache_blocks(self, seq_id, token_ids, num_tokens, cache_salt=None, lora_int_id=0) -> None:
        pass

    def free(self, seq_id: str) -> None:
        pass

    def free_blocks_beyond(self, seq_id: str, num_tokens: int) -> None:
        pass

    def fork(self, parent_id: str, child_id: str) -> None:
        raise ValueError("a model without a KV cache has no blocks to fork (pooling only)")

    def take_blocks_to_copy(self) -> list[tuple[int, int]]:
        return []

    def reset_prefix_cache(self) -> bool:
        return True
