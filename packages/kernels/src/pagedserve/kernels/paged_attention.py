"""Attention of a varlen batch of new tokens over the paged KV cache.

One call serves decode (q_len 1), whole prompts, prefill chunks and prompts whose prefix is
already cached. Sequence b owns query rows ``query_start_loc[b]:query_start_loc[b+1]``
(q_len of them) and ``seq_lens[b]`` cached tokens, the new ones included (store_kv ran
first). New token j sits at position ``seq_lens[b] - q_len + j`` and attends to every cached
position <= its own (causal with an offset). Key position p lives in slot
``block_tables[b, p // block_size] * block_size + p % block_size``. Query head h reads KV
head ``h // (Hq // Hkv)`` (GQA; MQA when Hkv == 1).

A layer with a ``sliding_window`` W (Mistral, Qwen2's window layers, Gemma's local layers)
lets token i see positions ``i - W < p <= i`` only: W positions, its own included, as
transformers' sliding-window mask and vLLM's ``window_size = (W - 1, 0)``. Positions before
the first new token's horizon are never read, so their blocks may be freed (a block-table
entry there may point anywhere). ``logits_soft_cap`` c (Gemma 2) maps each scaled score s
to ``c * tanh(s / c)`` before the softmax. ``sinks`` (gpt-oss) are a learned logit per query
head, ``[Hq]``, that joins every row's softmax denominator and attends to nothing: a row's
weights are ``exp(s_j) / (exp(sink_h) + sum_k exp(s_k))``, so they may sum to less than one
(a head can "attend to nowhere"). The sink is a logit as the scores are after scaling (and
capping); it is read in fp32.

``key_limits`` (int32 ``[T]``, on the query's device) replaces the causal bound per query
row: row t sees positions ``p < key_limits[t]`` (and, under a window, still
``p > pos_t - W``), e.g. the end of the image a row lies in, so that an image's tokens attend
to each other both ways (Gemma 3's vision-language prefill); ``pos_t + 1`` is causal. The
caller keeps each limit within ``pos_t + 1 .. seq_len`` (an image is never split across
prefill chunks, and its keys are stored before the attention runs); a limit past ``seq_len``
reads nothing past it. None: causal, the kernels compiled exactly as without it.

Invariants every implementation keeps: block-table entries past a sequence's
``ceil(seq_len / block_size)`` blocks are padding and are never read; cache slots past
``seq_len`` may hold anything, NaN included, and never reach an output; softmax runs in
fp32; the output has the query's dtype. The cache may hold another dtype than the query
(``--kv-cache-dtype``: a 16-bit cache under an fp32 model, or fp8 e4m3 or q8_0 under any):
what is read is widened to fp32 (or, for a 16-bit query on a GPU, taken as the query's type
for the tensor-core dots: e4m3 values are exact in either 16-bit type, a q8_0 element times
its scale is rounded to it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.attention_launch import launch_shape, score_scales
from pagedserve.kernels.dispatch import is_cuda, kernel_path
from pagedserve.kernels.kv_fp8 import cache_bits, e4m3_to_float16, e4m3_to_float32, is_fp8
from pagedserve.kernels.kv_q8 import is_q8, q8_scales
from pagedserve.kernels.kv_splits import _fold_split, _normalised, merge_kv_splits
from pagedserve.kernels.paged_attention_ref import _check, paged_attention_ref

__all__ = ["paged_attention", "paged_attention_ref", "paged_attention_triton"]


@triton.jit
def _find_sequence(query_start_loc_ptr, tile_id, n_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning q tile ``tile_id``: sequence b owns the tiles from
    ``query_start_loc[b] // BLOCK_Q + b`` on (at least ceil(q_len / BLOCK_Q) of them), so a
    binary search over that increasing sequence finds it without any host-side metadata."""
    lo = 0
    hi = n_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile_id:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _dot_operand(tile, scale_ptrs, mask, q, FP8_CACHE: tl.constexpr, Q8_CACHE: tl.constexpr,
                 DOT_FP32: tl.constexpr):  # fmt: skip
    """A K or V tile as the dots take it: fp32, or the query's 16-bit type on a GPU (a cache of
    another 16-bit type is read as the query's). An fp8 cache's bytes are widened exactly
    (kv_fp8.py): to fp32, or to fp16 first for a 16-bit query (e4m3 values are exact in
    either 16-bit type). A q8_0 cache's int8 elements are scaled by their groups' scales, read
    at ``scale_ptrs`` (kv_q8.py): exact in fp32, rounded to a 16-bit query's type."""
    if FP8_CACHE:
        if DOT_FP32:
            tile = e4m3_to_float32(tile)
        else:
            tile = e4m3_to_float16(tile)
    if Q8_CACHE:
        tile = tile.to(tl.float32) * q8_scales(scale_ptrs, mask)
    if DOT_FP32:
        tile = tile.to(tl.float32)
    else:
        tile = tile.to(q.dtype)
    return tile


@triton.jit
def _attend_range(
    q, q_pos, key_end, k_cache_ptr, v_cache_ptr, block_row_ptr, head_off, scale_off, d_mask,
    kv_lo, kv_hi, read_lo, m_i, l_i, scale_log2, cap_inv, cap_log2, window, cache_block_stride,
    cache_slot_stride, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, DOT_FP32: tl.constexpr, SLIDING: tl.constexpr,
    SOFT_CAP: tl.constexpr, READ_FROM: tl.constexpr, KEY_LIMITS: tl.constexpr,
    FP8_CACHE: tl.constexpr, Q8_CACHE: tl.constexpr,
):  # fmt: skip
    """The online softmax of the tile's rows over KV positions ``kv_lo .. kv_hi - 1``, TILE_N
    at a time from ``kv_lo``, from the state ``(m_i, l_i)`` (-inf and 0, or a sink's) and a zero
    accumulator: ``(m, l, acc)`` in exp2 units, ``acc`` unnormalised. READ_FROM: positions
    before ``read_lo`` (before every row's window) are not read (a walk that starts at a
    multiple of TILE_N below the first row's horizon). KEY_LIMITS: each row sees positions
    below its ``key_end`` (else up to its ``q_pos``)."""
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(kv_lo, kv_hi, TILE_N):
        pos = start + tl.arange(0, TILE_N)
        pos_valid = pos < kv_hi
        if READ_FROM:
            pos_valid = pos_valid & (pos >= read_lo)
        # Only this sequence's own block-table entries are read (padding never is).
        block = tl.load(block_row_ptr + pos // BLOCK_SIZE, mask=pos_valid, other=0).to(tl.int64)
        row_off = (block * cache_block_stride + (pos % BLOCK_SIZE) * cache_slot_stride)[:, None]
        kv_off = row_off + head_off
        kv_mask = pos_valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0)
        scales_at = row_off + scale_off  # a q8_0 row's group scales (Q8_CACHE only)
        k = _dot_operand(k, k_cache_ptr + scales_at, kv_mask, q, FP8_CACHE, Q8_CACHE, DOT_FP32)
        if DOT_FP32:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if KEY_LIMITS:
            visible = (pos[None, :] < key_end[:, None]) & pos_valid[None, :]
        else:
            visible = (pos[None, :] <= q_pos[:, None]) & pos_valid[None, :]
        if SLIDING:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        if SOFT_CAP:  # c * tanh(x / c), tanh(y) = 1 - 2 / (exp(2y) + 1): no overflow
            s = cap_log2 * (1.0 - 2.0 / (tl.exp(2.0 * s * cap_inv) + 1.0))
        else:
            s = s * scale_log2
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen nothing yet keeps m = -inf; shift by 0 so exp2 gives 0.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # widened late: fewer live registers
        v = _dot_operand(v, v_cache_ptr + scales_at, kv_mask, q, FP8_CACHE, Q8_CACHE, DOT_FP32)
        if DOT_FP32:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return m_i, l_i, acc


# Arguments that change from step to step (batch size, block-table width, per-split length,
# the split count's log-sum-exp strides) are not specialised on: a value that happens to be 1
# or a multiple of 16 would otherwise compile a new variant mid-serving. They address scalars
# only, so the kernel loses nothing (registers measured equal). The query, output and cache
# strides stay specialised: their 16-divisibility vectorises the tile loads and stores, and
# unspecialised they cost up to 60 more registers a thread (docs/kernel-suite.md).
@triton.jit(
    do_not_specialize=[
        "n_seqs", "kv_positions_per_split", "window", "lse_token_stride", "lse_head_stride",
        "block_table_stride",
    ]
)  # fmt: skip
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    out_ptr, lse_ptr, sinks_ptr, key_limits_ptr, scale_log2, cap_inv, cap_log2, n_seqs, head_dim,
    kv_positions_per_split, window,
    q_token_stride, q_head_stride, out_token_stride, out_head_stride, out_split_stride,
    lse_token_stride, lse_head_stride, cache_block_stride, cache_slot_stride,
    cache_head_stride, block_table_stride,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_FP32: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr, SLIDING: tl.constexpr, SOFT_CAP: tl.constexpr,
    SINKS: tl.constexpr, FIXED_SPLITS: tl.constexpr, KEY_LIMITS: tl.constexpr,
    FP8_CACHE: tl.constexpr, Q8_CACHE: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_Q new tokens x the GROUP query heads of one KV head, over one
    split of the KV positions (the whole sequence when there is one split). Rows of the
    tile are (token, head-in-group) pairs, so each K/V tile is loaded once per group.
    SLIDING: each row sees its last ``window`` positions only, and the walk starts at the
    tile's first row's horizon. SOFT_CAP: scores soft-capped (``cap_inv`` is scale / cap,
    ``cap_log2`` cap * log2(e)); else scaled by ``scale_log2``. SINKS: each row's softmax
    starts from its head's sink, as if from one more key of that score and a zero value
    (split 0 only: the merge adds the splits' sums, so the sink must enter once). All three
    are constexpr so that a global, uncapped layer compiles exactly the kernel it did without
    them (their masks in the loop cost registers: 8-12 bytes of spills on sm80 at head_dim
    128 as runtime branches). FIXED_SPLITS (batch invariant): every row's positions cut at
    multiples of ``kv_positions_per_split`` and folded in order (``_fold_split``), by this
    program or, with WRITE_PARTIAL, by ``_fold_kv_splits_kernel``; a sink is the fold's
    starting state there, not a split's, so it enters at the same place for every row.
    KEY_LIMITS: a row sees the positions below its ``key_limits`` entry; the tile walks (and
    splits) up to its valid rows' largest."""
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = _find_sequence(query_start_loc_ptr, tile_id, n_seqs, BLOCK_Q)
    seq_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - seq_start
    q_tile = tile_id - (seq_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        n_cached = seq_len - q_len
        rows = tl.arange(0, BLOCK_M)
        q_idx = q_tile * BLOCK_Q + rows // GROUP
        row_valid = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
        q_idx = tl.minimum(q_idx, q_len - 1)  # padding rows alias a real one; never stored
        q_pos = n_cached + q_idx
        head = kv_head * GROUP + rows % GROUP
        dims = tl.arange(0, BLOCK_D)
        d_mask = dims < head_dim
        token = (seq_start + q_idx).to(tl.int64)
        q_off = token[:, None] * q_token_stride + head[:, None] * q_head_stride + dims[None, :]
        q = tl.load(q_ptr + q_off, mask=row_valid[:, None] & d_mask[None, :], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        key_end = q_pos  # each row's end (KEY_LIMITS)
        if KEY_LIMITS:  # padding rows alias another tile's token: left out of the walk's end
            key_end = tl.load(key_limits_ptr + token)
            kv_end = tl.minimum(seq_len, tl.max(tl.where(row_valid, key_end, 0), axis=0))
        else:  # causal: no row of this tile sees past its last token
            kv_end = tl.minimum(seq_len, n_cached + tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, q_len))
        horizon = n_cached + q_tile * BLOCK_Q - window + 1  # the first row's (SLIDING)
        block_row_ptr = block_tables_ptr + seq * block_table_stride
        head_off = kv_head * cache_head_stride + dims[None, :]
        scale_off = kv_head * cache_head_stride + head_dim + 2 * (dims[None, :] // 32)
        m_0 = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_0 = tl.zeros([BLOCK_M], tl.float32)
        sink = m_0
        if SINKS:  # the sink in exp2 units: as a state, m = sink and l = exp2(sink - m) = 1
            sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        if FIXED_SPLITS:
            read_lo = tl.maximum(horizon, 0) if SLIDING else 0
            walk_lo = read_lo - read_lo % TILE_N  # the same tile steps for every row
            per = kv_positions_per_split
            if WRITE_PARTIAL:  # this program's split; _fold_kv_splits_kernel folds them
                m_i, l_i, acc = _attend_range(
                    q, q_pos, key_end, k_cache_ptr, v_cache_ptr, block_row_ptr, head_off,
                    scale_off, d_mask,
                    tl.maximum(split * per, walk_lo), tl.minimum(kv_end, split * per + per),
                    read_lo, m_0, l_0, scale_log2, cap_inv, cap_log2, window,
                    cache_block_stride, cache_slot_stride, BLOCK_M, BLOCK_D, TILE_N, BLOCK_SIZE,
                    DOT_FP32, SLIDING, SOFT_CAP, SLIDING, KEY_LIMITS, FP8_CACHE, Q8_CACHE,
                )  # fmt: skip
                out, lse = _normalised(m_i, l_i, acc)
            else:  # every split in order, each folded as it ends
                m_run, w_run = m_0, l_0
                if SINKS:  # the fold starts from the sink, before the first split
                    m_run, w_run = sink, tl.full([BLOCK_M], 1.0, tl.float32)
                acc_run = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
                for part in range(walk_lo // per, tl.cdiv(kv_end, per)):
                    m_i, l_i, acc = _attend_range(
                        q, q_pos, key_end, k_cache_ptr, v_cache_ptr, block_row_ptr, head_off,
                        scale_off, d_mask,
                        tl.maximum(part * per, walk_lo), tl.minimum(kv_end, part * per + per),
                        read_lo, m_0, l_0, scale_log2, cap_inv, cap_log2, window,
                        cache_block_stride, cache_slot_stride, BLOCK_M, BLOCK_D, TILE_N,
                        BLOCK_SIZE, DOT_FP32, SLIDING, SOFT_CAP, SLIDING, KEY_LIMITS, FP8_CACHE,
                        Q8_CACHE,
                    )  # fmt: skip
                    out_s, lse_s = _normalised(m_i, l_i, acc)
                    m_run, w_run, acc_run = _fold_split(m_run, w_run, acc_run, out_s, lse_s)
                out = acc_run / tl.where(w_run > 0, w_run, 1.0)[:, None]
        else:
            kv_start = split * kv_positions_per_split
            kv_stop = tl.minimum(kv_end, kv_start + kv_positions_per_split)
            if SLIDING:  # nothing before the first row's horizon is read
                kv_start = tl.maximum(kv_start, horizon)
            if SINKS:  # in split 0 only
                m_0 = tl.where(split == 0, sink, m_0)
                l_0 = tl.where(split == 0, 1.0, l_0)
            m_i, l_i, acc = _attend_range(
                q, q_pos, key_end, k_cache_ptr, v_cache_ptr, block_row_ptr, head_off, scale_off,
                d_mask, kv_start, kv_stop, kv_start, m_0, l_0, scale_log2, cap_inv, cap_log2,
                window,
                cache_block_stride, cache_slot_stride, BLOCK_M, BLOCK_D, TILE_N, BLOCK_SIZE,
                DOT_FP32, SLIDING, SOFT_CAP, False, KEY_LIMITS, FP8_CACHE, Q8_CACHE,
            )  # fmt: skip
            out, lse = _normalised(m_i, l_i, acc)
        out_off = token[:, None] * out_token_stride + head[:, None] * out_head_stride
        out_off += split * out_split_stride + dims[None, :]
        out_mask = row_valid[:, None] & d_mask[None, :]
        tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=out_mask)
        if WRITE_PARTIAL:
            lse_off = token * lse_token_stride + head * lse_head_stride + split
            tl.store(lse_ptr + lse_off, lse, mask=row_valid)


def paged_attention_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    num_kv_splits: int | None = None,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    batch_invariant: bool = False,
    key_limits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch wrapper. Grid: (q tiles, KV heads, KV splits); the q tiles are bounded from
    shapes alone (T // BLOCK_Q + B): no device-to-host sync, and tiles past a sequence's
    last token exit at once. ``num_kv_splits`` > 1 takes the flash-decoding path (partials +
    merge); by default chosen from shapes (1 under a window: splits cut absolute positions).
    A windowed, capped, sinks, key-limited, fp8- or q8_0-cache layer is a variant of its own
    (constexpr flags; a window's width is a runtime scalar). ``batch_invariant``: fixed splits."""
    _check(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, sinks, key_limits)
    limits = None if key_limits is None else key_limits.contiguous()  # None: a constexpr
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("paged_attention: KV caches must be contiguous")
    query = query if query.stride(-1) == 1 else query.contiguous()
    n_tokens, n_q_heads, head_dim = query.shape
    n_seqs, block_size, n_kv_heads = seq_lens.shape[0], k_cache.shape[1], k_cache.shape[2]
    group = n_q_heads // n_kv_heads
    dot_fp32 = query.dtype == torch.float32 or not is_cuda(query)
    block_m, tile_n, num_warps, splits, per_split = launch_shape(
        query, n_kv_heads, block_tables.shape[1] * block_size, n_tokens == n_seqs,
        sliding_window is not None, num_kv_splits, batch_invariant, k_cache.dtype,
    )  # fmt: skip
    block_q = block_m // group
    out = torch.zeros_like(query)
    if n_tokens == 0 or n_seqs == 0:
        return out
    target, lse = out, out  # with splits: the partials and their log-sum-exps
    if splits > 1:
        target = torch.empty(n_tokens, n_q_heads, splits, head_dim, device=query.device)
        lse = torch.full((n_tokens, n_q_heads, splits), float("-inf"), device=query.device)
    grid = (n_tokens // block_q + n_seqs, n_kv_heads, splits)
    _paged_attention_kernel[grid](
        query, cache_bits(k_cache), cache_bits(v_cache), block_tables, seq_lens, query_start_loc,
        target, lse, out if sinks is None else sinks, limits, *score_scales(scale, logits_soft_cap),
        n_seqs, head_dim, per_split, sliding_window or 0, query.stride(0), query.stride(1),
        target.stride(0), target.stride(1), target.stride(2) if splits > 1 else 0,
        lse.stride(0) if splits > 1 else 0, lse.stride(1) if splits > 1 else 0,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_D=triton.next_power_of_2(head_dim),
        TILE_N=tile_n, BLOCK_SIZE=block_size, DOT_FP32=dot_fp32, WRITE_PARTIAL=splits > 1,
        SLIDING=sliding_window is not None, SOFT_CAP=logits_soft_cap is not None,
        SINKS=sinks is not None, FIXED_SPLITS=batch_invariant, KEY_LIMITS=key_limits is not None,
        FP8_CACHE=is_fp8(k_cache), Q8_CACHE=is_q8(k_cache), num_warps=num_warps,
    )  # fmt: skip
    if splits > 1:
        merge_kv_splits(target, lse, out, in_order=batch_invariant, sinks=sinks)
    return out


def paged_attention(
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
    batch_invariant: bool = False,
    key_limits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``query [T, Hq, D]`` over the paged cache; returns ``[T, Hq, D]``.

    Triton on CUDA (and under TRITON_INTERPRET=1); on CPU the numba kernel for decode rows
    and short chunks with SDPA for long prefill chunks; the reference when asked for.
    ``sliding_window`` / ``logits_soft_cap`` / ``sinks``: None for a global, uncapped layer
    without sinks. ``batch_invariant``: each row's result the same bits in any batch, chunk
    or prefix hit (the Triton and numba paths; the reference batches its matmuls and is
    refused). ``key_limits``: int32 ``[T]``, each row's exclusive bound on the key positions
    it sees (the module docstring); None: causal. A ValueError names a wrong shape, dtype or
    device."""
    args = (query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
    extra = dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks)
    if key_limits is not None:
        extra["key_limits"] = key_limits
    if batch_invariant:
        extra["batch_invariant"] = True
    path = kernel_path(query, has_numba=True)
    if path == "triton":
        return paged_attention_triton(*args, **extra)
    if path == "numba":
        from pagedserve.kernels.cpu.paged_attention import paged_attention_cpu

        return paged_attention_cpu(*args, **extra)
    if batch_invariant:
        raise ValueError("paged_attention: the reference path is not batch invariant")
    return paged_attention_ref(*args, **extra)
