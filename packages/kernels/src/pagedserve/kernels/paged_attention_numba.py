"""Paged attention on CPU, compiled with numba: K and V read through the block table in place.

Same contract as :func:`pagedserve.kernels.paged_attention.paged_attention` (see that module's
docstring). The PyTorch reference gathers every sequence's whole context out of the paged
cache into contiguous tensors before its matmuls; on CPU that copy costs as much as the
attention itself. This kernel is the CPU analogue of the Triton one instead:

- one work item is a tile of one sequence's new tokens (all its query heads): decode rows are
  one-token tiles; a long prefill chunk is cut into ``PREFILL_TILE_Q``-token tiles so that
  every core works on a single long prompt. A work item walks the sequence's blocks and reads
  each position's K and V rows in place (all KV heads of a slot are contiguous, so the walk
  streams whole blocks), each KV head's row once for its whole group of query heads (GQA);
- the KV positions a tile can see (causal with an offset: new token j of a sequence sits at
  ``seq_len - q_len + j``) are scored ``TILE_N`` at a time and folded in with an online
  softmax in fp32. Only positions below ``seq_len`` are ever read, so stale cache slots (NaN
  included) cannot reach an output; within a tile, a row's probabilities past its own
  position are exact zeros and the V rows they would weight are skipped;
- work items run under ``prange`` longest first, handed out one at a time (dynamic
  scheduling), since causal tiles late in a prompt cost more than early ones.

fp32 caches are read as they are; fp16 and bf16 caches are read as their 16-bit patterns
(numba has no half types) and widened to fp32 bit-exactly in registers. The query is cast
to fp32 on the way in (it is small) and the output back to the query's dtype.

Numba compiles on first use (``cache=True`` keeps the machine code on disk, next to this
file or in numba's user cache dir); :func:`warm_up` triggers that at engine start-up so that
no request pays for it. The kernel uses ``min(torch.get_num_threads(), NUMBA_NUM_THREADS)``
threads, set on every call: the engine sizes one thread count (torch's) for everything.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import prange

from pagedserve.kernels.dispatch import kernel_path
from pagedserve.kernels.numba_half import _to_float32
from pagedserve.kernels.paged_attention_plan import (
    TILE_N,
    StepPlan,
    _plan,
    _work_items,
    step_plan,
)
from pagedserve.kernels.paged_attention_ref import _check, _prefill_ref

# paged_attention_cpu sends a sequence with more new tokens than this to SDPA's flash kernel
# instead: the crossover measured on a 2-core AVX-512 CPU with SmolLM2's heads over 200- and
# 1000-token contexts (tools/bench_cpu_attention.py); flash is ~4x faster on long chunks.
NUMBA_MAX_Q_LEN = 15
# Reassociation lets LLVM vectorise the dot-product reductions; the flags that assume no
# NaN/inf are left out: -inf is the running max before a row has seen anything.
_FASTMATH = {"reassoc", "contract", "arcp", "nsz"}


@numba.njit(cache=True, fastmath=_FASTMATH)
def _score_tile(q, k_cache, block_table, start, n, group, s):
    """``s[r, j] = q[r] . K[start + j]`` for every row. Rows are (token, KV head, head in
    group), the last fastest, so row ``r`` is query head ``r % Hq`` of the tile's token
    ``r // Hq``. Each position's K rows (all KV heads, contiguous in the block) are read in
    place, each once for its group of query heads. Loops, not ``%``/``//`` per row: an
    integer division costs more than the 64-wide dot product it would index."""
    block_size, n_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    n_tokens = q.shape[0] // (n_kv_heads * group)
    for j in range(n):
        pos = start + j
        keys = k_cache[block_table[pos // block_size], pos % block_size]
        r = 0
        for _ in range(n_tokens):
            for h in range(n_kv_heads):
                key = keys[h]
                for _ in range(group):
                    dot = np.float32(0.0)
                    for d in range(head_dim):
                        dot += q[r, d] * _to_float32(key[d])
                    s[r, j] = dot
                    r += 1


@numba.njit(cache=True, fastmath=_FASTMATH)
def _accumulate_tile(p, v_cache, block_table, start, n, group, acc):
    """``acc[r] += sum_j p[r, j] V[start + j]`` (rows as in ``_score_tile``); a row whose
    probability is exactly 0 at a position (past its own) skips that V row. Positions go four
    at a time where a row weighs all four (every decode row): one pass over ``acc[r]`` adds
    four V rows, a quarter of the loads and stores of ``acc`` (the loop is store-bound)."""
    block_size, n_kv_heads, head_dim = v_cache.shape[1], v_cache.shape[2], v_cache.shape[3]
    n_tokens = p.shape[0] // (n_kv_heads * group)
    for j in range(0, n - n % 4, 4):
        pos = start + j
        at0 = v_cache[block_table[pos // block_size], pos % block_size]
        at1 = v_cache[block_table[(pos + 1) // block_size], (pos + 1) % block_size]
        at2 = v_cache[block_table[(pos + 2) // block_size], (pos + 2) % block_size]
        at3 = v_cache[block_table[(pos + 3) // block_size], (pos + 3) % block_size]
        r = 0
        for _ in range(n_tokens):
            for h in range(n_kv_heads):
                v0, v1, v2, v3 = at0[h], at1[h], at2[h], at3[h]
                for _ in range(group):
                    w0, w1, w2, w3 = p[r, j], p[r, j + 1], p[r, j + 2], p[r, j + 3]
                    if w0 != 0 and w1 != 0 and w2 != 0 and w3 != 0:
                        for d in range(head_dim):
                            acc[r, d] += (w0 * _to_float32(v0[d]) + w1 * _to_float32(v1[d])) + (
                                w2 * _to_float32(v2[d]) + w3 * _to_float32(v3[d])
                            )
                    else:
                        _add_weighted(acc, r, w0, v0)
                        _add_weighted(acc, r, w1, v1)
                        _add_weighted(acc, r, w2, v2)
                        _add_weighted(acc, r, w3, v3)
                    r += 1
    for j in range(n - n % 4, n):
        pos = start + j
        values = v_cache[block_table[pos // block_size], pos % block_size]
        r = 0
        for _ in range(n_tokens):
            for h in range(n_kv_heads):
                for _ in range(group):
                    _add_weighted(acc, r, p[r, j], values[h])
                    r += 1


@numba.njit(cache=True, fastmath=_FASTMATH, inline="always")
def _add_weighted(acc, r, weight, value):
    """``acc[r] += weight * value``, skipped for a weight of exactly 0 (a position past the
    row's own: skipped, an inf or NaN there cannot reach the row, as with the reference's
    mask)."""
    if weight != 0:
        for d in range(acc.shape[1]):
            acc[r, d] += weight * _to_float32(value[d])


@numba.njit(cache=True, fastmath=_FASTMATH)
def _online_softmax(s, first, n_visible, m, row_sum, acc, r):
    """Row r's scores over positions ``first .. n_visible - 1`` of the tile become
    probabilities (0 outside: past its own position, or before its sliding window), rescaled
    to the row's running max; the row's sum and accumulator follow the new max. A row that
    sees none of the tile keeps its state."""
    if n_visible <= first:
        s[r, :] = 0
        return
    m_new = m[r]
    for j in range(first, n_visible):
        m_new = max(m_new, s[r, j])
    alpha = np.exp(m[r] - m_new)  # 0 on the row's first tile (m = -inf)
    total = np.float32(0.0)
    for j in range(first):
        s[r, j] = 0
    for j in range(first, n_visible):
        p = np.exp(s[r, j] - m_new)
        s[r, j] = p
        total += p
    for j in range(n_visible, s.shape[1]):
        s[r, j] = 0
    row_sum[r] = row_sum[r] * alpha + total
    for d in range(acc.shape[1]):
        acc[r, d] *= alpha
    m[r] = m_new


@numba.njit(cache=True, fastmath=_FASTMATH)
def _attend_tile(query, k_cache, v_cache, block_table, n_cached, q_start, q0, q1, kv_lo,
                 kv_hi, scale, window, cap, acc, m, row_sum):  # fmt: skip
    """Fold KV positions ``kv_lo .. kv_hi`` (clipped to what the tile sees) into the online
    softmax state of new tokens ``q0 .. q1`` of one sequence, all query heads. ``window``
    > 0: a token sees its last ``window`` positions only; ``cap`` > 0: scores soft-capped."""
    n_q_heads, head_dim = query.shape[1], query.shape[2]
    group = n_q_heads // k_cache.shape[2]
    n_rows = (q1 - q0) * n_q_heads
    q = np.empty((n_rows, head_dim), np.float32)
    for r in range(n_rows):
        for d in range(head_dim):
            q[r, d] = query[q_start + q0 + r // n_q_heads, r % n_q_heads, d] * scale
    s = np.empty((n_rows, TILE_N), np.float32)
    kv_end = min(kv_hi, n_cached + q1)  # the tile's last token sees positions < n_cached + q1
    for start in range(kv_lo, kv_end, TILE_N):
        n = min(TILE_N, kv_end - start)
        _score_tile(q, k_cache, block_table, start, n, group, s)
        if cap > 0:
            for r in range(n_rows):
                for j in range(n):
                    s[r, j] = cap * np.tanh(s[r, j] / cap)
        for t in range(q1 - q0):
            n_visible = max(0, min(n, n_cached + q0 + t + 1 - start))
            first = max(0, n_cached + q0 + t + 1 - window - start) if window > 0 else 0
            for r in range(t * n_q_heads, (t + 1) * n_q_heads):
                _online_softmax(s, first, n_visible, m, row_sum, acc, r)
        _accumulate_tile(s, v_cache, block_table, start, n, group, acc)


@numba.njit(cache=True, fastmath=_FASTMATH)
def _attend_item(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, item, scale,
                 window, cap, out, part_acc, part_max, part_sum):  # fmt: skip
    """One work item ``item = work[i]``: (sequence, first new token, last + 1, first KV
    position, last + 1, partial slot). Slot -1: the item covers all positions, its rows go to
    ``out``; else it is one KV split of a one-token tile and leaves its unnormalised state in
    the partials."""
    n_q_heads, head_dim = query.shape[1], query.shape[2]
    b, q0, q1, slot = item[0], item[1], item[2], item[5]
    q_start = query_start_loc[b]
    n_cached = seq_lens[b] - (query_start_loc[b + 1] - q_start)
    n_rows = (q1 - q0) * n_q_heads
    acc = np.zeros((n_rows, head_dim), np.float32)
    m = np.full(n_rows, np.float32(-np.inf), np.float32)
    row_sum = np.zeros(n_rows, np.float32)
    _attend_tile(
        query, k_cache, v_cache, block_tables[b], n_cached, q_start, q0, q1,
        item[3], item[4], scale, window, cap, acc, m, row_sum,
    )  # fmt: skip
    if slot >= 0:
        part_acc[slot] = acc
        part_max[slot] = m
        part_sum[slot] = row_sum
    else:
        for r in range(n_rows):
            inv = np.float32(1.0) / row_sum[r]  # > 0: a row sees its own position
            for d in range(head_dim):
                out[q_start + q0 + r // n_q_heads, r % n_q_heads, d] = acc[r, d] * inv


@numba.njit(parallel=True, cache=True, fastmath=_FASTMATH)
def _paged_attention_kernel(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                            work, scale, window, cap, out, part_acc, part_max,
                            part_sum):  # fmt: skip
    """Every work item (``work [W, 6]``, see :func:`_attend_item`) under ``prange``."""
    for i in prange(work.shape[0]):
        _attend_item(
            query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, work[i], scale,
            window, cap, out, part_acc, part_max, part_sum,
        )  # fmt: skip


@numba.njit(cache=True, fastmath=_FASTMATH)
def _paged_attention_serial(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                            work, scale, window, cap, out, part_acc, part_max,
                            part_sum):  # fmt: skip
    """The same items in one thread: for a single item (a batch-1 decode) or one thread,
    where starting a parallel region costs more than it could share."""
    for i in range(work.shape[0]):
        _attend_item(
            query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, work[i], scale,
            window, cap, out, part_acc, part_max, part_sum,
        )  # fmt: skip


@numba.njit(parallel=True, cache=True, fastmath=_FASTMATH)
def _merge_kv_splits(part_acc, part_max, part_sum, merges, out):
    """Flash-decoding's reduce. ``merges [G, 3]``: (token, first partial slot, slots); each
    split's state is weighted by exp(its max - the overall max); a split that saw nothing
    (max -inf) gets weight 0 and its accumulator (zeros) adds nothing."""
    n_q_heads, head_dim = out.shape[1], out.shape[2]
    for g in prange(merges.shape[0]):
        token, first, count = merges[g, 0], merges[g, 1], merges[g, 2]
        for h in range(n_q_heads):
            top = np.float32(-np.inf)
            for p in range(first, first + count):
                top = max(top, part_max[p, h])
            total = np.float32(0.0)
            for d in range(head_dim):
                out[token, h, d] = 0
            for p in range(first, first + count):
                weight = np.exp(part_max[p, h] - top) if part_max[p, h] > -np.inf else np.float32(0)
                total += weight * part_sum[p, h]
                for d in range(head_dim):
                    out[token, h, d] += weight * part_acc[p, h, d]
            for d in range(head_dim):
                out[token, h, d] /= total


def _cache_as_numpy(cache: torch.Tensor) -> np.ndarray:
    """The cache's memory as numpy, without a copy: 16-bit floats as their bit patterns."""
    if cache.dtype == torch.bfloat16:
        return cache.view(torch.int16).numpy()
    if cache.dtype == torch.float16:
        return cache.view(torch.uint16).numpy()
    if cache.dtype == torch.float32:
        return cache.numpy()
    raise ValueError(f"paged_attention_numba: unsupported KV cache dtype {cache.dtype}")


# The partial-state arrays of a step without KV splits (batch-1 decodes of short contexts,
# every decode batch that has a row per thread): never written, so shared.
_NO_PARTS = (np.empty((0, 0, 0), np.float32), np.empty((0, 0), np.float32),
             np.empty((0, 0), np.float32))  # fmt: skip


def _launch(parallel: bool, arrays: tuple, work, merges, scale, window, cap, out) -> None:
    """Run the work items (``arrays``: query, caches, block tables, lengths and starts as the
    kernels read them) into ``out``, under ``prange`` or in this thread, then merge the KV
    splits."""
    part_acc, part_max, part_sum = _NO_PARTS
    if len(merges):
        n_parts = int(merges[:, 2].sum())  # one slot per split of a tile
        n_q_heads, head_dim = out.shape[1], out.shape[2]
        part_acc = np.empty((n_parts, n_q_heads, head_dim), np.float32)
        part_max = np.empty((n_parts, n_q_heads), np.float32)
        part_sum = np.empty((n_parts, n_q_heads), np.float32)
    kernel = _paged_attention_kernel if parallel else _paged_attention_serial
    previous_chunksize = numba.set_parallel_chunksize(1) if parallel else 0  # one by one
    kernel(*arrays, work, np.float32(scale), window, cap, out, part_acc, part_max, part_sum)
    if parallel:
        numba.set_parallel_chunksize(previous_chunksize)
    if len(merges):
        _merge_kv_splits(part_acc, part_max, part_sum, merges, out)


def _check_cpu(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc) -> None:
    _check(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    if query.is_cuda or k_cache.is_cuda:
        raise ValueError("paged_attention_numba: runs on CPU tensors only")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("paged_attention_numba: KV caches must be contiguous")


def _attend(query, k_cache, v_cache, plan: StepPlan, scale, window, logits_soft_cap):
    """The plan's work items over this layer's query and caches; rows no item covers are 0.
    (Every row is some item's when no sequence was left out: then ``out`` need not be zeroed,
    and an fp32 contiguous query, a decode step's, goes in as it is.)"""
    fp32 = query.dtype == torch.float32
    if plan.long_seqs or not len(plan.work):
        out = np.zeros(query.shape, np.float32)
    else:
        out = np.empty(query.shape, np.float32)
    if len(plan.work):
        q = query if fp32 and query.is_contiguous() else query.to(torch.float32).contiguous()
        arrays = (
            q.detach().numpy(), _cache_as_numpy(k_cache.detach()),
            _cache_as_numpy(v_cache.detach()), *plan.layout,
        )  # fmt: skip
        cap = np.float32(logits_soft_cap or 0.0)
        _launch(plan.parallel, arrays, plan.work, plan.merges, scale, window, cap, out)
    result = torch.from_numpy(out)  # numpy's allocation: ~1.5 us less than torch.empty
    return result if fp32 else result.to(query.dtype)


def paged_attention_numba(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_q_len: int | None = None,
    num_kv_splits: int | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    plans: dict | None = None,
) -> torch.Tensor:
    """Attention of ``query [T, Hq, D]`` over the paged cache (CPU tensors); ``[T, Hq, D]``.

    With ``max_q_len``, sequences with more new tokens are left out (their rows stay 0).
    ``num_kv_splits`` > 1 cuts each decode row's KV positions into that many ranges, run in
    parallel and merged (flash-decoding); by default that happens only when there are too
    few decode rows to keep every thread busy. ``plans``: the step's memo of work plans
    (paged_attention_plan.step_plan), shared by its layers; None plans this call alone."""
    _check_cpu(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    window = sliding_window or 0
    plan = step_plan(
        block_tables, seq_lens, query_start_loc, max_q_len, num_kv_splits, window, plans
    )
    return _attend(query, k_cache, v_cache, plan, scale, window, logits_soft_cap)


def paged_attention_cpu(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    plans: dict | None = None,
) -> torch.Tensor:
    """The CPU engine's paged attention: this kernel for decode rows and short chunks, one
    SDPA flash call per sequence with more than ``NUMBA_MAX_Q_LEN`` new tokens. ``plans``:
    the step's memo (see :func:`paged_attention_numba`)."""
    _check_cpu(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    window = sliding_window or 0
    plan = step_plan(block_tables, seq_lens, query_start_loc, NUMBA_MAX_Q_LEN, None, window, plans)
    out = _attend(query, k_cache, v_cache, plan, scale, window, logits_soft_cap)
    for b, start, end in plan.long_seqs:
        out[start:end] = _prefill_ref(
            query[start:end], k_cache, v_cache, block_tables[b], seq_lens[b], scale,
            sliding_window, logits_soft_cap,
        )  # fmt: skip
    return out


def warm_up(dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> None:
    """Compile (or load from numba's disk cache) the kernel for caches of these dtypes, on a
    one-block batch holding a prefill chunk and a decode (both the parallel and the serial
    kernel), the decoder layer's small ops (layer_ops_numba) and the decode GEMM
    (dense_linear_numba), before any request needs them;
    a no-op where dispatch would not pick numba (on CPU) anyway."""
    if kernel_path(torch.empty(0), has_numba=True) != "numba":
        return
    for dtype in dtypes:
        cache = torch.zeros(2, 8, 1, 8, dtype=dtype)
        args = (
            torch.zeros(3, 2, 8, dtype=dtype), cache, cache.clone(),
            torch.tensor([[0], [1]], dtype=torch.int32), torch.tensor([2, 1], dtype=torch.int32),
            torch.tensor([0, 2, 3], dtype=torch.int32), 1.0,
        )  # fmt: skip
        paged_attention_numba(*args)  # the planners, and the kernel this thread count takes
        query, k_cache, v_cache, block_tables, seq_lens, starts, scale = args
        lens, starts = seq_lens.to(torch.int64).numpy(), starts.to(torch.int64).numpy()
        work, merges = _plan(_work_items(starts[1:] - starts[:-1], lens, None), starts, lens, 1)
        arrays = (query.float().numpy(), _cache_as_numpy(k_cache), _cache_as_numpy(v_cache),
                  block_tables.numpy(), lens, starts)  # fmt: skip
        for parallel in (True, False):  # both kernels, whatever the thread count
            out = np.zeros(query.shape, np.float32)
            _launch(parallel, arrays, work, merges, scale, 0, np.float32(0), out)
    from pagedserve.kernels import dense_linear_numba, layer_ops_numba

    layer_ops_numba.warm_up()
    dense_linear_numba.warm_up()
