"""The numba paged attention's inner loops: one tile of up to ``TILE_N`` KV positions for the
new tokens of one work item (cpu/paged_attention.py has the contract, the work items and
their launch).

For a tile, :func:`_score_tile` dots every query row with the tile's K rows (read in place
through the block table, in whatever the cache holds: cpu/cache_rows.py),
:func:`_online_softmax` turns a row's scores into probabilities rescaled to its running max,
and :func:`_accumulate_tile` adds the probability-weighted V rows into the row's accumulator; :func:`_attend_tile` walks a KV range tile by tile. A row is
(token, KV head, query head in the KV head's group), the last fastest, so each K and V row is
read once for its whole group (GQA).
"""

from __future__ import annotations

import numba
import numpy as np

from pagedserve.kernels.cpu import numba_cache  # noqa: F401  (before any cached @njit)
from pagedserve.kernels.cpu.cache_rows import as_float_rows, scratch
from pagedserve.kernels.cpu.half import to_float32
from pagedserve.kernels.cpu.paged_attention_plan import TILE_N

# Reassociation lets LLVM vectorise the dot-product reductions; the flags that assume no
# NaN/inf are left out: -inf is the running max before a row has seen anything.
_FASTMATH = {"reassoc", "contract", "arcp", "nsz"}


@numba.njit(cache=True, fastmath=_FASTMATH)
def _score_tile(q, k_cache, block_table, start, n, group, s, skip):
    """``s[r, j] = q[r] . K[start + j]`` for every row, ``j >= skip`` (positions before are
    before every row's window: never read, their ``s`` left as it was). Rows are (token, KV
    head, head in group), the last fastest, so row ``r`` is query head ``r % Hq`` of the
    tile's token ``r // Hq``. Each position's K rows (all KV heads, contiguous in the block)
    are read in place, each once for its group of query heads. Loops, not ``%``/``//`` per
    row: an integer division costs more than the 64-wide dot product it would index."""
    block_size, n_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], q.shape[1]
    n_tokens = q.shape[0] // (n_kv_heads * group)
    room = scratch(k_cache, n_kv_heads, head_dim)
    for j in range(skip, n):
        pos = start + j
        keys = k_cache[block_table[pos // block_size], pos % block_size]
        keys = as_float_rows(keys, room, head_dim)
        r = 0
        for _ in range(n_tokens):
            for h in range(n_kv_heads):
                key = keys[h]
                for _ in range(group):
                    dot = np.float32(0.0)
                    for d in range(head_dim):
                        dot += q[r, d] * to_float32(key[d])
                    s[r, j] = dot
                    r += 1


@numba.njit(cache=True, fastmath=_FASTMATH)
def _accumulate_tile(p, v_cache, block_table, start, n, group, acc):
    """``acc[r] += sum_j p[r, j] V[start + j]`` (rows as in ``_score_tile``); a row whose
    probability is exactly 0 at a position (past its own) skips that V row. Positions go four
    at a time where a row weighs all four (every decode row): one pass over ``acc[r]`` adds
    four V rows, a quarter of the loads and stores of ``acc`` (the loop is store-bound)."""
    block_size, n_kv_heads, head_dim = v_cache.shape[1], v_cache.shape[2], acc.shape[1]
    n_tokens = p.shape[0] // (n_kv_heads * group)
    room = scratch(v_cache, 4 * n_kv_heads, head_dim)
    h1, h2, h3 = n_kv_heads, 2 * n_kv_heads, 3 * n_kv_heads
    for j in range(0, n - n % 4, 4):
        pos = start + j
        at0 = v_cache[block_table[pos // block_size], pos % block_size]
        at1 = v_cache[block_table[(pos + 1) // block_size], (pos + 1) % block_size]
        at2 = v_cache[block_table[(pos + 2) // block_size], (pos + 2) % block_size]
        at3 = v_cache[block_table[(pos + 3) // block_size], (pos + 3) % block_size]
        at0, at1 = (
            as_float_rows(at0, room[:h1], head_dim),
            as_float_rows(at1, room[h1:h2], head_dim),
        )
        at2, at3 = (
            as_float_rows(at2, room[h2:h3], head_dim),
            as_float_rows(at3, room[h3:], head_dim),
        )
        r = 0
        for _ in range(n_tokens):
            for h in range(n_kv_heads):
                v0, v1, v2, v3 = at0[h], at1[h], at2[h], at3[h]
                for _ in range(group):
                    w0, w1, w2, w3 = p[r, j], p[r, j + 1], p[r, j + 2], p[r, j + 3]
                    if w0 != 0 and w1 != 0 and w2 != 0 and w3 != 0:
                        for d in range(head_dim):
                            acc[r, d] += (w0 * to_float32(v0[d]) + w1 * to_float32(v1[d])) + (
                                w2 * to_float32(v2[d]) + w3 * to_float32(v3[d])
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
        values = as_float_rows(values, room, head_dim)
        r = 0
        for _ in range(n_tokens):
            for h in range(n_kv_heads):
                for _ in range(group):
                    _add_weighted(acc, r, p[r, j], values[h])
                    r += 1


@numba.njit(cache=True, fastmath=_FASTMATH)
def _add_weighted(acc, r, weight, value):
    """``acc[r] += weight * value``, skipped for a weight of exactly 0 (a position past the
    row's own), so that an inf or NaN there cannot reach the row, as the reference's mask
    keeps it out."""
    if weight != 0:
        for d in range(acc.shape[1]):
            acc[r, d] += weight * to_float32(value[d])


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
def _attend_tile(query, k_cache, v_cache, block_table, key_limits, n_cached, q_start, q0, q1,
                 kv_lo, kv_hi, scale, window, cap, acc, m, row_sum):  # fmt: skip
    """Fold KV positions ``kv_lo .. kv_hi`` (clipped to what the tile sees) into the online
    softmax state of new tokens ``q0 .. q1`` of one sequence, all query heads, ``TILE_N`` at a
    time from ``kv_lo``. ``window`` > 0: a token sees its last ``window`` positions only, and
    nothing before the first token's horizon is read (``kv_lo`` may lie before it: the
    batch-invariant plan starts every walk at a multiple of ``TILE_N``); ``cap`` > 0: scores
    soft-capped; ``key_limits`` (the step's, by flat row; empty: causal): a token sees the
    positions below its limit (``kv_hi``, from the plan, reaches the tile's largest)."""
    n_q_heads, head_dim = query.shape[1], query.shape[2]
    group = n_q_heads // k_cache.shape[2]
    n_rows = (q1 - q0) * n_q_heads
    q = np.empty((n_rows, head_dim), np.float32)
    for r in range(n_rows):
        for d in range(head_dim):
            q[r, d] = query[q_start + q0 + r // n_q_heads, r % n_q_heads, d] * scale
    s = np.empty((n_rows, TILE_N), np.float32)
    limited = key_limits.shape[0] > 0
    # Causal: the tile's last token sees positions < n_cached + q1.
    kv_end = kv_hi if limited else min(kv_hi, n_cached + q1)
    read_lo = max(n_cached + q0 - window + 1, 0) if window > 0 else 0
    for start in range(kv_lo, kv_end, TILE_N):
        n = min(TILE_N, kv_end - start)
        _score_tile(q, k_cache, block_table, start, n, group, s, max(0, read_lo - start))
        if cap > 0:
            for r in range(n_rows):
                for j in range(n):
                    s[r, j] = cap * np.tanh(s[r, j] / cap)
        for t in range(q1 - q0):
            end = key_limits[q_start + q0 + t] if limited else n_cached + q0 + t + 1
            n_visible = max(0, min(n, end - start))
            first = max(0, n_cached + q0 + t + 1 - window - start) if window > 0 else 0
            for r in range(t * n_q_heads, (t + 1) * n_q_heads):
                _online_softmax(s, first, n_visible, m, row_sum, acc, r)
        _accumulate_tile(s, v_cache, block_table, start, n, group, acc)
