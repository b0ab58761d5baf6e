"""Rotary position embedding (RoPE), applied in place to query and key.

``cos_sin_cache`` is ``[max_position, rot_dim]``: cos in the first ``rot_dim/2`` columns, sin
in the last (vLLM's layout). Any rope scaling (llama3, linear, ...) is already baked into the
cache by the model code, so this kernel only rotates. Only the first ``rot_dim <= head_dim``
dims of each head turn (partial rotary, e.g. GPT-J/Phi); the rest pass through untouched.

For pair index i < rot_dim/2 the rotated pair is (x1, x2) -> (x1*cos - x2*sin, x2*cos + x1*sin)
where (x1, x2) = (x[i], x[i + rot_dim/2]) in the neox/Llama layout (transformers'
rotate_half) and (x[2i], x[2i+1]) in the GPT-J interleaved layout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.dispatch import kernel_path


@triton.jit
def _rotate_heads(
    x_ptr, token_offset, head_stride, n_heads, cos, sin, half,
    IS_NEOX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    heads = tl.arange(0, BLOCK_H)[:, None]
    pairs = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < n_heads) & (pairs < half)
    if IS_NEOX:
        first = pairs
        second = pairs + half
    else:
        first = 2 * pairs
        second = 2 * pairs + 1
    base = x_ptr + token_offset + heads * head_stride
    x1 = tl.load(base + first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + second, mask=mask, other=0.0).to(tl.float32)
    tl.store(base + first, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(base + second, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_embedding_kernel(
    positions_ptr, q_ptr, k_ptr, cos_sin_ptr,
    q_token_stride, q_head_stride, k_token_stride, k_head_stride, cache_row_stride,
    n_q_heads, n_k_heads, half,
    IS_NEOX: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    pairs = tl.arange(0, BLOCK_HALF)[None, :]
    pair_mask = pairs < half
    cos = tl.load(cos_sin_ptr + pos * cache_row_stride + pairs, mask=pair_mask, other=1.0)
    sin = tl.load(cos_sin_ptr + pos * cache_row_stride + half + pairs, mask=pair_mask, other=0.0)
    cos = cos.to(tl.float32)
    sin = sin.to(tl.float32)
    _rotate_heads(q_ptr, token * q_token_stride, q_head_stride, n_q_heads, cos, sin, half,
                  IS_NEOX, BLOCK_HQ, BLOCK_HALF)  # fmt: skip
    _rotate_heads(k_ptr, token * k_token_stride, k_head_stride, n_k_heads, cos, sin, half,
                  IS_NEOX, BLOCK_HK, BLOCK_HALF)  # fmt: skip


def rotary_embedding_triton(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch wrapper: one program per token rotates all its query and key heads in place."""
    _check(positions, query, key, cos_sin_cache)
    query = query if query.stride(-1) == 1 else query.contiguous()
    key = key if key.stride(-1) == 1 else key.contiguous()
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    half = cache.shape[-1] // 2
    if query.shape[0]:
        _rotary_embedding_kernel[(query.shape[0],)](
            positions.contiguous(), query, key, cache,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1), cache.stride(0),
            query.shape[1], key.shape[1], half,
            IS_NEOX=is_neox, BLOCK_HQ=triton.next_power_of_2(query.shape[1]),
            BLOCK_HK=triton.next_power_of_2(key.shape[1]),
            BLOCK_HALF=triton.next_power_of_2(half),
        )  # fmt: skip
    return query, key


def _check(positions, query, key, cos_sin_cache) -> None:
    if query.dim() != 3 or key.dim() != 3 or query.shape[0] != key.shape[0]:
        raise ValueError(
            f"rotary_embedding: query {tuple(query.shape)} and key {tuple(key.shape)} "
            "must be [T, H, D] with the same T"
        )
    if positions.shape != (query.shape[0],):
        raise ValueError(f"rotary_embedding: positions {tuple(positions.shape)} != (T,)")
    rot_dim = cos_sin_cache.shape[-1]
    if rot_dim % 2 or rot_dim > query.shape[-1] or key.shape[-1] != query.shape[-1]:
        raise ValueError(f"rotary_embedding: rot_dim {rot_dim} must be even and <= head_dim")


def rotary_embedding_ref(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: gather cos/sin rows by position, rotate in fp32, write back in place."""
    _check(positions, query, key, cos_sin_cache)
    cos, sin = cos_sin_cache[positions.long()].float().unsqueeze(1).chunk(2, dim=-1)
    rot_dim = cos_sin_cache.shape[-1]
    for x in (query, key):
        rot = x[..., :rot_dim].float()
        if is_neox:
            x1, x2 = rot.chunk(2, dim=-1)
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        x[..., :rot_dim] = out.to(x.dtype)
    return query, key


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``query [T, Hq, D]`` and ``key [T, Hkv, D]`` by their token ``positions [T]``."""
    path = kernel_path(query, has_numba=True)
    if path == "triton":
        return rotary_embedding_triton(positions, query, key, cos_sin_cache, is_neox)
    if path == "numba":
        from pagedserve.kernels.cpu import layer_ops as ops

        if ops.supports(query, key, cos_sin_cache):
            _check(positions, query, key, cos_sin_cache)
            return ops.rotary_embedding_numba(positions, query, key, cos_sin_cache, is_neox)
    return rotary_embedding_ref(positions, query, key, cos_sin_cache, is_neox)
