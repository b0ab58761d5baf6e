"""``x @ W.T`` for a few rows of ``x`` on CPU, compiled with numba: the decode GEMMs at small
batches, where MKL's sgemm is far from the memory bound.

A decode step at batch M multiplies M rows by every weight of the model. Reading the weights
is the floor (SmolLM2-135M: ~425 MB over its 30 layers); at M = 1 MKL's sgemv reaches it, but
at M = 4 to 16 its sgemm packs the weight for a GEMM first and took 1.5-2.5x the M = 1 time
on a 2-core AVX-512 CPU (one thread; docs/cpu.md), where M rows should cost about what one
does. This kernel reads each weight row once for all M rows: a block of four output
features' weight rows stays in L1 while two rows of ``x`` at a time are dotted with them (eight
accumulators, vectorised over the input features by reassociation), so the weight streams
from memory once per step and the arithmetic stays in registers.

Same contract as ``F.linear(x, weight)`` for fp32 CPU tensors, without bias (the linear
method adds it); sums are reassociated, so results differ from MKL's by float rounding (within
the kernel suite's fp32 tolerance).

One thread: the engine takes it when it runs on one (``num_cpu_threads=1``; see
:func:`pagedserve.kernels.linear.linear`), where it measured 0.65-0.8x MKL's time at M = 4 to
16 on SmolLM2's shapes. With more threads MKL has every core and this loop one, and numba's
OpenMP pool is a second one beside torch's (their idle workers spin on each other's cores), so
there it stays off until a quiet machine shows otherwise (tools/bench_cpu_step.py, variant
``numba-linear``).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

# The batch sizes this kernel takes: below, MKL (sgemv-like at M <= 3) is at the memory bound
# already; above, its packed GEMM is compute-efficient enough to win (SmolLM2's shapes, one
# thread: 0.72x MKL's time at M = 16, 1.1x at 24, 1.26x at 32).
MIN_ROWS, MAX_ROWS = 4, 16
_BLOCK_OUT = 4  # output features per block: their weight rows stay in L1
_FASTMATH = {"reassoc", "contract", "arcp", "nsz"}


@numba.njit(cache=True, fastmath=_FASTMATH, inline="always")
def _block(x, w, out, o):
    """``out[:, o:o + 4] = x @ w[o:o + 4].T``, two rows of ``x`` at a time."""
    n_rows, k = x.shape
    w0, w1, w2, w3 = w[o], w[o + 1], w[o + 2], w[o + 3]
    for b in range(0, n_rows - 1, 2):
        xa, xb = x[b], x[b + 1]
        a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
        for j in range(k):
            va, vb = xa[j], xb[j]
            a0 += va * w0[j]
            a1 += va * w1[j]
            a2 += va * w2[j]
            a3 += va * w3[j]
            b0 += vb * w0[j]
            b1 += vb * w1[j]
            b2 += vb * w2[j]
            b3 += vb * w3[j]
        out[b, o], out[b, o + 1], out[b, o + 2], out[b, o + 3] = a0, a1, a2, a3
        out[b + 1, o], out[b + 1, o + 1], out[b + 1, o + 2], out[b + 1, o + 3] = b0, b1, b2, b3
    if n_rows % 2:
        xa = x[n_rows - 1]
        a0 = a1 = a2 = a3 = np.float32(0.0)
        for j in range(k):
            va = xa[j]
            a0 += va * w0[j]
            a1 += va * w1[j]
            a2 += va * w2[j]
            a3 += va * w3[j]
        last = n_rows - 1
        out[last, o], out[last, o + 1], out[last, o + 2], out[last, o + 3] = a0, a1, a2, a3


@numba.njit(cache=True, fastmath=_FASTMATH)
def _tail(x, w, out, first):
    """Output features ``first ..`` (fewer than a block), one dot product each."""
    for o in range(first, w.shape[0]):
        for b in range(x.shape[0]):
            acc = np.float32(0.0)
            for j in range(x.shape[1]):
                acc += x[b, j] * w[o, j]
            out[b, o] = acc


@numba.njit(cache=True, fastmath=_FASTMATH)
def _linear_kernel(x, w, out):
    n_blocks = w.shape[0] // _BLOCK_OUT
    for i in range(n_blocks):
        _block(x, w, out, i * _BLOCK_OUT)
    _tail(x, w, out, n_blocks * _BLOCK_OUT)


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``F.linear(x, weight)`` can take this kernel: fp32 CPU, 2-D ``x`` of
    ``MIN_ROWS`` to ``MAX_ROWS`` rows, a contiguous weight."""
    return (
        x.dim() == 2
        and MIN_ROWS <= x.shape[0] <= MAX_ROWS
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and not x.is_cuda
        and weight.is_contiguous()
    )


def small_batch_linear_numba(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` for ``x [M, K]``, ``weight [N, K]`` (see :func:`supports`)."""
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    _linear_kernel(x.contiguous().numpy(), weight.numpy(), out.numpy())
    return out


def warm_up() -> None:
    """Compile (or load from disk) the kernel before the first request needs it."""
    small_batch_linear_numba(torch.zeros(MIN_ROWS, 8), torch.zeros(2 * _BLOCK_OUT + 1, 8))
