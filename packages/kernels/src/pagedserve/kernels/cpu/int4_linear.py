"""4-bit group linear layers on CPU for decode rows, compiled with numba: no fp32 weight.

Same contract as :func:`pagedserve.kernels.int4_linear.int4_linear` (internal layout, see that
module). The reference rewrites a layer's whole fp32 weight on every call, which for a decode
step (a few rows) costs ten times the GEMM itself. This loop reads the 4-bit words in place
instead, as the Triton kernel does: per group ``g`` it sums ``x[k] * q[k, n]`` over the
group's features into one row of partial sums, then folds the group in as
``scale[g, n] * (partial[n] - zero[g, n] * sum_k x[k])``: the same value as
``sum_k x[k] * (q - zero) * scale``, in a different order (fp32 throughout).

Used for fp32 activations, contiguous groups (no ``g_idx``) and at most ``MAX_ROWS`` rows,
where it wins (docs/quantization.md has the measurements); beyond that the reference's one
dequantization per call is shared by enough rows to pay. Compiled on first use (``cache=True``
keeps the machine code on disk for the next process).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from pagedserve.kernels.cpu import numba_cache  # noqa: F401  (before any cached @njit)

MAX_ROWS = 16  # at 1 row 25x faster than the reference on SmolLM2 shapes; even near 24 rows


@numba.njit(cache=True, fastmath=True)
def _int4_rows(x, qweight, scales, zeros, group_size, out):  # pragma: no cover - compiled
    rows, _ = x.shape
    words, n = qweight.shape
    partial = np.zeros(n, dtype=np.float32)
    for m in range(rows):
        out[m, :] = 0.0
        for g in range(scales.shape[0]):
            partial[:] = 0.0
            x_sum = np.float32(0.0)
            for p in range(g * group_size // 8, min(words, (g + 1) * group_size // 8)):
                for j in range(8):
                    xv = x[m, 8 * p + j]
                    x_sum += xv
                    shift = 4 * j
                    for c in range(n):
                        partial[c] += xv * np.float32((qweight[p, c] >> shift) & 15)
            for c in range(n):
                out[m, c] += scales[g, c] * (partial[c] - x_sum * np.float32(zeros[g, c]))


def int4_linear_numba(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x W^T + bias`` for fp32 ``x`` of at most ``MAX_ROWS`` rows (leading dims allowed)."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    x2 = x.reshape(-1, k).contiguous()
    out = torch.empty(x2.shape[0], n, dtype=torch.float32)
    _int4_rows(x2.numpy(), qweight.numpy(), scales.numpy(), zeros.numpy(), group_size, out.numpy())
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], n)


def warm_up() -> None:
    """Compile (or load from numba's cache) the loop now, at model load, not mid-request: it
    has one signature (fp32 rows, int32 words, fp32 scales, uint8 zeros)."""
    words = torch.zeros(1, 8, dtype=torch.int32)
    groups = (torch.ones(1, 8), torch.zeros(1, 8, dtype=torch.uint8))
    int4_linear_numba(torch.zeros(1, 8), words, *groups, 8)
