"""Copy whole KV-cache blocks, in every layer: the data move behind copy-on-write.

When a sequence must write into a block it shares with others (a prefix-cache hit, a forked
sequence), the block manager gives it a fresh block and asks for the shared one's contents
to be copied there first. ``src_to_dst [N, 2]`` lists (source block, destination block)
pairs; each pair is copied in every layer's key and value cache. A model whose layers cache
one tensor each (multi-head latent attention's latent) passes its caches as ``k_caches`` and
no ``v_caches``.

Invariant (kept by the block manager): no destination is also a source, and destinations
are distinct, so the copies are independent and their order does not matter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.dispatch import use_triton
from pagedserve.kernels.kv_fp8 import cache_bits


@triton.jit
def _copy_blocks_kernel(
    k_cache_ptr, v_cache_ptr, src_to_dst_ptr, block_numel, BLOCK: tl.constexpr,
    HAS_V: tl.constexpr,
):  # fmt: skip
    pair = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < block_numel
    src = tl.load(src_to_dst_ptr + 2 * pair).to(tl.int64) * block_numel + offs
    dst = tl.load(src_to_dst_ptr + 2 * pair + 1).to(tl.int64) * block_numel + offs
    tl.store(k_cache_ptr + dst, tl.load(k_cache_ptr + src, mask=mask), mask=mask)
    if HAS_V:
        tl.store(v_cache_ptr + dst, tl.load(v_cache_ptr + src, mask=mask), mask=mask)


def copy_blocks_triton(
    k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], src_to_dst: torch.Tensor
) -> None:
    """Launch wrapper: per layer, one program per (pair, chunk of the block's elements)."""
    _check(k_caches, v_caches, src_to_dst)
    if src_to_dst.shape[0] == 0:
        return
    pairs = src_to_dst.to(device=k_caches[0].device, dtype=torch.int64).contiguous()
    has_v = bool(v_caches)
    for k_cache, v_cache in zip(k_caches, v_caches if has_v else k_caches):
        k_cache, v_cache = cache_bits(k_cache), cache_bits(v_cache)  # a copy moves bytes
        block_numel = k_cache[0].numel()
        block = min(4096, triton.next_power_of_2(block_numel))
        grid = (pairs.shape[0], triton.cdiv(block_numel, block))
        _copy_blocks_kernel[grid](k_cache, v_cache, pairs, block_numel, BLOCK=block, HAS_V=has_v)


def _check(k_caches, v_caches, src_to_dst) -> None:
    if v_caches and len(k_caches) != len(v_caches):
        raise ValueError(
            f"copy_blocks: {len(k_caches)} key caches but {len(v_caches)} value caches"
        )
    if src_to_dst.dim() != 2 or src_to_dst.shape[1] != 2:
        raise ValueError(f"copy_blocks: src_to_dst must be [N, 2], got {tuple(src_to_dst.shape)}")
    for k_cache, v_cache in zip(k_caches, v_caches or k_caches):
        if k_cache.shape != v_cache.shape or not (
            k_cache.is_contiguous() and v_cache.is_contiguous()
        ):
            raise ValueError(
                "copy_blocks: each layer's key and value caches must be contiguous, same shape"
            )


def copy_blocks_ref(
    k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], src_to_dst: torch.Tensor
) -> None:
    """Reference: one indexed copy per cache (all pairs at once)."""
    _check(k_caches, v_caches, src_to_dst)
    if src_to_dst.shape[0] == 0:
        return
    pairs = src_to_dst.to(device=k_caches[0].device, dtype=torch.int64)
    src, dst = pairs[:, 0], pairs[:, 1]
    for cache in (*k_caches, *v_caches):
        cache = cache_bits(cache)  # fp8 as bytes: torch has no fp8 index_copy_ on a CPU
        cache.index_copy_(0, dst, cache.index_select(0, src))


def copy_blocks(
    k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], src_to_dst: torch.Tensor
) -> None:
    """Copy block ``src`` to block ``dst`` for each row of ``src_to_dst``, in all layers
    (``v_caches`` empty: the layers cache one tensor each)."""
    if not k_caches:
        return
    if use_triton(k_caches[0]):
        copy_blocks_triton(k_caches, v_caches, src_to_dst)
    else:
        copy_blocks_ref(k_caches, v_caches, src_to_dst)
