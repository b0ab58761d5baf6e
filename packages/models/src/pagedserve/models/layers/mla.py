"""Multi-head latent attention (DeepSeek-V2/V3) over a paged cache of latents.

Each token is projected to a latent ``kv_a_proj_with_mqa(x) = [c | k_pe]``: ``kv_lora_rank``
(L) compressed values, normalised to ``kv_c``, and one rotary key of ``qk_rope_head_dim`` (R)
shared by every head. Only ``[kv_c | k_pe]`` is cached (store_latent), one row per token and
layer: L + R = 576 values where DeepSeek-V3's 128 heads would otherwise cache 128 x (192 key +
128 value) = 40,960. Head h's key and value are up-projections of ``kv_c`` by ``kv_b_proj``'s
rows for that head, ``W_UK[h]`` (P = ``qk_nope_head_dim`` rows) and ``W_UV[h]`` (V =
``v_head_dim``); its query is ``[q_nope | q_pe]``, the second part rotated like ``k_pe``:

    score(h, t, p) = q_nope[t, h] . (W_UK[h] kv_c[p]) + q_pe[t, h] . k_pe[p]

Two ways to compute the same attention, both held to ``mla_attention_literal``:

- decode (one new token per sequence, reading the whole cache): the *absorbed* path. By
  associativity ``q_nope . (W_UK kv_c) = (W_UK^T q_nope) . kv_c``, so the query moves into the
  latent space once (``[W_UK[h]^T q_nope | q_pe]``, L + R values per head) and attention runs
  over the cached latents as they are (``mla_paged_decode``), every head sharing each latent
  read; ``W_UV`` is applied once to the output. Nothing per cached token is expanded.
- prefill (many new tokens): the *expanded* path. The sequence's latents are up-projected to
  per-head keys and values once and ordinary causal attention runs over them: with many query
  rows, attending in the L + R-wide latent space would cost more multiplies than expanding.

The split is per sequence, from the step's ``DecodeSplit`` (host-side, no device sync).

In the batch-invariant mode (docs/batch_invariance.md) every row takes the absorbed path, prefill
rows too, through paged attention's batch-invariant kernel: a token's bits then do not depend on
whether it is decoded, prefilled whole or in chunks, after a prefix hit, or recomputed after a
preemption (the expanded path's SDPA tiles by the chunk).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels import mla_paged_decode, paged_attention, store_latent
from pagedserve.kernels.linear import linear
from pagedserve.models.config import ModelConfig
from pagedserve.models.layers.attention import AttentionMetadata
from pagedserve.models.layers.batch_invariance import building_batch_invariant
from pagedserve.models.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedserve.models.layers.linear_method import WeightShard, load_shard, loadable_param
from pagedserve.models.layers.norm import RMSNorm
from pagedserve.models.layers.rotary import RotaryEmbedding, rope_parameters, yarn_mscale
from pagedserve.models.parallel import ParallelContext

LATENT_NORM_EPS = 1e-6  # q_a_layernorm's and kv_a_layernorm's (not rms_norm_eps), as DeepSeek's


class LatentUpProjection(nn.Module):
    """``kv_b_proj``: for each of this rank's heads, its ``W_UK`` rows (P) then its ``W_UV`` rows
    (V), ``weight [H_rank * (P + V), L]``.

    Not a linear layer, on purpose: both paths read its per-head blocks directly (the decode
    folds them into the query and the output), so it stays in the model's dtype whatever a
    load-time quantization does to the projections."""

    def __init__(
        self, kv_lora_rank: int, num_heads: int, qk_nope_head_dim: int, v_head_dim: int,
        dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1,
    ) -> None:  # fmt: skip
        super().__init__()
        rows_per_head = qk_nope_head_dim + v_head_dim
        self.num_heads, self.qk_nope_head_dim = num_heads // tp_size, qk_nope_head_dim
        self.rows, self.total_rows = self.num_heads * rows_per_head, num_heads * rows_per_head
        self.start = tp_rank * self.rows  # this rank's heads' rows, in the checkpoint tensor
        self.weight = loadable_param((self.rows, kv_lora_rank), dtype, self.weight_loader)
        self._key_absorption: torch.Tensor | None = None  # key_absorption's, once asked for

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        shard = WeightShard(0, self.start, self.rows, self.total_rows, "kv_b_proj")
        load_shard(param, loaded, shard)
        self._key_absorption = None  # key_absorption's transpose, of the weight before

    def per_head(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_UK [H, P, L]`` and ``W_UV [H, V, L]``, views of the weight."""
        w = self.weight.view(self.num_heads, -1, self.weight.shape[1])
        return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]

    def key_absorption(self) -> torch.Tensor:
        """``W_UK[h]^T``, ``[H, L, P]`` contiguous: the absorbed query ``q_nope @ W_UK[h]`` as a
        GEMM against an ``[out, in]`` weight (the batch-invariant GEMM's layout). Transposed at
        the first step after the weight is loaded (``weight_loader`` drops it), not per step."""
        if self._key_absorption is None:
            self._key_absorption = self.per_head()[0].transpose(1, 2).contiguous()
        return self._key_absorption


def mla_rotary_embedding(config: ModelConfig) -> RotaryEmbedding:
    """The rope of q_pe and k_pe: ``qk_rope_head_dim`` wide, interleaved pairs (GPT-J style,
    DeepSeek's; V3's ``rope_interleave`` may say otherwise), YaRN as configured. Its cos/sin
    cache spans ``max_position_embeddings`` (V3: 163,840 x 64 fp32, 40 MiB), so a model builds
    one and every layer shares it."""
    c = config.hf_config
    interleaved = bool(c.get("rope_interleave", True))
    rope_dim, max_position = int(c["qk_rope_head_dim"]), config.max_position_embeddings
    return RotaryEmbedding(rope_dim, max_position, rope_parameters(c), is_neox=not interleaved)


def mla_softmax_scale(hf_config: dict, qk_head_dim: int) -> float:
    """``qk_head_dim ** -0.5``, times YaRN's ``mscale(factor, mscale_all_dim) ** 2`` where the
    rope is scaled and the config gives ``mscale_all_dim`` (DeepSeek's long-context configs)."""
    scale = qk_head_dim**-0.5
    params = rope_parameters(hf_config)
    if params["rope_type"] != "default" and params.get("mscale_all_dim"):
        scale *= yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"])) ** 2
    return scale


class MultiHeadLatentAttention(nn.Module):
    """DeepSeek-V2/V3's attention block over the paged latent cache (``kv_cache ==
    (latent_cache,)``); module names are the checkpoint's. Heads are split over tensor-parallel
    ranks (q / q_b, kv_b and o projections); the latent projections are replicated, and so is
    the cache: every rank's heads read all of it. ``rotary_emb``: the model's shared
    ``mla_rotary_embedding`` (by default the layer builds its own)."""

    def __init__(
        self, config: ModelConfig, par: ParallelContext, rotary_emb: RotaryEmbedding | None = None
    ) -> None:
        super().__init__()
        c, dtype = config.hf_config, config.torch_dtype
        heads = config.num_attention_heads
        if heads % par.tp_size:
            raise ValueError(f"{heads} attention heads cannot be split over {par.tp_size} ranks")
        self.num_heads = heads // par.tp_size
        self.kv_lora_rank, self.rope_dim = int(c["kv_lora_rank"]), int(c["qk_rope_head_dim"])
        self.nope_dim, self.v_dim = int(c["qk_nope_head_dim"]), int(c["v_head_dim"])
        bias, hidden = bool(c.get("attention_bias")), config.hidden_size
        q_out = heads * (self.nope_dim + self.rope_dim)
        self.q_lora_rank = int(c.get("q_lora_rank") or 0)
        if self.q_lora_rank:  # V2 / V3: the query through its own low-rank bottleneck
            self.q_a_proj = ColumnParallelLinear(hidden, self.q_lora_rank, bias=bias, dtype=dtype)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS, dtype)
            self.q_b_proj = ColumnParallelLinear(
                self.q_lora_rank, q_out, dtype=dtype, **par.shard_args()
            )
        else:  # V2-Lite: one projection
            self.q_proj = ColumnParallelLinear(hidden, q_out, dtype=dtype, **par.shard_args())
        self.kv_a_proj_with_mqa = ColumnParallelLinear(
            hidden, self.kv_lora_rank + self.rope_dim, bias=bias, dtype=dtype
        )
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS, dtype)
        self.kv_b_proj = LatentUpProjection(
            self.kv_lora_rank, heads, self.nope_dim, self.v_dim, dtype, **par.shard_args()
        )
        self.o_proj = RowParallelLinear(
            heads * self.v_dim, hidden, bias=bias, dtype=dtype, all_reduce=par.all_reduce,
            **par.shard_args(),
        )  # fmt: skip
        self.rotary_emb = rotary_emb or mla_rotary_embedding(config)
        self.scale = mla_softmax_scale(c, self.nope_dim + self.rope_dim)
        self.batch_invariant = building_batch_invariant()

    def forward(self, positions, hidden, kv_cache: tuple[torch.Tensor], meta: AttentionMetadata):
        num_tokens = hidden.shape[0]
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        else:
            q = self.q_proj(hidden)
        q_nope, q_pe = q.view(num_tokens, self.num_heads, -1).split_with_sizes(
            [self.nope_dim, self.rope_dim], dim=-1
        )
        kv_a = self.kv_a_proj_with_mqa(hidden)
        kv_c = self.kv_a_layernorm(kv_a[:, : self.kv_lora_rank])
        q_pe, k_pe = self.rotary_emb(positions, q_pe, kv_a[:, None, self.kv_lora_rank :])
        (latent_cache,) = kv_cache
        store_latent(kv_c, k_pe, latent_cache, meta.slot_mapping)
        out = self.attend(q_nope, q_pe, latent_cache, meta)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.v_dim))

    def attend(self, q_nope, q_pe, latent_cache: torch.Tensor, meta: AttentionMetadata):
        """``[T, H, V]``: each decode row by the absorbed path, each longer sequence by the
        expanded one (the latents of this step already stored); in the batch-invariant mode every
        row by the absorbed path."""
        if self.batch_invariant:
            return self.absorbed_every_row(q_nope, q_pe, latent_cache, meta)
        split = meta.decode_split
        if split.num_decodes and split.decode_rows is None:  # a pure-decode step
            return self.absorbed_decode(
                q_nope, q_pe, latent_cache, meta.block_tables, meta.seq_lens
            )
        out = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.v_dim)
        if split.num_decodes:
            rows, seqs = split.decode_rows, split.decode_seqs
            out[rows] = self.absorbed_decode(
                q_nope[rows], q_pe[rows], latent_cache, meta.block_tables[seqs],
                meta.seq_lens[seqs],
            )  # fmt: skip
        for b, start, end, seq_len in split.prefills:
            out[start:end] = self.expanded_prefill(
                q_nope[start:end], q_pe[start:end], latent_cache, meta.block_tables[b], seq_len
            )
        return out

    def absorbed_decode(self, q_nope, q_pe, latent_cache, block_tables, seq_lens) -> torch.Tensor:
        """One new token for each of B sequences: ``q_nope [B, H, P]``, ``q_pe [B, H, R]`` ->
        ``[B, H, V]``, attending in the latent space."""
        w_uk, w_uv = self.kv_b_proj.per_head()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk)  # [H, B, L]
        query = torch.cat([q_latent.transpose(0, 1), q_pe], dim=-1)
        out_latent = mla_paged_decode(
            query, latent_cache, block_tables, seq_lens, self.scale, self.kv_lora_rank
        )  # [B, H, L]
        return torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def absorbed_every_row(self, q_nope, q_pe, latent_cache, meta: AttentionMetadata):
        """The batch-invariant mode's attention, ``[T, H, V]`` for every row of the step: the
        absorbed query per head through the batch-invariant GEMM, then paged attention's
        batch-invariant kernel over the latents as multi-query attention whose one KV head is
        the latent row (keys: its L + R values; values: the same row, of which the first L are
        kept), causal within each sequence's new rows, then ``W_UV`` per head by the same GEMM."""
        heads, w_uv = range(self.num_heads), self.kv_b_proj.per_head()[1]
        w_uk_t = self.kv_b_proj.key_absorption()
        q_latent = torch.stack([linear(q_nope[:, h], w_uk_t[h], None, True) for h in heads], 1)
        query = torch.cat([q_latent, q_pe], dim=-1)
        out = paged_attention(
            query, latent_cache, latent_cache, meta.block_tables, meta.seq_lens,
            meta.query_start_loc, self.scale, batch_invariant=True,
        )  # fmt: skip
        out_latent = out[..., : self.kv_lora_rank]
        return torch.stack([linear(out_latent[:, h], w_uv[h], None, True) for h in heads], 1)

    def expanded_prefill(self, q_nope, q_pe, latent_cache, block_table, seq_len: int):
        """The new tokens of one sequence (the last ``n`` of its ``seq_len`` cached positions):
        ``q_nope [n, H, P]``, ``q_pe [n, H, R]`` -> ``[n, H, V]``, over its latents expanded to
        per-head keys and values."""
        n_new = q_nope.shape[0]
        latents = cached_latents(latent_cache, block_table, seq_len).to(q_nope.dtype)
        kv_c, k_pe = latents.split_with_sizes([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = F.linear(kv_c, self.kv_b_proj.weight).view(seq_len, self.num_heads, -1)
        k_nope, value = kv.split_with_sizes([self.nope_dim, self.v_dim], dim=-1)
        key = torch.cat([k_nope, k_pe[:, None].expand(-1, self.num_heads, -1)], dim=-1)
        query = torch.cat([q_nope, q_pe], dim=-1)
        mask = None
        if seq_len > n_new:  # over a cached prefix: token j sits at seq_len - n_new + j
            q_pos = torch.arange(seq_len - n_new, seq_len, device=query.device)
            mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1)[None], key.transpose(0, 1)[None], value.transpose(0, 1)[None],
            attn_mask=mask, is_causal=mask is None, scale=self.scale,
        )  # fmt: skip
        return out[0].transpose(0, 1)


def cached_latents(latent_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int):
    """One sequence's cached latents, positions ``0 .. seq_len - 1``: ``[seq_len, L + R]``."""
    block_size = latent_cache.shape[1]
    pos = torch.arange(seq_len, device=latent_cache.device)
    slots = block_table[pos // block_size].long() * block_size + pos % block_size
    return latent_cache.view(-1, latent_cache.shape[-1]).index_select(0, slots)
