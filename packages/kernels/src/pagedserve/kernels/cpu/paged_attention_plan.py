"""How the numba paged attention (cpu/paged_attention.py) cuts a step into work items.

A step's sequences become tiles of ``PREFILL_TILE_Q`` new tokens (a decode row is a one-token
tile); a single long decode, too few tiles to keep every thread busy, is cut along its KV axis
into ranges merged afterwards (flash-decoding). Compiled with numba: numpy's per-call costs
(some 40 small array ops) added up to more than the attention of a small decode batch.

The plan depends on the batch's layout alone (query_start_loc, seq_lens, block tables, the
rows' key limits when a step has them) and the layer's sliding window, so it is the same for every layer of a step: the CPU runner's
fused layers take one built once per step (engine/cpu_runner.py), with the layout's arrays
already converted for the kernel; a call through ``paged_attention`` plans for itself (some
microseconds: steps that take that path are large).
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
import torch

from pagedserve.kernels.cpu import numba_cache  # noqa: F401  (before any cached @njit)
from pagedserve.kernels.cpu.threads import follow_torch_threads

TILE_N = 32  # KV positions scored per online-softmax step
MIN_SPLIT_POSITIONS = 256  # a KV split of a single decode is worth its merge from here on
PREFILL_TILE_Q = 8  # new tokens per work item in a prefill chunk (x the query heads = rows)
NO_KEY_LIMITS = np.empty(0, np.int32)  # a causal step (one signature for both)


@numba.njit(cache=True)
def _work_items(q_lens, seq_lens, max_q_len):
    """Tiles of ``PREFILL_TILE_Q`` new tokens per sequence: (sequence, q0, q1); a sequence with
    more than ``max_q_len`` (None: no limit) new tokens gets none."""
    limit = np.iinfo(np.int64).max if max_q_len is None else max_q_len
    n_tiles = 0
    for b in range(len(q_lens)):
        if q_lens[b] <= limit:
            n_tiles += -(-q_lens[b] // PREFILL_TILE_Q)
    tiles = np.empty((n_tiles, 3), np.int64)
    i = 0
    for b in range(len(q_lens)):
        if q_lens[b] <= limit:
            for q0 in range(0, q_lens[b], PREFILL_TILE_Q):
                tiles[i, 0], tiles[i, 1] = b, q0
                tiles[i, 2] = min(q0 + PREFILL_TILE_Q, q_lens[b])
                i += 1
    return tiles


def _num_kv_splits(n_tiles: int, max_kv_end: int, threads: int) -> int:
    """Split the KV axis of one-token tiles only when there are too few tiles to keep every
    thread busy (a single long decode), each split keeping >= MIN_SPLIT_POSITIONS."""
    if threads < 2 or n_tiles >= 2 * threads:
        return 1
    return max(1, min(-(-2 * threads // max(n_tiles, 1)), max_kv_end // MIN_SPLIT_POSITIONS))


@numba.njit(cache=True)
def _tile_kv_end(starts, seq_lens, key_limits, b, q0, q1):
    """One past the last KV position tokens ``q0 .. q1 - 1`` of sequence b see: the last
    one's own + 1 (causal), or with ``key_limits`` the largest limit among them (at most
    seq_len)."""
    if key_limits.shape[0] == 0:
        return seq_lens[b] - (starts[b + 1] - starts[b]) + q1
    end = 0
    for t in range(starts[b] + q0, starts[b] + q1):
        end = max(end, key_limits[t])
    return min(end, seq_lens[b])


@numba.njit(cache=True)
def _plan(tiles, starts, seq_lens, key_limits, splits, window=0, aligned=False):
    """Work items, most KV positions first: the tiles, with each one-token tile of >=
    2 * MIN_SPLIT_POSITIONS positions cut into ``splits`` KV ranges; and the merges of the
    split ones. ``(work [W, 6], merges [G, 3])`` as the two kernels read them: the unsplit
    tiles in order, then each split tile's ranges (partial slots numbered in that order).
    Under a ``window`` (> 0; never split) a tile starts at its first token's horizon, or with
    ``aligned`` at the multiple of ``TILE_N`` below it, so that every token's positions are
    folded in the same ``TILE_N`` steps whichever tile it is in (the batch-invariant plan).
    ``key_limits``: each new token's key limit (empty: causal), which a tile's KV range
    reaches to."""
    n = tiles.shape[0]
    kv_end, is_split = np.empty(n, np.int64), np.zeros(n, np.bool_)
    for i in range(n):
        b, q0, q1 = tiles[i, 0], tiles[i, 1], tiles[i, 2]
        kv_end[i] = _tile_kv_end(starts, seq_lens, key_limits, b, q0, q1)
        is_split[i] = q1 - q0 == 1 and kv_end[i] >= 2 * MIN_SPLIT_POSITIONS and splits > 1
    n_split = int(is_split.sum())
    work = np.empty((n - n_split + n_split * splits, 6), np.int64)
    merges = np.empty((n_split, 3), np.int64)
    w = 0
    for i in range(n):
        if not is_split[i]:
            b, q0 = tiles[i, 0], tiles[i, 1]
            n_cached = seq_lens[b] - (starts[b + 1] - starts[b])
            kv_lo = max(n_cached + q0 - window + 1, 0) if window > 0 else 0
            if aligned:
                kv_lo -= kv_lo % TILE_N
            work[w, 0], work[w, 1], work[w, 2] = tiles[i, 0], q0, tiles[i, 2]
            work[w, 3], work[w, 4], work[w, 5] = kv_lo, kv_end[i], -1
            w += 1
    g = 0
    for i in range(n):
        if is_split[i]:
            per_split = -(-kv_end[i] // (splits * TILE_N)) * TILE_N  # whole TILE_N steps
            for k in range(splits):
                lo = min(k * per_split, kv_end[i])
                work[w, 0], work[w, 1], work[w, 2] = tiles[i, 0], tiles[i, 1], tiles[i, 1] + 1
                work[w, 3], work[w, 4], work[w, 5] = (
                    lo,
                    min(lo + per_split, kv_end[i]),
                    g * splits + k,
                )
                w += 1
            merges[g, 0] = starts[tiles[i, 0]] + tiles[i, 1]
            merges[g, 1], merges[g, 2] = g * splits, splits
            g += 1
    order = np.argsort(work[:, 3] - work[:, 4], kind="mergesort")  # stable, longest first
    return work[order], merges


@dataclass(frozen=True)
class StepPlan:
    """One step's work for the numba attention, as every layer (of one window) runs it.

    ``layout`` is (block tables int32, seq_lens int64, query_start_loc int64, key limits int32
    or ``NO_KEY_LIMITS``) as the kernels read them; ``work``/``merges`` as :func:`_plan` returns them; ``parallel``: run the items
    under ``prange``; ``long_seqs``: (sequence, first row, last row + 1) of the sequences with
    more than ``max_q_len`` new tokens, which no work item covers."""

    layout: tuple[np.ndarray, np.ndarray, np.ndarray]
    work: np.ndarray
    merges: np.ndarray
    parallel: bool
    long_seqs: tuple[tuple[int, int, int], ...]


def _build(block_tables, seq_lens, query_start_loc, max_q_len, splits, window, threads,
           batch_invariant, key_limits):  # fmt: skip
    """The plan of one layout, from scratch: what the numba attention did at every layer."""
    starts = query_start_loc.to(torch.int64).numpy()
    lens = seq_lens.to(torch.int64).numpy()
    q_lens = starts[1:] - starts[:-1]
    limits = NO_KEY_LIMITS if key_limits is None else np.ascontiguousarray(key_limits.numpy())
    if batch_invariant:  # every sequence's tiles here, no KV splits: one order for all rows
        max_q_len, splits = None, 1
    tiles = _work_items(q_lens, lens, max_q_len)
    if window or not len(tiles):
        splits = 1  # a window's splits would cut absolute positions
    elif not splits:
        splits = _num_kv_splits(len(tiles), int(lens.max()), threads)
    work, merges = _plan(tiles, starts, lens, limits, splits, window, batch_invariant)
    long_seqs = ()
    if max_q_len is not None:
        long = np.flatnonzero(q_lens > max_q_len).tolist()
        long_seqs = tuple((b, int(starts[b]), int(starts[b + 1])) for b in long)
    layout = (block_tables.to(torch.int32).numpy(), lens, starts, limits)
    return StepPlan(layout, work, merges, threads > 1 and len(work) > 1, long_seqs)


def step_plan(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_q_len: int | None = None,
    num_kv_splits: int | None = None,
    window: int = 0,
    batch_invariant: bool = False,
    key_limits: torch.Tensor | None = None,
) -> StepPlan:
    """The plan for this layout and window. Sets numba's thread count
    (:func:`follow_torch_threads`), which the plan's split and parallel choices depend on.

    ``batch_invariant``: every row's positions folded in one order that depends on the row
    alone: every sequence gets work items (``max_q_len`` ignored: no SDPA), no KV splits
    (``num_kv_splits`` ignored), windows walked from a multiple of ``TILE_N``. Which items
    run on which thread still follows the batch; no item's arithmetic does. ``key_limits``:
    the step's (int32 ``[T]``, paged_attention's), or None: causal."""
    threads = follow_torch_threads()
    return _build(
        block_tables, seq_lens, query_start_loc, max_q_len, num_kv_splits, window, threads,
        batch_invariant, key_limits,
    )  # fmt: skip
