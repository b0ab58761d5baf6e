"""``x @ W.T`` for a decode step's few rows on CPU, compiled with numba: the weight streamed once,
at the memory's speed, and each row's result independent of how many rows came with it.

A decode step is memory-bound: at batch 1 to 16 its linear layers do 2-32 FLOPs per weight
they read, so reading the weights is the floor (SmolLM2-135M: ~425 MB over its 30 layers and
~113 MB of lm_head per step, in fp32). On the 2-core AMD EPYC this project runs on, two threads
read memory at ~31 GB/s (a ``torch.sum`` over those weights), but MKL's sgemv behind
``F.linear`` streams them at ~12.5 GB/s at one row and does worse at 2 to 16 rows, where its
sgemm packs the weight first. This kernel reads each block of eight weight rows once for all
the rows of ``x`` (the block, 18-48 KB, stays in L1 or L2 while each row is dotted with it), the
blocks shared out over the threads with ``prange`` (a weight under 1 MiB in the calling thread:
see ``PARALLEL_FROM_WEIGHTS``): ~25 GB/s at one row; on SmolLM2's step (layers and lm_head,
two threads) 2.05x MKL's speed at one row, 2.3x at 4, 1.8x at 8, 1.5x at 16 (docs/cpu.md,
"Decode GEMMs").

**Batch invariance.** Each output element is one dot product whose summation order is fixed
by the loop over the input features alone (reassociated into SIMD lanes by LLVM in the same way
for every row): no row is paired with another, and a block is computed by the same inlined
loop in the parallel and the serial kernel. So a row's result is the same bits whether it is
computed alone or among fifteen others, on one thread or two. That matters to
the engine: the same prompt may be computed in batches of different sizes (a prefix-cache hit
shortens a prefill, speculative decoding verifies several rows), and two runs of one workload
must agree bit for bit. (An earlier small-batch kernel that paired rows was taken out for
breaking exactly that; kernels/test_dense_linear_numba.py checks the property.) Above
``MAX_ROWS`` MKL takes over, as it did for every batch before this kernel.

Same contract as ``F.linear(x, weight)`` for fp32 CPU tensors, without bias (``linear`` adds
it). Sums are reassociated, so results differ from MKL's by float rounding: no less accurate
than MKL against a float64 product (the test's measure).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from pagedserve.kernels.numba_threads import follow_torch_threads

# Decode batches up to here take this kernel; above it MKL's packed GEMM has enough rows to
# reuse each weight from cache (SmolLM2's shapes at 32 rows: 1.35x MKL on 2 threads, 0.98x on 1).
MAX_ROWS = 16
# A weight smaller than this (1 MiB of fp32) runs in the calling thread: reading it takes tens
# of microseconds, and a parallel region costs microseconds when the other core is idle but up
# to a scheduler tick when it is busy (a tiny model's step was 20x slower on a loaded machine).
PARALLEL_FROM_WEIGHTS = 1 << 18
_BLOCK = 8  # output features per block: their weight rows are read once for all rows of x
_FASTMATH = {"reassoc", "contract", "arcp", "nsz"}


@numba.njit(cache=True, fastmath=_FASTMATH, inline="always")
def _block_rows(x, w, out, o):  # pragma: no cover - compiled
    """``out[:, o:o + 8] = x @ w[o:o + 8].T``, one row of ``x`` at a time, the same loop for
    every row (so no row's sums depend on another's presence)."""
    w0, w1, w2, w3 = w[o], w[o + 1], w[o + 2], w[o + 3]
    w4, w5, w6, w7 = w[o + 4], w[o + 5], w[o + 6], w[o + 7]
    for m in range(x.shape[0]):
        xm = x[m]
        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
        for j in range(x.shape[1]):
            v = xm[j]
            a0 += v * w0[j]
            a1 += v * w1[j]
            a2 += v * w2[j]
            a3 += v * w3[j]
            a4 += v * w4[j]
            a5 += v * w5[j]
            a6 += v * w6[j]
            a7 += v * w7[j]
        out[m, o], out[m, o + 1], out[m, o + 2], out[m, o + 3] = a0, a1, a2, a3
        out[m, o + 4], out[m, o + 5], out[m, o + 6], out[m, o + 7] = a4, a5, a6, a7


@numba.njit(cache=True, fastmath=_FASTMATH)
def _tail_rows(x, w, out):  # pragma: no cover - compiled
    """The last ``N % 8`` output features, one dot product each."""
    for o in range(w.shape[0] // _BLOCK * _BLOCK, w.shape[0]):
        for m in range(x.shape[0]):
            acc = np.float32(0.0)
            for j in range(x.shape[1]):
                acc += x[m, j] * w[o, j]
            out[m, o] = acc


@numba.njit(cache=True, fastmath=_FASTMATH, parallel=True)
def _dense_linear_parallel(x, w, out):  # pragma: no cover - compiled
    for block in numba.prange(w.shape[0] // _BLOCK):
        _block_rows(x, w, out, block * _BLOCK)
    _tail_rows(x, w, out)


@numba.njit(cache=True, fastmath=_FASTMATH)
def _dense_linear_serial(x, w, out):  # pragma: no cover - compiled
    for block in range(w.shape[0] // _BLOCK):
        _block_rows(x, w, out, block * _BLOCK)
    _tail_rows(x, w, out)


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``F.linear(x, weight)`` can take this kernel: fp32 CPU tensors, at most
    ``MAX_ROWS`` rows of ``x`` (leading dims flattened), a contiguous 2-D weight. (Cheap
    checks, cheapest first: ``linear`` asks at every layer of every step.)"""
    return (
        x.dtype is torch.float32
        and weight.dtype is torch.float32
        and x.is_cpu
        and weight.is_cpu
        and weight.dim() == 2
        and 0 < x.numel() <= MAX_ROWS * weight.shape[1]
        and x.shape[-1] == weight.shape[1]
        and weight.is_contiguous()
    )


def dense_linear_numba(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` for ``x [..., K]`` of at most ``MAX_ROWS`` rows and ``weight
    [N, K]`` (see :func:`supports`); returns ``[..., N]``."""
    n, k = weight.shape
    x2 = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, k).contiguous()
    out = np.empty((x2.shape[0], n), np.float32)
    parallel = weight.numel() >= PARALLEL_FROM_WEIGHTS and follow_torch_threads() > 1
    kernel = _dense_linear_parallel if parallel else _dense_linear_serial
    kernel(x2.numpy(), weight.numpy(), out)
    result = torch.from_numpy(out)
    return result if x.dim() == 2 else result.view(*x.shape[:-1], n)


def warm_up() -> None:
    """Compile (or load from numba's disk cache) both kernels now, not in the first request:
    each has one signature (C-contiguous fp32 arrays)."""
    x, w = np.zeros((2, 8), np.float32), np.zeros((2 * _BLOCK + 1, 8), np.float32)
    for kernel in (_dense_linear_parallel, _dense_linear_serial):
        kernel(x, w, np.empty((2, w.shape[0]), np.float32))
