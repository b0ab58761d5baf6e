"""The dense linear layer's GEMM, ``x @ weight.T + bias``, by the fastest path for the call.

On a GPU (and under Triton's interpreter) this is ``F.linear``: cuBLAS is the kernel. On a CPU a
decode step's few rows go to the numba kernel (cpu/dense_linear.py: MKL streams the weights at
well under the memory's speed there), everything else to ``F.linear`` (MKL). The choice goes
through ``dispatch.kernel_path`` like every other kernel's, so ``PAGEDSERVE_KERNELS=ref`` gives
MKL alone.
"""

from __future__ import annotations

from functools import cache
from types import ModuleType

import torch
import torch.nn.functional as F

from pagedserve.kernels.dispatch import kernel_path


@cache
def _numba_gemm() -> ModuleType:
    """The decode GEMM (cpu/dense_linear.py), imported on the first CPU call (numba is not
    loaded on a GPU)."""
    from pagedserve.kernels.cpu import dense_linear

    return dense_linear


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``."""
    if x.is_cpu and x.dtype is torch.float32 and kernel_path(x, has_numba=True) == "numba":
        dense = _numba_gemm()
        if dense.supports(x, weight):
            out = dense.dense_linear_numba(x, weight)
            return out if bias is None else out.add_(bias)
    return F.linear(x, weight, bias)
