"""Paged attention as a model layer, and the batch metadata it reads; an encoder's attention.

The model runner flattens a step's sequences into one varlen batch and describes it with an
``AttentionMetadata``, passed explicitly down to every attention layer (no global state). Each
layer first stores the new tokens' keys and values into the paged cache, then attends over the
cache through the block tables, so decode, prefill, chunked prefill and prefill over a cached
prefix are the same call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch import nn

from pagedserve.kernels import encoder_attention, paged_attention, store_kv
from pagedserve.models.layers.batch_invariance import building_batch_invariant

# A field's metadata marking a host-side copy: tensor-parallel ranks receive it inside the step's
# control message (pickled), not over the device group with the device tensors.
HOST_COPY = {"host_copy": True}


@dataclass(frozen=True)
class DecodeSplit:
    """Which sequences of a step decode (one new token) and which run more (a prompt, a prefill
    chunk, proposals to verify), for layers that treat the two apart (multi-head latent
    attention: the absorbed decode beside the expanded prefill).

    ``decode_seqs`` [Bd] and ``decode_rows`` [Bd] (int64, on the batch's device): the decoding
    sequences and their rows in the flat batch; both None when every sequence decodes (a
    pure-decode step: no index to gather). ``prefills``: ``(sequence, first row, end row,
    seq_len)`` of each longer one, on the host.
    """

    num_decodes: int
    decode_seqs: torch.Tensor | None
    decode_rows: torch.Tensor | None
    prefills: list[tuple[int, int, int, int]]


@dataclass
class AttentionMetadata:
    """One step's varlen batch of B sequences and T new tokens.

    slot_mapping [T]: cache slot of each new token (-1: do not store).
    block_tables [B, max_blocks] int32; seq_lens [B] int32: cached tokens incl. the new ones;
    query_start_loc [B+1] int32: where each sequence's new tokens start in the flat batch;
    query_start_loc_cpu, seq_lens_cpu: the same two on the host, where the runner has them (it
    always does), so a layer that splits decodes from prefills (``decode_split``) never waits
    for the device.
    key_limits [T] int32 or None: each new token's exclusive bound on the key positions it
    attends to (kernels.paged_attention): the end of its image for an image's token, so that
    the image attends to itself both ways (Gemma 3), ``position + 1`` for every other; None
    for a causal step. On the device, as query_start_loc; every paged attention layer reads it.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor | None = field(default=None, metadata=HOST_COPY)
    seq_lens_cpu: torch.Tensor | None = field(default=None, metadata=HOST_COPY)
    key_limits: torch.Tensor | None = None

    @cached_property
    def decode_split(self) -> DecodeSplit:
        """The step's ``DecodeSplit``, worked out once per step (every layer reads the same)."""
        starts = _on_host(self.query_start_loc_cpu, self.query_start_loc).long()
        q_lens = starts[1:] - starts[:-1]
        decodes = (q_lens == 1).nonzero().flatten()
        longer = (q_lens > 1).nonzero().flatten().tolist()
        if longer:
            seq_lens = _on_host(self.seq_lens_cpu, self.seq_lens).tolist()
            bounds = starts.tolist()
            prefills = [(b, bounds[b], bounds[b + 1], seq_lens[b]) for b in longer]
        else:
            prefills = []
        if len(decodes) == len(q_lens):
            return DecodeSplit(len(decodes), None, None, prefills)
        device = self.query_start_loc.device
        seqs = decodes.to(device, non_blocking=True)
        rows = starts[decodes].to(device, non_blocking=True)
        return DecodeSplit(len(decodes), seqs, rows, prefills)


def _on_host(host: torch.Tensor | None, device: torch.Tensor) -> torch.Tensor:
    """The host copy where there is one, else (metadata built by hand) the device tensor read."""
    return device.cpu() if host is None else host


class PagedAttention(nn.Module):
    """Store this step's K/V into the cache, then attend through the block tables.

    ``sliding_window`` (None: global) is this layer's window, as the model's config gives it
    per layer; ``logits_soft_cap`` caps its scores (Gemma 2); ``sinks`` (gpt-oss), a learned
    logit per query head of this rank in the softmax's denominator, is the layer's parameter
    (``attn.sinks``). Batch invariant when the model is built so (layers/batch_invariance.py)."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: nn.Parameter | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.batch_invariant = building_batch_invariant()
        self.sinks = sinks

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
            sinks=self.sinks,
            key_limits=meta.key_limits,
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
