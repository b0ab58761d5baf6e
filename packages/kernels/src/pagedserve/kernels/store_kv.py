"""Write the new tokens' keys and values into the paged KV cache.

Caches are ``[num_blocks, block_size, num_kv_heads, head_dim]`` (a q8_0 cache's last dimension
is a row's bytes, ``D + D / 16``: kv_q8.py); token t goes to slot
``s = slot_mapping[t] = block_id * block_size + offset``, i.e. row ``s`` of the cache viewed
as ``[num_blocks * block_size, Hkv, D]``. A slot of -1 is padding and is skipped. A cache of
another dtype than the keys' takes them rounded to its own (an fp8 cache: saturated at ±448,
kv_fp8.py; a q8_0 cache: rows of int8 groups and their scales, kv_q8.py).
Invariant: the valid slots of one call are distinct (the block manager never maps two new
tokens to one slot), so the order of the writes does not matter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.dispatch import kernel_path
from pagedserve.kernels.kv_fp8 import cache_bits, float32_to_e4m3, float32_to_e4m3_ref, is_fp8
from pagedserve.kernels.kv_q8 import head_dim_of, is_q8, quantize_q8, quantize_q8_ref


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    key_token_stride, key_head_stride, value_token_stride, value_head_stride,
    cache_slot_stride, cache_head_stride, n_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr, Q8: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    # A padding slot (-1) is clamped to 0 so no address is ever negative; the mask drops it.
    # (The slot test is broadcast to a tensor: a scalar bool in a mask trips the interpreter.)
    mask = (heads < n_heads) & (dims < head_dim) & ((heads * 0 + slot) >= 0)
    safe_slot = tl.maximum(slot, 0)
    dst = safe_slot * cache_slot_stride + heads * cache_head_stride + dims
    # Padding lanes read as 0: a q8_0 row's amax runs over its whole tile.
    k = tl.load(
        key_ptr + token * key_token_stride + heads * key_head_stride + dims, mask=mask, other=0.0
    )
    v = tl.load(
        value_ptr + token * value_token_stride + heads * value_head_stride + dims,
        mask=mask,
        other=0.0,
    )
    if FP8:  # the caches' bytes (kv_fp8.py)
        k, v = float32_to_e4m3(k), float32_to_e4m3(v)
    if Q8:  # int8 elements, then each group's fp16 scale after the row's (kv_q8.py)
        k, k_scales = quantize_q8(k, BLOCK_H, BLOCK_D)
        v, v_scales = quantize_q8(v, BLOCK_H, BLOCK_D)
        groups = tl.arange(0, BLOCK_D // 32)[None, :]
        at = safe_slot * cache_slot_stride + heads * cache_head_stride + head_dim + 2 * groups
        in_row = (heads < n_heads) & (groups < head_dim // 32) & ((heads * 0 + slot) >= 0)
        tl.store(k_cache_ptr + at, (k_scales & 0xFF).to(tl.int8), mask=in_row)
        tl.store(k_cache_ptr + at + 1, (k_scales >> 8).to(tl.int8), mask=in_row)
        tl.store(v_cache_ptr + at, (v_scales & 0xFF).to(tl.int8), mask=in_row)
        tl.store(v_cache_ptr + at + 1, (v_scales >> 8).to(tl.int8), mask=in_row)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Launch wrapper: one program per new token copies its [Hkv, D] key and value rows."""
    _check(key, value, k_cache, v_cache, slot_mapping)
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    n_tokens, n_heads, head_dim = key.shape
    if n_tokens == 0:
        return
    _store_kv_kernel[(n_tokens,)](
        key, value, cache_bits(k_cache), cache_bits(v_cache), slot_mapping.contiguous(),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(1), k_cache.stride(2), n_heads, head_dim,
        BLOCK_H=triton.next_power_of_2(n_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        FP8=is_fp8(k_cache), Q8=is_q8(k_cache),
    )  # fmt: skip


def _check(key, value, k_cache, v_cache, slot_mapping) -> None:
    if key.shape != value.shape or key.dim() != 3:
        raise ValueError(f"store_kv: key {tuple(key.shape)} / value {tuple(value.shape)}")
    held = (k_cache.shape[2], head_dim_of(k_cache))
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"store_kv: key cache {k_cache.dtype} {tuple(k_cache.shape)} and value cache "
            f"{v_cache.dtype} {tuple(v_cache.shape)} differ"
        )
    if held != tuple(key.shape[1:]):
        raise ValueError(
            f"store_kv: caches {tuple(k_cache.shape)} do not hold [*, *, Hkv, D] = "
            f"[*, *, {key.shape[1]}, {key.shape[2]}]"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("store_kv: KV caches must be contiguous")
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"store_kv: slot_mapping {tuple(slot_mapping.shape)} != (T,)")


def store_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Reference: one indexed copy into the caches viewed as rows of slots."""
    _check(key, value, k_cache, v_cache, slot_mapping)
    slots = slot_mapping.long()
    valid = slots >= 0
    if not bool(valid.all()):
        slots, key, value = slots[valid], key[valid], value[valid]
    for cache, new in ((k_cache, key), (v_cache, value)):
        if is_fp8(cache):
            new = float32_to_e4m3_ref(new)
        elif is_q8(cache):
            new = quantize_q8_ref(new)
        else:
            new = new.to(cache.dtype)
        cache_bits(cache).view(-1, *cache.shape[2:]).index_copy_(0, slots, new)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``key``/``value [T, Hkv, D]`` at ``slot_mapping [T]`` (-1 = skip), in place."""
    path = kernel_path(key, has_numba=True)
    if path == "triton":
        store_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    elif path == "numba":
        from pagedserve.kernels.cpu import layer_ops as ops

        if ops.supports(key, value) and ops.supports_caches(k_cache, v_cache):
            _check(key, value, k_cache, v_cache, slot_mapping)
            ops.store_kv_numba(key, value, k_cache, v_cache, slot_mapping)
        else:
            store_kv_ref(key, value, k_cache, v_cache, slot_mapping)
    else:
        store_kv_ref(key, value, k_cache, v_cache, slot_mapping)
