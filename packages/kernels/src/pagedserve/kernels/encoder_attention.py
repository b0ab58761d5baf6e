"""Bidirectional attention over a varlen batch, with no KV cache: an encoder's self-attention.

An encoder (BERT, XLM-RoBERTa) reads a whole sequence at once and every token attends to every
token of its own sequence, before and after it. Nothing is kept for a later step, so there is
no cache to write and no block table to read: queries, keys and values are this step's own
``[T, H, D]`` rows, sequence b's tokens at ``query_start_loc[b] : query_start_loc[b + 1]``
(the same flat, unpadded layout the paged kernels take).

The Triton kernel is flash attention without the causal mask: one program per (sequence, query
head, tile of BLOCK_M queries) walks its sequence's keys in tiles of BLOCK_N with an online
softmax, in fp32, ``input_precision="ieee"`` for fp32 inputs (TF32 would miss the fp32
tolerance). Keys past the sequence's end are masked, so sequences never see each other.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pagedserve.kernels.dispatch import use_triton


@triton.jit
def _encoder_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, query_start_loc_ptr, scale,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
    o_stride_t, o_stride_h,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FP32_DOT: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    seq_len = (tl.load(query_start_loc_ptr + seq + 1) - start).to(tl.int32)
    if tile * BLOCK_M >= seq_len:
        return
    kv_head = head // GROUP
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_mask = (offs_m < seq_len)[:, None] & d_mask[None, :]
    rows_m = start + offs_m
    q = tl.load(
        q_ptr + rows_m[:, None] * q_stride_t + head * q_stride_h + offs_d[None, :],
        mask=q_mask, other=0.0,
    )  # fmt: skip
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for n0 in range(0, seq_len, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_valid = offs_n < seq_len
        rows_n = start + offs_n
        kv_mask = n_valid[:, None] & d_mask[None, :]
        k = tl.load(
            k_ptr + rows_n[:, None] * k_stride_t + kv_head * k_stride_h + offs_d[None, :],
            mask=kv_mask, other=0.0,
        )  # fmt: skip
        v = tl.load(
            v_ptr + rows_n[:, None] * v_stride_t + kv_head * v_stride_h + offs_d[None, :],
            mask=kv_mask, other=0.0,
        )  # fmt: skip
        if FP32_DOT:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(n_valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if FP32_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + rows_m[:, None] * o_stride_t + head * o_stride_h + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty), mask=q_mask,
    )  # fmt: skip


def encoder_attention_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:
    """Launch wrapper: ``query`` [T, Hq, D], ``key``/``value`` [T, Hkv, D] (Hq a multiple of
    Hkv; any strides with a unit last dim), ``query_start_loc`` [B + 1] int32; ``max_seq_len``
    the longest sequence (sizes the grid). Returns [T, Hq, D] in the query's dtype."""
    num_tokens, num_heads, head_dim = query.shape
    if key.shape != value.shape or key.shape[0] != num_tokens or key.shape[2] != head_dim:
        raise ValueError(
            f"encoder_attention: key {tuple(key.shape)} / value {tuple(value.shape)} do not "
            f"match query {tuple(query.shape)}"
        )
    if num_heads % key.shape[1]:
        raise ValueError(f"encoder_attention: {num_heads} query heads over {key.shape[1]} kv heads")
    if query.dtype != key.dtype or key.dtype != value.dtype:
        raise ValueError("encoder_attention: query, key and value must share a dtype")
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    num_seqs = query_start_loc.shape[0] - 1
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_m = block_n = 32 if block_d <= 64 else 16
    grid = (num_seqs, num_heads, triton.cdiv(max_seq_len, block_m))
    _encoder_attention_kernel[grid](
        query, key, value, out, query_start_loc, scale,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        value.stride(0), value.stride(1), out.stride(0), out.stride(1),
        GROUP=num_heads // key.shape[1], HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_M=block_m, BLOCK_N=block_n, FP32_DOT=query.dtype == torch.float32,
    )  # fmt: skip
    return out


def encoder_attention_ref(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:
    """Reference: each sequence's full (unmasked) softmax attention, through torch's
    ``scaled_dot_product_attention`` in fp32. Sequences of the same length go through one call
    (stacked, no padding and no mask: each is still attended on its own), so a step of
    hundreds of short sentences makes a few dozen calls, not hundreds."""
    group = query.shape[1] // key.shape[1]
    bounds = query_start_loc.tolist()
    by_length: dict[int, list[int]] = {}
    for start, end in zip(bounds[:-1], bounds[1:]):
        by_length.setdefault(end - start, []).append(start)
    out = torch.empty_like(query, dtype=torch.float32)
    for length, starts in by_length.items():
        if not length:
            continue
        rows = (torch.tensor(starts)[:, None] + torch.arange(length)).flatten()
        q, k, v = (t[rows].float().unflatten(0, (len(starts), length)) for t in (query, key, value))
        if group > 1:
            k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [seqs, heads, length, head_dim]
        attended = F.scaled_dot_product_attention(q, k, v, scale=scale)
        out[rows] = attended.transpose(1, 2).flatten(0, 1)
    return out.to(query.dtype)


def encoder_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:
    """Each token attends to every token of its own sequence (no mask, no cache)."""
    if use_triton(query):
        return encoder_attention_triton(query, key, value, query_start_loc, max_seq_len, scale)
    return encoder_attention_ref(query, key, value, query_start_loc, max_seq_len, scale)
