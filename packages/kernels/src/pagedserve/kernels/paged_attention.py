"""Attention of a varlen batch of new tokens over the paged KV cache.

One call serves decode (q_len 1), whole prompts, prefill chunks and prompts whose prefix is
already cached. Sequence b owns query rows ``query_start_loc[b]:query_start_loc[b+1]``
(q_len of them) and ``seq_lens[b]`` cached tokens, the new ones included (store_kv ran
first). New token j sits at position ``seq_lens[b] - q_len + j`` and attends to every cached
position <= its own (causal with an offset). Key position p lives in slot
``block_tables[b, p // block_size] * block_size + p % block_size``. Query head h reads KV
head ``h // (Hq // Hkv)`` (GQA; MQA when Hkv == 1).

Invariants every implementation keeps: block-table entries past a sequence's
``ceil(seq_len / block_size)`` blocks are padding and are never read; cache slots past
``seq_len`` may hold anything, NaN included, and never reach an output; softmax runs in
fp32; the output has the query's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels.dispatch import use_triton


def paged_attention_triton(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale):
    """Launch wrapper (phase 2)."""
    raise NotImplementedError("paged_attention: the Triton kernel is not written yet")


def _check(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc) -> None:
    if query.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"paged_attention: query {tuple(query.shape)} must be [T, Hq, D] and caches "
            f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)} [num_blocks, block_size, Hkv, D]"
        )
    n_q_heads, head_dim = query.shape[1:]
    n_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or n_q_heads % n_kv_heads:
        raise ValueError(
            f"paged_attention: Hq={n_q_heads}, D={head_dim} incompatible with cache "
            f"Hkv={n_kv_heads}, D={k_cache.shape[3]} (need same D and Hq % Hkv == 0)"
        )
    n_seqs = seq_lens.shape[0]
    if query_start_loc.shape != (n_seqs + 1,) or block_tables.dim() != 2:
        raise ValueError(
            f"paged_attention: {n_seqs} seq_lens need query_start_loc [{n_seqs + 1}] and "
            f"block_tables [{n_seqs}, max_blocks]; got {tuple(query_start_loc.shape)}, "
            f"{tuple(block_tables.shape)}"
        )


def _gather_kv_padded(
    cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
) -> torch.Tensor:
    """The cached tokens of n sequences as ``[n, max_len, Hkv, D]``, zero past each seq_len.

    Only each sequence's own blocks are gathered (padding entries of the block table are
    never used as indices). Slots past seq_len in a sequence's last block are replaced by
    zeros, not merely masked later, because a stale NaN times a zero probability is NaN.
    """
    n_seqs, block_size = seq_lens.shape[0], cache.shape[1]
    device = cache.device
    n_blocks = (seq_lens.long() + block_size - 1) // block_size
    max_blocks = int(n_blocks.max())
    used = torch.arange(max_blocks, device=device) < n_blocks[:, None]
    kv = cache.new_zeros(n_seqs, max_blocks, *cache.shape[1:])
    kv[used] = cache[block_tables[:, :max_blocks][used].long()]
    rows, last = torch.arange(n_seqs, device=device), n_blocks - 1
    tail_len = seq_lens.long() - last * block_size
    keep = torch.arange(block_size, device=device) < tail_len[:, None]
    kv[rows, last] = torch.where(keep[:, :, None, None], kv[rows, last], 0)
    return kv.flatten(1, 2)


def _decode_ref(query, k_cache, v_cache, block_tables, seq_lens, scale) -> torch.Tensor:
    """All q_len == 1 rows at once: one padded gather, two batched matmuls, fp32 softmax."""
    n_seqs, n_q_heads, head_dim = query.shape
    n_kv_heads = k_cache.shape[2]
    k = _gather_kv_padded(k_cache, block_tables, seq_lens).float()  # [n, L, Hkv, D]
    v = _gather_kv_padded(v_cache, block_tables, seq_lens).float()
    q = query.float().view(n_seqs, n_kv_heads, n_q_heads // n_kv_heads, head_dim)
    scores = torch.matmul(q, k.permute(0, 2, 3, 1)) * scale  # [n, Hkv, G, L]
    past_end = torch.arange(k.shape[1], device=k.device) >= seq_lens[:, None]
    scores.masked_fill_(past_end[:, None, None, :], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v.transpose(1, 2))  # [n, Hkv, G, D]
    return out.reshape(n_seqs, n_q_heads, head_dim).to(query.dtype)


def _prefill_ref(query, k_cache, v_cache, block_table, seq_len: int, scale) -> torch.Tensor:
    """One sequence with q_len > 1: SDPA over exactly its seq_len cached tokens."""
    q_len, n_q_heads, head_dim = query.shape
    block_size = k_cache.shape[1]
    blocks = block_table[: (seq_len + block_size - 1) // block_size].long()
    k = k_cache[blocks].flatten(0, 1)[:seq_len].float().transpose(0, 1)  # [Hkv, S, D]
    v = v_cache[blocks].flatten(0, 1)[:seq_len].float().transpose(0, 1)
    q = query.float().transpose(0, 1)  # [Hq, q_len, D]
    n_cached = seq_len - q_len
    mask = None
    if n_cached:
        q_pos = torch.arange(n_cached, seq_len, device=query.device)
        mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=not n_cached, scale=scale,
        enable_gqa=n_q_heads != k.shape[0],
    )  # fmt: skip
    return out.transpose(0, 1).to(query.dtype)


def paged_attention_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Reference and CPU hot path: decode rows batched, one SDPA per longer sequence."""
    _check(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    out = torch.zeros_like(query)
    starts = query_start_loc.long()
    q_lens = starts[1:] - starts[:-1]
    decode = (q_lens == 1).nonzero().flatten()
    if decode.numel():
        rows = starts[decode]
        out[rows] = _decode_ref(
            query[rows], k_cache, v_cache, block_tables[decode], seq_lens[decode], scale
        )
    prefill = (q_lens > 1).nonzero().flatten().tolist()
    bounds, lens = starts.tolist(), seq_lens.tolist()
    for b in prefill:
        start, end = bounds[b], bounds[b + 1]
        out[start:end] = _prefill_ref(
            query[start:end], k_cache, v_cache, block_tables[b], lens[b], scale
        )
    return out


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of ``query [T, Hq, D]`` over the paged cache; returns ``[T, Hq, D]``."""
    args = (query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
    if use_triton(query):
        return paged_attention_triton(*args)
    return paged_attention_ref(*args)
