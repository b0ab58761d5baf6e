"""``x @ W.T`` for a decode step's few rows on CPU, compiled with numba: the weight streamed once,
at the memory's speed, and each row's result independent of how many rows came with it.

A decode step is memory-bound: at batch 1 to 16 its linear layers do 2-32 FLOPs per weight
they read, so reading the weights is the floor (SmolLM2-135M: ~425 MB over its 30 layers and
~113 MB of lm_head per step, in fp32). On the 2-core AMD EPYC this project runs on, two threads
read memory at ~31 GB/s (a ``torch.sum`` over those weights), but MKL's sgemv behind
``F.linear`` streams them at ~12.5 GB/s at one row and does worse at 2 to 16 rows, where its
sgemm packs the weight first. This kernel dots one weight row at a time against the rows of
``x``, four rows in one loop (one weight load feeds four FMAs), so at one row it reads the weight
once, in order, as a single stream: reading several weight rows side by side (an earlier
version took eight at once) cost ~20 % of the memory's speed here. Blocks of sixteen output
features are shared out over the threads with ``prange`` (a weight under 1 MiB in the calling
thread: see ``PARALLEL_FROM_WEIGHTS``); inside a block the groups of four rows take turns over
its weight rows, which stay in L2. On SmolLM2's step (layers and lm_head, two threads) that is
the floor at one row (19.6 ms against 20.2 ms for a ``torch.sum`` over the same weights; 2.4x
MKL) and 1.8x MKL at 16 rows (docs/cpu.md, "Decode GEMMs").

**Batch invariance.** Each output element is one dot product whose summation order is fixed
by one loop over the input features (reassociated into SIMD lanes by LLVM), and every output
element comes out of that same loop, ``_dot_four_rows``: a batch whose row count is not a
multiple of four repeats its last row to fill the last group rather than running a narrower
loop, whose lanes LLVM would split differently. The same inlined loop serves the parallel and
the serial kernel. So a row's result is the same bits whether it is computed alone or among
fifteen others, on one thread or two. That matters to the engine: the same prompt may be
computed in batches of different sizes (a prefix-cache hit shortens a prefill, speculative
decoding verifies several rows), and two runs of one workload must agree bit for bit. (An
earlier small-batch kernel that ran one loop for pairs of rows and another for a lone row was
taken out for breaking exactly that; kernels/test_dense_linear_numba.py checks the property.) Above
``MAX_ROWS`` MKL takes over, as it did for every batch before this kernel, except in the
engine's batch-invariant mode (``--batch-invariant``): there every GEMM of the forward takes
this kernel at any row count, in its other loop, ``_dot_four_by_four`` (four weight rows at a
time, the same argument: a partial group repeats its last row or weight row), cut into tiles
of ``_ROW_TILE`` rows (tiling the rows and the features moves no element out of the loop), so
that a token's hidden state is the same bits in a prefill of 2,000 rows as in a decode of one
(docs/batch_invariance.md).

Same contract as ``F.linear(x, weight)`` for fp32 CPU tensors, without bias (``linear`` adds
it). Sums are reassociated, so results differ from MKL's by float rounding: no less accurate
than MKL against a float64 product (the test's measure).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from pagedserve.kernels.cpu import numba_cache  # noqa: F401  (before any cached @njit)
from pagedserve.kernels.cpu.threads import follow_torch_threads

# Decode batches up to here take this kernel; above it MKL's packed GEMM has enough rows to
# reuse each weight from cache (SmolLM2's shapes at 32 rows: 1.35x MKL on 2 threads, 0.98x on 1).
MAX_ROWS = 16
# A weight smaller than this (1 MiB of fp32) runs in the calling thread: reading it takes tens
# of microseconds, and a parallel region costs microseconds when the other core is idle but up
# to a scheduler tick when it is busy (a tiny model's step was 20x slower on a loaded machine).
PARALLEL_FROM_WEIGHTS = 1 << 18
_FASTMATH = {"reassoc", "contract", "arcp", "nsz"}
_ROWS = 4  # rows of x dotted with one weight row in one loop (the last group repeats its last row)
_BLOCK = 16  # output features per task shared out over the threads
# Rows per task of a long prefill (a multiple of _ROWS): 64 rows of SmolLM2's widest input
# (1,536 features) are 384 KB, which L2 keeps while a block's weight rows pass over them.
_ROW_TILE = 64


@numba.njit(cache=True, fastmath=_FASTMATH, inline="always")
def _dot_four_rows(x, w, out, g, o):  # pragma: no cover - compiled
    """``out[g:g + 4, o] = x[g:g + 4] @ w[o]``: one weight row against four rows of ``x`` in one
    loop, whatever the batch. Past the last row of ``x`` the group repeats that row (computed
    again, written again with the same bits), so every output element, in a batch of one or of
    sixteen, comes out of this same loop with the same summation order."""
    last = x.shape[0] - 1
    r0, r1, r2, r3 = g, min(g + 1, last), min(g + 2, last), min(g + 3, last)
    x0, x1, x2, x3 = x[r0], x[r1], x[r2], x[r3]
    wo = w[o]
    a0 = a1 = a2 = a3 = np.float32(0.0)
    for j in range(x.shape[1]):
        v = wo[j]
        a0 += x0[j] * v
        a1 += x1[j] * v
        a2 += x2[j] * v
        a3 += x3[j] * v
    out[r3, o], out[r2, o], out[r1, o], out[r0, o] = a3, a2, a1, a0


@numba.njit(cache=True, fastmath=_FASTMATH, inline="always")
def _dot_four_by_four(x, w, out, g, o):  # pragma: no cover - compiled
    """``out[g:g + 4, o:o + 4] = x[g:g + 4] @ w[o:o + 4].T``: four weight rows against four rows
    of ``x`` in one loop, sixteen sums side by side (eight vector loads feed sixteen FMAs, where
    ``_dot_four_rows`` needs five for four). The batch-invariant mode's loop at every row count:
    past the last row of ``x`` or of ``w`` the group repeats that row, so every output element,
    in a decode of one row or a prefill of thousands, comes out of this one loop."""
    last_row, last_feature = x.shape[0] - 1, w.shape[0] - 1
    r0, r1, r2, r3 = g, min(g + 1, last_row), min(g + 2, last_row), min(g + 3, last_row)
    o0, o1 = o, min(o + 1, last_feature)
    o2, o3 = min(o + 2, last_feature), min(o + 3, last_feature)
    x0, x1, x2, x3 = x[r0], x[r1], x[r2], x[r3]
    w0, w1, w2, w3 = w[o0], w[o1], w[o2], w[o3]
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = np.float32(0.0)
    a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = np.float32(0.0)
    for j in range(x.shape[1]):
        p0, p1, p2, p3 = x0[j], x1[j], x2[j], x3[j]
        v0, v1, v2, v3 = w0[j], w1[j], w2[j], w3[j]
        # fmt: off
        a00 += p0 * v0; a01 += p0 * v1; a02 += p0 * v2; a03 += p0 * v3  # noqa: E702
        a10 += p1 * v0; a11 += p1 * v1; a12 += p1 * v2; a13 += p1 * v3  # noqa: E702
        a20 += p2 * v0; a21 += p2 * v1; a22 += p2 * v2; a23 += p2 * v3  # noqa: E702
        a30 += p3 * v0; a31 += p3 * v1; a32 += p3 * v2; a33 += p3 * v3  # noqa: E702
        # fmt: on
    out[r3, o3], out[r3, o2], out[r3, o1], out[r3, o0] = a33, a32, a31, a30
    out[r2, o3], out[r2, o2], out[r2, o1], out[r2, o0] = a23, a22, a21, a20
    out[r1, o3], out[r1, o2], out[r1, o1], out[r1, o0] = a13, a12, a11, a10
    out[r0, o3], out[r0, o2], out[r0, o1], out[r0, o0] = a03, a02, a01, a00


@numba.njit(cache=True, fastmath=_FASTMATH, inline="always")
def _features(x, w, out, first_row, stop_row, first, stop, batch_invariant):  # pragma: no cover
    """Output features ``first:stop`` of rows ``first_row:stop_row`` (``first_row`` a multiple
    of four): the rows four at a time, the features of a group one weight row after another
    (a block's 16 weight rows, 37-98 KB, stay in L2 while the groups take turns; at one row
    each weight row is read once, in order), or with ``batch_invariant`` four at a time."""
    for g in range(first_row, stop_row, _ROWS):
        if batch_invariant:
            for o in range(first, stop, _ROWS):
                _dot_four_by_four(x, w, out, g, o)
        else:
            for o in range(first, stop):
                _dot_four_rows(x, w, out, g, o)


@numba.njit(cache=True, fastmath=_FASTMATH, parallel=True)
def dense_linear_parallel(x, w, out, batch_invariant):  # pragma: no cover - compiled
    """Tiles of ``_ROW_TILE`` rows x ``_BLOCK`` output features under ``prange``: a decode's
    rows are one row tile, so its tasks are the blocks of features; a prefill's many rows
    are cut so that a tile's rows stay in cache while its features' weight rows take turns.
    Every element still comes out of the one loop of its mode (row tiles and feature blocks
    start at multiples of four), so the tiling changes no bit."""
    blocks, row_tiles = w.shape[0] // _BLOCK, -(-x.shape[0] // _ROW_TILE)
    for task in numba.prange(blocks * row_tiles):
        block, tile = task % blocks, task // blocks
        first_row, stop_row = tile * _ROW_TILE, min(x.shape[0], tile * _ROW_TILE + _ROW_TILE)
        first = block * _BLOCK
        _features(x, w, out, first_row, stop_row, first, first + _BLOCK, batch_invariant)
    _features(x, w, out, 0, x.shape[0], blocks * _BLOCK, w.shape[0], batch_invariant)


@numba.njit(cache=True, fastmath=_FASTMATH)
def dense_linear_serial(x, w, out, batch_invariant):  # pragma: no cover - compiled
    _features(x, w, out, 0, x.shape[0], 0, w.shape[0], batch_invariant)


@numba.njit(cache=True)
def dense_linear_compiled(x, w, threads, batch_invariant):  # pragma: no cover - compiled
    """``x @ w.T`` into a new array: the weight shared out over the threads from
    ``PARALLEL_FROM_WEIGHTS`` on, else in this thread; ``batch_invariant``: the four-by-four
    loop. Compiled, so that the fused decoder layer (cpu/decoder_layer.py) makes the same
    choices as :func:`dense_linear_numba`."""
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    if threads > 1 and w.size >= PARALLEL_FROM_WEIGHTS:
        dense_linear_parallel(x, w, out, batch_invariant)
    else:
        dense_linear_serial(x, w, out, batch_invariant)
    return out


def supports(x: torch.Tensor, weight: torch.Tensor, max_rows: int | None = MAX_ROWS) -> bool:
    """Whether ``F.linear(x, weight)`` can take this kernel: fp32 CPU tensors, at most
    ``max_rows`` rows of ``x`` (leading dims flattened; None: any number, the batch-invariant
    mode's choice), a contiguous 2-D weight. (Cheap checks, cheapest first: ``linear`` asks
    at every layer of every step.)"""
    return (
        x.dtype is torch.float32
        and weight.dtype is torch.float32
        and x.is_cpu
        and weight.is_cpu
        and weight.dim() == 2
        and 0 < x.numel()
        and (max_rows is None or x.numel() <= max_rows * weight.shape[1])
        and x.shape[-1] == weight.shape[1]
        and weight.is_contiguous()
    )


def dense_linear_numba(
    x: torch.Tensor, weight: torch.Tensor, batch_invariant: bool = False
) -> torch.Tensor:
    """``F.linear(x, weight)`` for fp32 ``x [..., K]`` and ``weight [N, K]`` (see
    :func:`supports`); returns ``[..., N]``. ``batch_invariant``: the loop the engine's
    batch-invariant mode runs at every row count (four weight rows at a time)."""
    n, k = weight.shape
    x2 = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, k).contiguous()
    result = torch.from_numpy(
        dense_linear_compiled(x2.numpy(), weight.numpy(), follow_torch_threads(), batch_invariant)
    )
    return result if x.dim() == 2 else result.view(*x.shape[:-1], n)


def warm_up() -> None:
    """Compile (or load from numba's disk cache) the GEMM now, not in the first request: one
    signature (C-contiguous fp32 arrays); the parallel and serial kernels compile with it."""
    x, w = np.zeros((2, 8), np.float32), np.zeros((2 * _BLOCK + 1, 8), np.float32)
    for batch_invariant in (False, True):
        dense_linear_compiled(x, w, 1, batch_invariant)
