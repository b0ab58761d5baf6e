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
  ``seq_len - q_len + j``; or below each token's key limit, when the step has them) are scored ``TILE_N`` at a time and folded in with an online
  softmax in fp32. Only positions below ``seq_len`` are ever read, so stale cache slots (NaN
  included) cannot reach an output; within a tile, a row's probabilities past its own
  position are exact zeros and the V rows they would weight are skipped;
- work items run under ``prange`` longest first, handed out one at a time (dynamic
  scheduling), since causal tiles late in a prompt cost more than early ones;
- attention sinks (gpt-oss) start each row's online softmax from its head's sink, as from
  one more key of that score and a zero value; a decode cut into KV splits counts it in its
  first split only.

fp32 caches are read as they are; fp16 and bf16 caches are read as their 16-bit patterns
(numba has no half types) and widened to fp32 bit-exactly in registers. The query is cast
to fp32 on the way in (it is small) and the output back to the query's dtype.

Numba compiles on first use (``cache=True`` keeps the machine code on disk, next to this
file or in numba's user cache dir); :func:`warm_up` triggers that at engine start-up so that
no request pays for it. The kernel uses ``min(torch.get_num_threads(), NUMBA_NUM_THREADS)``
threads, set on every call: the engine sizes one thread count (torch's) for everything.

Files: this one has the contract, the work items' loop and launch; the loops over one tile of
KV positions are in cpu/paged_attention_tile.py, the per-step work plan in
paged_attention_plan.py.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import prange

from pagedserve.kernels.cpu import numba_cache  # noqa: F401  (before any cached @njit)
from pagedserve.kernels.cpu.half import cache_as_numpy
from pagedserve.kernels.cpu.paged_attention_plan import (
    NO_KEY_LIMITS,
    StepPlan,
    _plan,
    _work_items,
    step_plan,
)
from pagedserve.kernels.cpu.paged_attention_tile import _FASTMATH, _attend_tile
from pagedserve.kernels.kv_q8 import zeros_cache
from pagedserve.kernels.paged_attention_ref import _check, _prefill_ref

# paged_attention_cpu sends a sequence with more new tokens than this to SDPA's flash kernel
# instead: the crossover measured on a 2-core AVX-512 CPU with SmolLM2's heads over 200- and
# 1000-token contexts (tools/bench_cpu_attention.py); flash is ~4x faster on long chunks.
NUMBA_MAX_Q_LEN = 15
NO_SINKS = np.empty(0, np.float32)  # a layer without attention sinks (one signature for both)


@numba.njit(cache=True, fastmath=_FASTMATH)
def _attend_item(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, key_limits,
                 item, scale, window, cap, sinks, out, part_acc, part_max, part_sum):  # fmt: skip
    """One work item ``item = work[i]``: (sequence, first new token, last + 1, first KV
    position, last + 1, partial slot). Slot -1: the item covers all positions, its rows go to
    ``out``; else it is one KV split of a one-token tile and leaves its unnormalised state in
    the partials. ``sinks``: one per query head, or empty; ``key_limits``: one per new token,
    or empty (causal)."""
    n_q_heads, head_dim = query.shape[1], query.shape[2]
    b, q0, q1, slot = item[0], item[1], item[2], item[5]
    q_start = query_start_loc[b]
    n_cached = seq_lens[b] - (query_start_loc[b + 1] - q_start)
    n_rows = (q1 - q0) * n_q_heads
    acc = np.zeros((n_rows, head_dim), np.float32)
    m = np.full(n_rows, np.float32(-np.inf), np.float32)
    row_sum = np.zeros(n_rows, np.float32)
    if sinks.shape[0] and (slot < 0 or item[3] == 0):  # the sink once: in the first split
        for r in range(n_rows):
            m[r] = sinks[r % n_q_heads]
            row_sum[r] = 1.0
    _attend_tile(
        query, k_cache, v_cache, block_tables[b], key_limits, n_cached, q_start, q0, q1,
        item[3], item[4], scale, window, cap, acc, m, row_sum,
    )  # fmt: skip
    if slot >= 0:
        part_acc[slot] = acc
        part_max[slot] = m
        part_sum[slot] = row_sum
    else:
        for r in range(n_rows):
            inv = np.float32(1.0) / row_sum[r]  # > 0: a row sees its own position (or limit's)
            for d in range(head_dim):
                out[q_start + q0 + r // n_q_heads, r % n_q_heads, d] = acc[r, d] * inv


@numba.njit(parallel=True, cache=True, fastmath=_FASTMATH)
def _paged_attention_kernel(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                            key_limits, work, scale, window, cap, sinks, out, part_acc,
                            part_max, part_sum):  # fmt: skip
    """Every work item (``work [W, 6]``, see :func:`_attend_item`) under ``prange``."""
    for i in prange(work.shape[0]):
        _attend_item(
            query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, key_limits,
            work[i], scale, window, cap, sinks, out, part_acc, part_max, part_sum,
        )  # fmt: skip


@numba.njit(cache=True, fastmath=_FASTMATH)
def _paged_attention_serial(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                            key_limits, work, scale, window, cap, sinks, out, part_acc,
                            part_max, part_sum):  # fmt: skip
    """The same items in one thread: for a single item (a batch-1 decode) or one thread,
    where starting a parallel region costs more than it could share."""
    for i in range(work.shape[0]):
        _attend_item(
            query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, key_limits,
            work[i], scale, window, cap, sinks, out, part_acc, part_max, part_sum,
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


# numba's own ``set_parallel_chunksize`` in compiled code goes through a ctypes pointer, which
# keeps a function from numba's disk cache; this is the same C function of numba's threading
# layer, by the symbol numba registers with LLVM when its thread pool starts (every caller has
# started it, through follow_torch_threads, before the first call compiles or loads a launch).
_set_parallel_chunksize = numba.types.ExternalFunction(
    "set_parallel_chunksize", numba.types.uint32(numba.types.uint32)
)


@numba.njit(cache=True)
def launch_attention(
    query, k_cache, v_cache, layout, work, merges, parallel, scale, window, cap, sinks, out
):
    """Run the work items into ``out``, under ``prange`` (handed out one by one, longest first)
    or in this thread, then merge the KV splits. ``layout``: block tables, lengths, starts and
    key limits (empty: causal) as the kernels read them (``StepPlan.layout``); ``sinks``: fp32, one per query head, or empty. Compiled, so
    that the fused decoder layer (cpu/decoder_layer.py) calls the very same launch as this
    module's wrapper."""
    block_tables, seq_lens, starts, key_limits = layout
    n_parts = merges[:, 2].sum() if merges.shape[0] else 0  # one slot per split of a tile
    part_acc = np.empty((n_parts, out.shape[1], out.shape[2]), np.float32)
    part_max = np.empty((n_parts, out.shape[1]), np.float32)
    part_sum = np.empty((n_parts, out.shape[1]), np.float32)
    args = (
        query, k_cache, v_cache, block_tables, seq_lens, starts, key_limits, work, scale, window,
        cap, sinks, out,
    )  # fmt: skip
    if parallel:
        previous = _set_parallel_chunksize(1)
        _paged_attention_kernel(*args, part_acc, part_max, part_sum)
        _set_parallel_chunksize(previous)
    else:
        _paged_attention_serial(*args, part_acc, part_max, part_sum)
    if merges.shape[0]:
        _merge_kv_splits(part_acc, part_max, part_sum, merges, out)


def _check_cpu(
    query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, sinks, key_limits
) -> None:
    _check(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, sinks, key_limits)
    if query.is_cuda or k_cache.is_cuda:
        raise ValueError("paged_attention_numba: runs on CPU tensors only")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("paged_attention_numba: KV caches must be contiguous")


def _attend(query, k_cache, v_cache, plan: StepPlan, scale, window, logits_soft_cap, sinks):
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
        launch_attention(
            q.detach().numpy(), cache_as_numpy(k_cache.detach()),
            cache_as_numpy(v_cache.detach()), plan.layout, plan.work, plan.merges,
            plan.parallel, np.float32(scale), window, np.float32(logits_soft_cap or 0.0),
            NO_SINKS if sinks is None else sinks.detach().float().contiguous().numpy(), out,
        )  # fmt: skip
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
    batch_invariant: bool = False,
    sinks: torch.Tensor | None = None,
    key_limits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``query [T, Hq, D]`` over the paged cache (CPU tensors); ``[T, Hq, D]``.

    With ``max_q_len``, sequences with more new tokens are left out (their rows stay 0).
    ``num_kv_splits`` > 1 cuts each decode row's KV positions into that many ranges, run in
    parallel and merged (flash-decoding); by default that happens only when there are too
    few decode rows to keep every thread busy. ``batch_invariant``: the plan of
    :func:`step_plan` whose every row's result is the same bits in any batch (both knobs
    above ignored). ``key_limits``: each row's key limit (paged_attention's), or None."""
    _check_cpu(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, sinks, key_limits)
    window = sliding_window or 0
    plan = step_plan(
        block_tables, seq_lens, query_start_loc, max_q_len, num_kv_splits, window, batch_invariant,
        key_limits,
    )  # fmt: skip
    return _attend(query, k_cache, v_cache, plan, scale, window, logits_soft_cap, sinks)


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
    sinks: torch.Tensor | None = None,
    batch_invariant: bool = False,
    key_limits: torch.Tensor | None = None,
) -> torch.Tensor:
    """The CPU engine's paged attention: this kernel for decode rows and short chunks, one
    SDPA flash call per sequence with more than ``NUMBA_MAX_Q_LEN`` new tokens; with
    ``batch_invariant`` this kernel for every row, in the order of the batch-invariant plan
    (SDPA's blocking follows the prompt's length, so a prompt's rows would not match the
    decode rows of the same positions)."""
    _check_cpu(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, sinks, key_limits)
    window = sliding_window or 0
    plan = step_plan(
        block_tables, seq_lens, query_start_loc, NUMBA_MAX_Q_LEN, None, window, batch_invariant,
        key_limits,
    )  # fmt: skip
    out = _attend(query, k_cache, v_cache, plan, scale, window, logits_soft_cap, sinks)
    for b, start, end in plan.long_seqs:
        out[start:end] = _prefill_ref(
            query[start:end], k_cache, v_cache, block_tables[b], seq_lens[b], scale,
            sliding_window, logits_soft_cap, sinks,
            None if key_limits is None else key_limits[start:end],
        )  # fmt: skip
    return out


def warm_up(dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> None:
    """Compile (or load from numba's disk cache) the kernel for caches of these dtypes, on a
    one-block batch holding a prefill chunk and a decode: the planners, and both the parallel
    and the serial kernel, whatever the thread count."""
    for dtype in dtypes:
        cache = zeros_cache((2, 8, 1, 32), dtype)  # a head of one q8_0 group
        args = (
            torch.zeros(3, 2, 32), cache, cache.clone(),
            torch.tensor([[0], [1]], dtype=torch.int32), torch.tensor([2, 1], dtype=torch.int32),
            torch.tensor([0, 2, 3], dtype=torch.int32), 1.0,
        )  # fmt: skip
        paged_attention_numba(*args)
        query, k_cache, v_cache, block_tables, seq_lens, starts, scale = args
        lens, starts = seq_lens.to(torch.int64).numpy(), starts.to(torch.int64).numpy()
        tiles = _work_items(starts[1:] - starts[:-1], lens, None)
        work, merges = _plan(tiles, starts, lens, NO_KEY_LIMITS, 1)
        arrays = (query.float().numpy(), cache_as_numpy(k_cache), cache_as_numpy(v_cache),
                  (block_tables.numpy(), lens, starts, NO_KEY_LIMITS), work, merges)  # fmt: skip
        for parallel in (True, False):
            out = np.zeros(query.shape, np.float32)
            launch_attention(*arrays, parallel, np.float32(scale), 0, np.float32(0), NO_SINKS, out)
