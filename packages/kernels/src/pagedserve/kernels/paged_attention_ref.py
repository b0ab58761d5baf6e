"""Paged attention's PyTorch reference: the CPU engine's vectorised path (and the shape checks
every implementation shares).

Same contract as :func:`pagedserve.kernels.paged_attention.paged_attention` (that module's
docstring; the Triton kernel and its launch wrapper live there, this file holds their third
part, kept apart because the kernel and the reference together passed 400 lines once sliding
windows and soft-capping joined). Decode rows are batched into two matmuls over a gather of
each sequence's context; a longer chunk goes to SDPA's flash kernel, one sequence at a time.
Attention sinks enter SDPA as one more key: a zero key and value whose score the float mask
sets to the head's sink.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels.kv_q8 import dequantize_q8_ref, head_dim_of, is_q8


def _check(
    query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, sinks=None, key_limits=None
) -> None:
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"paged_attention: key cache dtype {k_cache.dtype} and value cache dtype "
            f"{v_cache.dtype} differ"
        )
    if query.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"paged_attention: query {tuple(query.shape)} must be [T, Hq, D] and caches "
            f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)} [num_blocks, block_size, Hkv, D]"
        )
    n_q_heads, head_dim = query.shape[1:]
    n_kv_heads = k_cache.shape[2]
    if head_dim_of(k_cache) != head_dim or n_q_heads % n_kv_heads:
        raise ValueError(
            f"paged_attention: Hq={n_q_heads}, D={head_dim} incompatible with cache "
            f"Hkv={n_kv_heads}, D={head_dim_of(k_cache)} (need same D and Hq % Hkv == 0)"
        )
    n_seqs = seq_lens.shape[0]
    if query_start_loc.shape != (n_seqs + 1,) or block_tables.dim() != 2:
        raise ValueError(
            f"paged_attention: {n_seqs} seq_lens need query_start_loc [{n_seqs + 1}] and "
            f"block_tables [{n_seqs}, max_blocks]; got {tuple(query_start_loc.shape)}, "
            f"{tuple(block_tables.shape)}"
        )
    if sinks is not None and sinks.shape != (n_q_heads,):
        raise ValueError(
            f"paged_attention: sinks {tuple(sinks.shape)} must be [Hq] = [{n_q_heads}], one "
            "logit per query head"
        )
    if key_limits is not None and not (
        isinstance(key_limits, torch.Tensor)
        and key_limits.dtype == torch.int32
        and key_limits.shape == (query.shape[0],)
        and key_limits.device == query.device
    ):
        got = (
            f"{key_limits.dtype} {tuple(key_limits.shape)} on {key_limits.device}"
            if isinstance(key_limits, torch.Tensor)
            else type(key_limits).__name__
        )
        raise ValueError(
            f"paged_attention: key_limits must be int32 [T] = [{query.shape[0]}] on the "
            f"query's device ({query.device}), one exclusive key bound per query row; got {got}"
        )


def _gather_kv(
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    first: torch.Tensor | None = None,
) -> torch.Tensor:
    """Cached positions ``first[i] .. seq_lens[i] - 1`` of n sequences (all of them when
    ``first`` is None), heads first, in fp32: ``[Hkv, n, max_len, D]``.

    Positions past a sequence's end are clamped to its last token, so only the sequence's
    own blocks, only slots < seq_len and (under a window) none before ``first`` are read:
    stale slots and freed blocks never enter, and the padding holds finite values that the
    -inf mask on the scores turns into exact zeros. Two passes over the gathered tokens
    only: a row gather from the contiguous cache (an index_select on a transposed view would
    copy the whole cache first), then one transposing copy into the layout the batched
    matmuls read.
    """
    block_size, n_kv_heads, width = cache.shape[1:]
    lens = seq_lens.long() if first is None else seq_lens.long() - first.long()
    n_seqs, max_len = seq_lens.shape[0], int(lens.max())
    pos = torch.arange(max_len, device=cache.device)
    pos = torch.minimum(pos[None, :], (lens - 1)[:, None])  # [n, max_len]
    if first is not None:
        pos = pos + first.long()[:, None]
    slots = block_tables.long().gather(1, pos // block_size) * block_size + pos % block_size
    rows = cache.view(-1, n_kv_heads * width).index_select(0, slots.flatten())
    rows = rows.view(n_seqs, max_len, n_kv_heads, width)
    if is_q8(rows):  # q8_0 rows: their elements times their groups' scales (kv_q8.py)
        rows = dequantize_q8_ref(rows)
    kv = torch.empty(n_kv_heads, n_seqs, max_len, rows.shape[-1], device=cache.device)
    return kv.copy_(rows.permute(2, 0, 1, 3))


def _soft_cap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    return scores if cap is None else torch.tanh(scores / cap) * cap


def _softmax(scores: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim of ``scores``; with ``sink`` (each row's head's sink, shaped
    to broadcast to ``scores[..., :1]``) in the denominator, its own weight dropped."""
    if sink is None:
        return torch.softmax(scores, dim=-1)
    sink = sink.float().expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


def _decode_ref(
    query, k_cache, v_cache, block_tables, seq_lens, scale, window, cap, sinks, limits=None
):
    """All q_len == 1 rows at once: one gather per cache, two batched matmuls, fp32 softmax.
    Under a window each row reads its last ``window`` positions only; with ``limits`` (each
    row's key limit, or None: causal) a row sees positions below its limit only."""
    n_seqs, n_q_heads, head_dim = query.shape
    n_kv_heads = k_cache.shape[2]
    first = None if window is None else (seq_lens.long() - window).clamp(min=0)
    k = _gather_kv(k_cache, block_tables, seq_lens, first)  # [Hkv, n, L, D]
    v = _gather_kv(v_cache, block_tables, seq_lens, first)
    q = query.float().view(n_seqs, n_kv_heads, n_q_heads // n_kv_heads, head_dim).transpose(0, 1)
    scores = _soft_cap(torch.matmul(q, k.transpose(-1, -2)) * scale, cap)  # [Hkv, n, G, L]
    ends = seq_lens.long() if limits is None else torch.minimum(limits.long(), seq_lens.long())
    n_read = ends if first is None else ends - first
    past_end = torch.arange(k.shape[2], device=k.device) >= n_read[:, None]
    scores.masked_fill_(past_end[None, :, None, :], float("-inf"))
    sink = None if sinks is None else sinks.view(n_kv_heads, 1, -1, 1)  # as the scores' heads
    out = torch.matmul(_softmax(scores, sink), v)  # [Hkv, n, G, D]
    return out.transpose(0, 1).reshape(n_seqs, n_q_heads, head_dim).to(query.dtype)


def _prefill_ref(
    query, k_cache, v_cache, block_table, seq_len, scale, window=None, cap=None, sinks=None,
    limits=None,
) -> torch.Tensor:  # fmt: skip
    """One sequence with q_len > 1: SDPA over exactly the cached tokens it sees.

    The inputs are 4-D ([1, H, L, D]) with the KV heads repeated to the query heads: that is
    what sends CPU SDPA to its flash kernel. 3-D inputs, or ``enable_gqa`` on older torch,
    fall back to the "math" path, which materialises the scores (several times slower).
    A window reads from the first new token's horizon on and masks each row's own; a soft
    cap needs the scores themselves, so it takes the explicit softmax. ``limits`` (each row's
    key limit, or None: causal) replaces the causal bound in the mask."""
    q_len, n_q_heads, _ = query.shape
    group = n_q_heads // k_cache.shape[2]
    first = 0 if window is None else max(0, int(seq_len) - q_len - window + 1)
    first_t = None if window is None else torch.tensor([first], device=query.device)
    k = _gather_kv(k_cache, block_table[None], seq_len[None], first_t).transpose(0, 1)
    v = _gather_kv(v_cache, block_table[None], seq_len[None], first_t).transpose(0, 1)
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    q = query.float().transpose(0, 1)[None]  # [1, Hq, q_len, D]
    seq_end = first + k.shape[2]
    q_pos = torch.arange(seq_end - q_len, seq_end, device=query.device)[:, None]
    k_pos = torch.arange(first, seq_end, device=query.device)[None, :]
    mask = None
    if limits is not None:
        mask = k_pos < limits.long()[:, None]
    elif window is not None or seq_end > q_len or cap is not None or sinks is not None:
        mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    if cap is not None:
        scores = _soft_cap(torch.matmul(q, k.transpose(-1, -2)) * scale, cap)
        sink = None if sinks is None else sinks.view(1, -1, 1, 1)
        probs = _softmax(scores.masked_fill(~mask, float("-inf")), sink)
        out = torch.matmul(probs, v)
    else:
        if sinks is not None:
            k, v, mask = _with_sink_key(k, v, mask, sinks)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale
        )
    return out[0].transpose(0, 1).to(query.dtype)


def _with_sink_key(k, v, mask, sinks):
    """``k``, ``v`` ``[1, Hq, L, D]`` and the visibility ``mask [q_len, L]`` with the sinks
    as one more key: a zero key and value, and a float mask that adds 0 to a visible score,
    -inf to a hidden one and the head's sink to the extra key's (whose dot product is 0)."""
    k, v = F.pad(k, (0, 0, 0, 1)), F.pad(v, (0, 0, 0, 1))
    bias = torch.zeros(mask.shape[0], mask.shape[1] + 1, device=k.device)
    bias[:, :-1].masked_fill_(~mask, float("-inf"))
    bias = bias.expand(k.shape[1], *bias.shape).clone()  # [Hq, q_len, L + 1]
    bias[:, :, -1] = sinks.float()[:, None]
    return k, v, bias[None]


def paged_attention_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    key_limits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference and CPU hot path: decode rows batched, one SDPA per longer sequence."""
    _check(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, sinks, key_limits)
    out = torch.zeros_like(query)
    starts = query_start_loc.long()
    q_lens = starts[1:] - starts[:-1]
    decode = (q_lens == 1).nonzero().flatten()
    window, cap = sliding_window, logits_soft_cap
    if decode.numel():
        rows = starts[decode]
        out[rows] = _decode_ref(
            query[rows], k_cache, v_cache, block_tables[decode], seq_lens[decode], scale,
            window, cap, sinks, None if key_limits is None else key_limits[rows],
        )  # fmt: skip
    prefill = (q_lens > 1).nonzero().flatten().tolist()
    bounds = starts.tolist()
    for b in prefill:
        start, end = bounds[b], bounds[b + 1]
        out[start:end] = _prefill_ref(
            query[start:end],
            k_cache,
            v_cache,
            block_tables[b],
            seq_lens[b],
            scale,
            window,
            cap,
            sinks,
            None if key_limits is None else key_limits[start:end],
        )
    return out
