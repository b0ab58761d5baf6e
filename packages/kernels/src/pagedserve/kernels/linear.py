"""The dense linear layer's GEMM, ``x @ weight.T + bias``: MKL (``F.linear``), or on a
one-thread CPU engine the numba small-batch kernel for decode batches of 4 to 16 rows
(small_batch_linear_numba.py says why, and why only there)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels.dispatch import kernel_path

_MIN_ROWS, _MAX_ROWS = 4, 16  # small_batch_linear_numba's MIN_ROWS, MAX_ROWS


def numba_linear_wanted() -> bool:
    """Whether the numba kernel may take a small batch here: on a one-thread engine only."""
    return torch.get_num_threads() == 1


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``F.linear(x, weight, bias)``, by the fastest path this machine has for it."""
    if (
        x.dim() == 2
        and _MIN_ROWS <= x.shape[0] <= _MAX_ROWS
        and numba_linear_wanted()
        and kernel_path(x, has_numba=True) == "numba"
    ):
        from pagedserve.kernels import small_batch_linear_numba as small

        if small.supports(x, weight):
            out = small.small_batch_linear_numba(x, weight)
            return out if bias is None else out.add_(bias)
    return F.linear(x, weight, bias)
