"""``x @ W.T`` for a decode step's few rows on CPU, compiled with numba: the weight streamed once,
at the memory's speed, and each row's result independent of how many rows came with it.

A decode step is memory-bound: at batch 1 to 16 its linear layers do 2-32 FLOPs per weight
they read, so reading the weights is the floor (SmolLM2-135M: ~425 MB over its 30 layers and
~113 MB of lm_head per step, in fp32). On the 2-core AMD EPYC this project runs on, two threads
read memory at ~31 GB/s (a ``torch.sum`` over those weights), but MKL's sgemv behind
``F.linear`` streams them at ~12.5 GB/s at one row and does worse at 2 to 16 rows, where its
sgemm packs the weight first. This kernel reads each block of four weight rows once for all
the rows of ``x`` (the block, 9-24 KB, stays in L1 while each row is dotted with it), the
blocks shared out over the threads with ``prange``: ~26 GB/s at one row, 2.1x MKL's speed on
SmolLM2's layers at batch 1, 2.0x at 4 and 8, 1.6x at 16, and 2.7x on its lm_head
(docs/cpu.md, "Decode GEMMs").

**Batch invariance.** Each output element is one dot product whose summation order is fixed
by the loop over the input features alone (reassociated into SIMD lanes by LLVM in the same way
for every row): no row is paired with another, no split depends on the thread count. So a row's
result is the same bits whether it is computed alone or among fifteen others. That matters to
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
# reuse each weight from cache and the two are even (SmolLM2's shapes, 2 threads: 1.0x at 32).
MAX_ROWS = 16
_BLOCK = 4  # output features per block: their weight rows are read once for all rows of x
_FASTMATH = {"reassoc", "contract", "arcp", "nsz"}


@numba.njit(cache=True, fastmath=_FASTMATH, parallel=True)
def _dense_linear_kernel(x, w, out):  # pragma: no cover - compiled
    rows, k = x.shape
    n_blocks = w.shape[0] // _BLOCK
    for block in numba.prange(n_blocks):
        o = block * _BLOCK
        w0, w1, w2, w3 = w[o], w[o + 1], w[o + 2], w[o + 3]
        for m in range(rows):
            xm = x[m]
            a0 = a1 = a2 = a3 = np.float32(0.0)
            for j in range(k):
                v = xm[j]
                a0 += v * w0[j]
                a1 += v * w1[j]
                a2 += v * w2[j]
                a3 += v * w3[j]
            out[m, o], out[m, o + 1], out[m, o + 2], out[m, o + 3] = a0, a1, a2, a3
    for o in range(n_blocks * _BLOCK, w.shape[0]):  # the last N % 4 features, one dot each
        for m in range(rows):
            acc = np.float32(0.0)
            for j in range(k):
                acc += x[m, j] * w[o, j]
            out[m, o] = acc


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``F.linear(x, weight)`` can take this kernel: fp32 CPU tensors, at most
    ``MAX_ROWS`` rows of ``x`` (leading dims flattened), a contiguous 2-D weight. (``is_cpu``,
    not ``device.type``: the latter formats a string, at every layer of every step.)"""
    return (
        x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.is_cpu
        and weight.is_cpu
        and weight.dim() == 2
        and weight.is_contiguous()
        and x.dim() >= 1
        and x.shape[-1] == weight.shape[1]
        and 0 < x.numel() <= MAX_ROWS * weight.shape[1]
    )


def dense_linear_numba(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` for ``x [..., K]`` of at most ``MAX_ROWS`` rows and ``weight
    [N, K]`` (see :func:`supports`); returns ``[..., N]``. A decode step's ``x`` is already
    contiguous ``[rows, K]``: it goes in, and the result comes out, without a reshape."""
    n = weight.shape[0]
    flat = x.dim() == 2 and x.is_contiguous()
    x2 = x if flat else x.reshape(-1, weight.shape[1]).contiguous()
    out = torch.empty(x2.shape[0], n, dtype=torch.float32)
    follow_torch_threads()
    _dense_linear_kernel(x2.numpy(), weight.numpy(), out.numpy())
    return out if flat else out.view(*x.shape[:-1], n)


def warm_up() -> None:
    """Compile (or load from numba's disk cache) the kernel now, not in the first request: it
    has one signature (C-contiguous fp32 arrays)."""
    dense_linear_numba(torch.zeros(2, 8), torch.zeros(2 * _BLOCK + 1, 8))
