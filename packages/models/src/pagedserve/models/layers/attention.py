"""Paged attention as a model layer, and the batch metadata it reads; an encoder's attention.

The model runner flattens a step's sequences into one varlen batch and describes it with an
``AttentionMetadata``, passed explicitly down to every attention layer (no global state). Each
layer first stores the new tokens' keys and values into the paged cache, then attends over the
cache through the block tables, so decode, prefill, chunked prefill and prefill over a cached
prefix are the same call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedserve.kernels import encoder_attention, paged_attention, store_kv
from pagedserve.models.layers.batch_invariance import building_batch_invariant


@dataclass
class AttentionMetadata:
    """One step's varlen batch of B sequences and T new tokens.

    slot_mapping [T]: cache slot of each new token (-1: do not store).
    block_tables [B, max_blocks] int32; seq_lens [B] int32: cached tokens incl. the new ones;
    query_start_loc [B+1] int32: where each sequence's new tokens start in the flat batch.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor


class PagedAttention(nn.Module):
    """Store this step's K/V into the cache, then attend through the block tables.

    ``sliding_window`` (None: global) is this layer's window, as the model's config gives it
    per layer; ``logits_soft_cap`` caps its scores (Gemma 2). Batch invariant when the model
    is built so (layers/batch_invariance.py)."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.batch_invariant = building_batch_invariant()

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = query.shape[0]
        query = query.view(num_tokens, self.num_heads, self.head_dim)
        key = key.view(num_tokens, self.num_kv_heads, self.head_dim)
        value = value.view(num_tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        out = paged_attention(
            query,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            self.scale,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
            batch_invariant=self.batch_invariant,
        )
        return out.reshape(num_tokens, self.num_heads * self.head_dim)


@dataclass
class EncoderAttentionMetadata:
    """One step of an encoder (a pooling model with bidirectional attention): B whole
    sequences, T tokens, end to end. ``query_start_loc`` [B+1] int32: where each sequence
    starts in the flat batch; ``max_seq_len``: the longest one.

    There is no slot mapping and no block table: an encoder reads each sequence whole in one
    step and keeps nothing for a later one, so it has no KV cache (docs/pooling.md).
    """

    query_start_loc: torch.Tensor
    max_seq_len: int


class EncoderAttention(nn.Module):
    """Every token attends to every token of its own sequence (kernels.encoder_attention)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        meta: EncoderAttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = query.shape[0]
        out = encoder_attention(
            query.view(num_tokens, self.num_heads, self.head_dim),
            key.view(num_tokens, self.num_kv_heads, self.head_dim),
            value.view(num_tokens, self.num_kv_heads, self.head_dim),
            meta.query_start_loc,
            meta.max_seq_len,
            self.scale,
        )
        return out.reshape(num_tokens, self.num_heads * self.head_dim)
