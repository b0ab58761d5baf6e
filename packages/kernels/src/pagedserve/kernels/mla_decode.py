"""Multi-head latent attention's decode over the paged latent cache (DeepSeek-V2/V3).

MLA caches one latent per token, shared by every head: ``[kv_c | k_pe]``, the normalised
compressed KV (``kv_lora_rank`` values) and the rotated shared key (``rope_dim``), in a cache
``[num_blocks, block_size, 1, kv_lora_rank + rope_dim]`` (store_latent.py). Head h's key for a
cached token is ``[W_UK[h] kv_c | k_pe]`` and its value ``W_UV[h] kv_c``. A decode step never
builds those: the model folds ``W_UK`` into the query (the absorbed query
``[q_nope W_UK[h] | q_pe]``, in the latent space) and ``W_UV`` into the output, so attention
runs directly over the cached latents, as multi-query attention with one KV "head" whose key
is the whole latent row and whose value is its first ``kv_lora_rank`` values:

    out[b, h] = softmax_p(query[b, h] . latent[p] * scale) @ latent[p, :kv_lora_rank]

over the cached positions ``p < seq_lens[b]`` of sequence b (one new token per sequence, the
decode's, already stored). Position p lives in slot ``block_tables[b, p // block_size] *
block_size + p % block_size``. Block-table entries past a sequence's blocks and cache slots
past ``seq_lens[b]`` are never read (the suite fills them with NaN); softmax runs in fp32 and
the output has the query's dtype.

The Triton kernel reads each latent tile once for a tile of 16 heads (all of one rank's heads
for DeepSeek-V2-Lite, or for V3 over 8 ranks): a decode step reads 576 values per cached token
per 16 heads, where an expanded cache would hold 192 key and 128 value values per head (40,960
per token for V3's 128 heads). Long contexts with few sequences split the positions
(flash-decoding) and merge the partials with paged attention's merge kernel.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pagedserve.kernels.attention_launch import decode_kv_splits
from pagedserve.kernels.dispatch import is_cuda, use_triton
from pagedserve.kernels.kv_splits import merge_kv_splits
from pagedserve.kernels.paged_attention_ref import _gather_kv

__all__ = ["mla_paged_decode", "mla_paged_decode_ref", "mla_paged_decode_triton"]


# As in paged attention: what changes from step to step is not specialised on, so a batch
# size or table width that happens to be 1 or a multiple of 16 compiles nothing new.
@triton.jit(
    do_not_specialize=[
        "kv_positions_per_split", "lse_token_stride", "lse_head_stride", "block_table_stride",
    ]
)  # fmt: skip
def _mla_decode_kernel(
    q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, lse_ptr,
    scale_log2, n_heads, kv_lora_rank, rope_dim, kv_positions_per_split,
    q_token_stride, q_head_stride, out_token_stride, out_head_stride, out_split_stride,
    lse_token_stride, lse_head_stride, cache_block_stride, cache_slot_stride,
    block_table_stride,
    BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, DOT_FP32: tl.constexpr, WRITE_PARTIAL: tl.constexpr,
):  # fmt: skip
    """One program: one sequence's decode row x BLOCK_H heads, over one split of its cached
    positions. Each TILE_N-position tile of latents is loaded once and scored against every
    head of the tile: the latent part and the rope part as two dots into one score."""
    seq = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    head_ok = heads < n_heads
    lat = tl.arange(0, BLOCK_L)
    rope = tl.arange(0, BLOCK_R)
    lat_ok = lat < kv_lora_rank
    rope_ok = rope < rope_dim
    q_row = q_ptr + seq * q_token_stride + heads[:, None] * q_head_stride
    q_c = tl.load(q_row + lat[None, :], mask=head_ok[:, None] & lat_ok[None, :], other=0.0)
    q_r = tl.load(
        q_row + kv_lora_rank + rope[None, :], mask=head_ok[:, None] & rope_ok[None, :], other=0.0
    )
    if DOT_FP32:
        q_c = q_c.to(tl.float32)
        q_r = q_r.to(tl.float32)
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_start = split * kv_positions_per_split
    kv_stop = tl.minimum(seq_len, kv_start + kv_positions_per_split)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    for start in range(kv_start, kv_stop, TILE_N):
        pos = start + tl.arange(0, TILE_N)
        pos_ok = pos < kv_stop
        # Only this sequence's own block-table entries are read (padding never is).
        block = tl.load(
            block_tables_ptr + seq * block_table_stride + pos // BLOCK_SIZE, mask=pos_ok, other=0
        ).to(tl.int64)
        row = block * cache_block_stride + (pos % BLOCK_SIZE) * cache_slot_stride
        c = tl.load(
            cache_ptr + row[:, None] + lat[None, :], mask=pos_ok[:, None] & lat_ok[None, :],
            other=0.0,
        )  # fmt: skip
        k_r = tl.load(
            cache_ptr + row[:, None] + kv_lora_rank + rope[None, :],
            mask=pos_ok[:, None] & rope_ok[None, :], other=0.0,
        )  # fmt: skip
        if DOT_FP32:
            c = c.to(tl.float32)
            s = tl.dot(q_c, tl.trans(c), input_precision="ieee")
            s += tl.dot(q_r, tl.trans(k_r.to(tl.float32)), input_precision="ieee")
        else:  # a cache of another 16-bit type than the query's is read as the query's
            c = c.to(q_c.dtype)
            s = tl.dot(q_c, tl.trans(c)) + tl.dot(q_r, tl.trans(k_r.to(q_c.dtype)))
        s = tl.where(pos_ok[None, :], s * scale_log2, float("-inf"))
        # Every tile holds at least one visible position (start < kv_stop): m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DOT_FP32:
            pv = tl.dot(p, c, input_precision="ieee")
        else:
            pv = tl.dot(p.to(c.dtype), c)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_off = seq * out_token_stride + heads[:, None] * out_head_stride
    out_off += split * out_split_stride + lat[None, :]
    tl.store(
        out_ptr + out_off, out.to(out_ptr.dtype.element_ty),
        mask=head_ok[:, None] & lat_ok[None, :],
    )  # fmt: skip
    if WRITE_PARTIAL:  # a split that saw nothing says so with lse = -inf (weight 0)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        lse_off = seq * lse_token_stride + heads * lse_head_stride + split
        tl.store(lse_ptr + lse_off, lse, mask=head_ok)


def mla_tile_shape(kv_lora_rank: int, dot_fp32: bool) -> tuple[int, int, int]:
    """(BLOCK_H heads, TILE_N positions per step, warps). 16 heads: the smallest dot tile
    (and all of one rank's heads for V2-Lite, or V3 over 8 ranks). Full-width latents (512)
    take short tiles so the [TILE_N, 512] latent tile stays small."""
    if dot_fp32:
        return 16, 16, 8
    return 16, (16 if kv_lora_rank > 256 else 32), 4


def mla_paged_decode_triton(
    query: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    num_kv_splits: int | None = None,
) -> torch.Tensor:
    """Launch wrapper. Grid: (sequences, head tiles, KV splits); ``num_kv_splits`` > 1 takes
    the flash-decoding path (partials + merge), by default chosen from shapes as paged
    attention chooses it, with the head tiles in the place of its KV heads."""
    _check(query, latent_cache, block_tables, seq_lens, kv_lora_rank)
    if query.stride(-1) != 1:
        query = query.contiguous()
    n_seqs, n_heads, width = query.shape
    out = torch.empty(n_seqs, n_heads, kv_lora_rank, dtype=query.dtype, device=query.device)
    if n_seqs == 0:
        return out
    dot_fp32 = query.dtype == torch.float32 or not is_cuda(query)
    block_h, tile_n, num_warps = mla_tile_shape(kv_lora_rank, dot_fp32)
    head_tiles = triton.cdiv(n_heads, block_h)
    block_size = latent_cache.shape[1]
    max_context = block_tables.shape[1] * block_size
    splits = num_kv_splits or decode_kv_splits(query, head_tiles, max_context)
    if splits > 1:
        target = torch.empty(n_seqs, n_heads, splits, kv_lora_rank, device=query.device)
        lse = torch.full((n_seqs, n_heads, splits), float("-inf"), device=query.device)
        per_split = triton.cdiv(triton.cdiv(max_context, splits), tile_n) * tile_n
    else:
        target, lse, per_split = out, out, max_context
    _mla_decode_kernel[(n_seqs, head_tiles, splits)](
        query, latent_cache, block_tables, seq_lens, target, lse,
        scale * math.log2(math.e), n_heads, kv_lora_rank, width - kv_lora_rank, per_split,
        query.stride(0), query.stride(1), target.stride(0), target.stride(1),
        target.stride(2) if splits > 1 else 0,
        lse.stride(0) if splits > 1 else 0, lse.stride(1) if splits > 1 else 0,
        latent_cache.stride(0), latent_cache.stride(1), block_tables.stride(0),
        BLOCK_H=block_h, BLOCK_L=max(16, triton.next_power_of_2(kv_lora_rank)),
        BLOCK_R=max(16, triton.next_power_of_2(width - kv_lora_rank)), TILE_N=tile_n,
        BLOCK_SIZE=block_size, DOT_FP32=dot_fp32, WRITE_PARTIAL=splits > 1, num_warps=num_warps,
    )  # fmt: skip
    if splits > 1:
        merge_kv_splits(target, lse, out)
    return out


def _check(query, latent_cache, block_tables, seq_lens, kv_lora_rank) -> None:
    n_seqs = seq_lens.shape[0]
    if query.dim() != 3 or query.shape[0] != n_seqs:
        raise ValueError(
            f"mla_paged_decode: query {tuple(query.shape)} must be [B, H, D], one row for each "
            f"of the {n_seqs} sequences"
        )
    width = query.shape[2]
    if latent_cache.dim() != 4 or latent_cache.shape[2:] != (1, width):
        raise ValueError(
            f"mla_paged_decode: cache {tuple(latent_cache.shape)} must be [num_blocks, "
            f"block_size, 1, {width}] for a query of {width} features"
        )
    if not 0 < kv_lora_rank < width:
        raise ValueError(f"mla_paged_decode: kv_lora_rank {kv_lora_rank} not in (0, {width})")
    if not latent_cache.is_contiguous() or block_tables.dim() != 2:
        raise ValueError("mla_paged_decode: the cache must be contiguous, block_tables [B, n]")


def mla_paged_decode_ref(
    query: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """Reference and CPU path: one gather of every sequence's latents (padded to the longest,
    masked), two batched matmuls that share each latent among all heads, fp32 softmax."""
    _check(query, latent_cache, block_tables, seq_lens, kv_lora_rank)
    if seq_lens.shape[0] == 0:
        return query.new_empty(0, query.shape[1], kv_lora_rank)
    latent = _gather_kv(latent_cache, block_tables, seq_lens)[0]  # [B, max_len, D] fp32
    scores = torch.matmul(query.float(), latent.transpose(1, 2)) * scale  # [B, H, max_len]
    past_end = torch.arange(latent.shape[1], device=latent.device) >= seq_lens.long()[:, None]
    scores.masked_fill_(past_end[:, None, :], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), latent[..., :kv_lora_rank])
    return out.to(query.dtype)


def mla_paged_decode(
    query: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """Decode attention of the absorbed ``query [B, H, L + R]`` over the latent cache; returns
    ``[B, H, L]`` (latent space: the model applies ``W_UV``). Triton on CUDA and under
    TRITON_INTERPRET=1; on CPU the reference, whose two batched matmuls already share each
    latent among all heads (a numba kernel would redo that GEMM by hand: none is written)."""
    args = (query, latent_cache, block_tables, seq_lens, scale, kv_lora_rank)
    if use_triton(query):
        return mla_paged_decode_triton(*args)
    return mla_paged_decode_ref(*args)
