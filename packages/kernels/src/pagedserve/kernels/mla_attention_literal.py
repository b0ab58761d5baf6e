"""Multi-head latent attention, literally: the specifications MLA's paths are held to.

Not used by the engine. Two specifications, one sequence at a time, each line a clause:

- ``mla_paged_decode_literal``: the decode kernel's contract (mla_decode.py), attention of an
  absorbed query over the cached latents, in the latent space.
- ``mla_attention_literal``: MLA as DeepSeek-V2's paper writes it, over the paged latent cache:
  every cached latent expanded to each head's key ``[W_UK[h] kv_c | k_pe]`` and value
  ``W_UV[h] kv_c``, then causal attention with an offset (as ``paged_attention``). The
  model's absorbed decode path and its expanded prefill path (models/layers/mla.py) must
  both equal it.

Shapes: ``latent_cache [num_blocks, block_size, 1, L + R]`` (``kv_c`` then ``k_pe`` per token);
``w_uk [H, P, L]`` and ``w_uv [H, V, L]`` (the rows of ``kv_b_proj``'s weight, per head: first
its P key rows, then its V value rows).
"""

from __future__ import annotations

import torch


def _cached_latents(latent_cache, block_tables, b: int, seq_len: int) -> torch.Tensor:
    """Sequence b's latents, positions 0 .. seq_len - 1, fp32 ``[seq_len, L + R]``: position p
    lives in slot ``block_tables[b, p // block_size] * block_size + p % block_size``."""
    block_size = latent_cache.shape[1]
    pos = torch.arange(seq_len, device=latent_cache.device)
    return latent_cache[block_tables[b, pos // block_size].long(), pos % block_size, 0].float()


def mla_paged_decode_literal(
    query: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """Same signature and result as ``mla_paged_decode``: ``query [B, H, L + R]`` -> ``[B, H, L]``."""
    out = query.new_zeros(query.shape[0], query.shape[1], kv_lora_rank)
    for b in range(seq_lens.shape[0]):
        latents = _cached_latents(latent_cache, block_tables, b, int(seq_lens[b]))
        scores = query[b].float() @ latents.T * scale  # [H, seq_len]: key = the whole latent
        probs = torch.softmax(scores, dim=-1)
        out[b] = (probs @ latents[:, :kv_lora_rank]).to(query.dtype)  # value = kv_c
    return out


def mla_attention_literal(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of ``q_nope [T, H, P]`` and the rotated ``q_pe [T, H, R]`` (the new tokens of B
    sequences, flattened as for ``paged_attention``) over the expanded latents; ``[T, H, V]``."""
    n_heads, kv_lora_rank = w_uk.shape[0], w_uk.shape[2]
    out = q_nope.new_zeros(q_nope.shape[0], n_heads, w_uv.shape[1])
    for b in range(seq_lens.shape[0]):
        start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        seq_len, q_len = int(seq_lens[b]), end - start
        if q_len == 0:
            continue
        latents = _cached_latents(latent_cache, block_tables, b, seq_len)
        kv_c, k_pe = latents[:, :kv_lora_rank], latents[:, kv_lora_rank:]
        k_nope = torch.einsum("nl,hpl->nhp", kv_c, w_uk.float())  # each head's own key part
        keys = torch.cat([k_nope, k_pe[:, None].expand(-1, n_heads, -1)], dim=-1)
        values = torch.einsum("nl,hvl->nhv", kv_c, w_uv.float())
        queries = torch.cat([q_nope[start:end], q_pe[start:end]], dim=-1).float()
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale
        # New token j sits at position seq_len - q_len + j and sees positions <= its own.
        q_pos = seq_len - q_len + torch.arange(q_len, device=q_nope.device)
        hidden = torch.arange(seq_len, device=q_nope.device)[None, None, :] > q_pos[None, :, None]
        probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
        out[start:end] = torch.einsum("hqk,khv->qhv", probs, values).to(out.dtype)
    return out
