"""Rotary position embedding (RoPE), applied in place to query and key.

``cos_sin_cache`` is ``[max_position, rot_dim]``: cos in the first ``rot_dim/2`` columns, sin
in the last (vLLM's layout). Any rope scaling (llama3, linear, ...) is already baked into the
cache by the model code, so this kernel only rotates. Only the first ``rot_dim <= head_dim``
dims of each head turn (partial rotary, e.g. GPT-J/Phi); the rest pass through untouched.

For pair index i < rot_dim/2 the rotated pair is (x1, x2) -> (x1*cos - x2*sin, x2*cos + x1*sin)
where (x1, x2) = (x[i], x[i + rot_dim/2]) in the neox/Llama layout (transformers'
rotate_half) and (x[2i], x[2i+1]) in the GPT-J interleaved layout.

M-RoPE (Qwen2-VL's multimodal rotary, ``mrope_section``): ``positions`` is ``[S, T]``, one row
per axis (temporal, height, width for the text model; height, width for the vision tower's 2-D
rotary), and the pairs are cut into S consecutive sections that sum to rot_dim/2: pair i turns
by the angle of row d(i), the section it falls in, read from the cache at column i (cos) and
rot_dim/2 + i (sin). With all rows equal it is plain RoPE.
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


# positions_row_stride is the token count under M-RoPE: unspecialised, so that a decode step
# (T = 1) and a prefill compile the same variant.
@triton.jit(do_not_specialize=["positions_row_stride"])
def _rotary_embedding_kernel(
    positions_ptr, q_ptr, k_ptr, cos_sin_ptr,
    q_token_stride, q_head_stride, k_token_stride, k_head_stride, cache_row_stride,
    positions_row_stride, n_q_heads, n_k_heads, half, section1_start, section2_start,
    IS_NEOX: tl.constexpr, NUM_SECTIONS: tl.constexpr, BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    """One program per token. Plain RoPE (NUM_SECTIONS 1) reads one position for all pairs;
    M-RoPE gathers each pair's position from the row of its section, so each pair's cos/sin
    comes from its own cache row (sections start at pairs ``section1_start`` and
    ``section2_start``; with two sections the second start is ``half``)."""
    token = tl.program_id(0).to(tl.int64)
    pairs = tl.arange(0, BLOCK_HALF)[None, :]
    pair_mask = pairs < half
    if NUM_SECTIONS == 1:
        pos = tl.load(positions_ptr + token).to(tl.int64)
    else:
        section = (pairs >= section1_start).to(tl.int64) + (pairs >= section2_start).to(tl.int64)
        pos_ptrs = positions_ptr + section * positions_row_stride + token
        pos = tl.load(pos_ptrs, mask=pair_mask, other=0).to(tl.int64)
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
    mrope_section: tuple[int, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch wrapper: one program per token rotates all its query and key heads in place."""
    _check(positions, query, key, cos_sin_cache, mrope_section)
    query = query if query.stride(-1) == 1 else query.contiguous()
    key = key if key.stride(-1) == 1 else key.contiguous()
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    positions = positions.contiguous()
    half = cache.shape[-1] // 2
    if mrope_section is None:
        num_sections, row_stride, starts = 1, 0, (half, half)
    else:
        num_sections, row_stride = len(mrope_section), positions.stride(0)
        starts = (mrope_section[0], mrope_section[0] + mrope_section[1])
    if query.shape[0]:
        _rotary_embedding_kernel[(query.shape[0],)](
            positions, query, key, cache,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1), cache.stride(0),
            row_stride, query.shape[1], key.shape[1], half, *starts,
            IS_NEOX=is_neox, NUM_SECTIONS=num_sections,
            BLOCK_HQ=triton.next_power_of_2(query.shape[1]),
            BLOCK_HK=triton.next_power_of_2(key.shape[1]),
            BLOCK_HALF=triton.next_power_of_2(half),
        )  # fmt: skip
    return query, key


def _check(positions, query, key, cos_sin_cache, mrope_section=None) -> None:
    if query.dim() != 3 or key.dim() != 3 or query.shape[0] != key.shape[0]:
        raise ValueError(
            f"rotary_embedding: query {tuple(query.shape)} and key {tuple(key.shape)} "
            "must be [T, H, D] with the same T"
        )
    n_tokens, rot_dim = query.shape[0], cos_sin_cache.shape[-1]
    if mrope_section is None:
        if positions.shape != (n_tokens,):
            raise ValueError(f"rotary_embedding: positions {tuple(positions.shape)} != (T,)")
    elif len(mrope_section) not in (2, 3) or min(mrope_section) < 0:
        raise ValueError(
            f"rotary_embedding: mrope_section {tuple(mrope_section)} must be 2 or 3 sizes >= 0"
        )
    elif sum(mrope_section) != rot_dim // 2:
        raise ValueError(
            f"rotary_embedding: mrope_section {tuple(mrope_section)} sums to "
            f"{sum(mrope_section)}, not rot_dim/2 = {rot_dim // 2}"
        )
    elif positions.shape != (len(mrope_section), n_tokens):
        raise ValueError(
            f"rotary_embedding: M-RoPE positions {tuple(positions.shape)} != "
            f"({len(mrope_section)}, T={n_tokens}), one row per section"
        )
    if rot_dim % 2 or rot_dim > query.shape[-1] or key.shape[-1] != query.shape[-1]:
        raise ValueError(f"rotary_embedding: rot_dim {rot_dim} must be even and <= head_dim")


def _cos_sin(
    positions: torch.Tensor, cos_sin_cache: torch.Tensor, mrope_section: tuple[int, ...] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin as fp32 ``[T, 1, rot_dim/2]``; under M-RoPE pair i's from row d(i)."""
    if mrope_section is None:
        return cos_sin_cache[positions.long()].float().unsqueeze(1).chunk(2, dim=-1)
    half = cos_sin_cache.shape[-1] // 2
    device = positions.device
    pairs = torch.arange(half, device=device)
    sections = torch.repeat_interleave(
        torch.arange(len(mrope_section), device=device),
        torch.tensor(mrope_section, device=device),
    )  # d(i) for each pair i
    pos = positions.long()[sections, :].T  # [T, half]: the position each pair turns by
    cos, sin = cos_sin_cache[pos, pairs], cos_sin_cache[pos, half + pairs]
    return cos.float().unsqueeze(1), sin.float().unsqueeze(1)


def rotary_embedding_ref(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
    mrope_section: tuple[int, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: gather cos/sin by position (per pair under M-RoPE), rotate in fp32, write back
    in place."""
    _check(positions, query, key, cos_sin_cache, mrope_section)
    cos, sin = _cos_sin(positions, cos_sin_cache, mrope_section)
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
    mrope_section: tuple[int, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``query [T, Hq, D]`` and ``key [T, Hkv, D]`` by their token ``positions [T]``
    (``[S, T]`` with ``mrope_section``: M-RoPE, see the module docstring)."""
    path = kernel_path(query, has_numba=mrope_section is None)
    if path == "triton":
        return rotary_embedding_triton(
            positions, query, key, cos_sin_cache, is_neox, mrope_section=mrope_section
        )
    if path == "numba":
        from pagedserve.kernels.cpu import layer_ops as ops

        if ops.supports(query, key, cos_sin_cache):
            _check(positions, query, key, cos_sin_cache)
            return ops.rotary_embedding_numba(positions, query, key, cos_sin_cache, is_neox)
    return rotary_embedding_ref(
        positions, query, key, cos_sin_cache, is_neox, mrope_section=mrope_section
    )
