"""Paged attention, literally: the specification every implementation is held to.

Not a fast path and not used by the engine: :func:`paged_attention_ref` (the CPU engine's
vectorised path) and the Triton kernel are both compared against this in the kernel suite.
Each line is one clause of the contract (``paged_attention``'s docstring): for each sequence,
gather its keys and values through its block table, let each new token see the cached
positions up to its own, or below its ``key_limits`` entry when given (and, with a sliding
window, no further back than the window),
cap the scores (``logits_soft_cap``), softmax in fp32 (with each head's sink, when given, one
more logit in the denominator that weighs no value), weighted sum, cast to the query's dtype.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.kv_q8 import widened


def paged_attention_literal(
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
    """Same signature and result as ``paged_attention``; one sequence at a time."""
    out = torch.zeros_like(query)  # rows no sequence owns stay zero
    block_size, n_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = query.shape[1] // n_kv_heads  # query head h reads KV head h // group
    for b in range(seq_lens.shape[0]):
        start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        seq_len, q_len = int(seq_lens[b]), end - start
        if q_len == 0:
            continue
        # With a window, token j sees positions > its own - window: none before the first
        # new token's horizon is read (their blocks may have been freed).
        first = 0 if sliding_window is None else max(0, seq_len - q_len - sliding_window + 1)
        # Key position p of sequence b lives in slot block_tables[b, p // bs] * bs + p % bs.
        pos = torch.arange(first, seq_len, device=query.device)
        blocks = block_tables[b, pos // block_size].long()
        keys = widened(k_cache[blocks, pos % block_size])  # fp32 [seq_len, Hkv, D]
        values = widened(v_cache[blocks, pos % block_size])
        keys = keys.repeat_interleave(group, dim=1)  # [seq_len, Hq, D]
        values = values.repeat_interleave(group, dim=1)
        # New token j sits at position seq_len - q_len + j and sees positions <= its own.
        q_pos = seq_len - q_len + torch.arange(q_len, device=query.device)
        scores = torch.einsum("qhd,khd->hqk", query[start:end].float(), keys) * scale
        if logits_soft_cap is not None:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        if key_limits is None:
            hidden = pos[None, None, :] > q_pos[None, :, None]
        else:  # token j sees positions below its own limit (an image's end, say)
            hidden = pos[None, None, :] >= key_limits[start:end].long()[None, :, None]
        if sliding_window is not None:
            hidden |= pos[None, None, :] <= q_pos[None, :, None] - sliding_window
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is not None:  # head h's sink joins every row's softmax, then is dropped
            sink_logits = sinks.float()[:, None, None].expand(-1, q_len, 1)
            scores = torch.cat([scores, sink_logits], dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., : len(pos)]
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, values).to(query.dtype)
    return out
