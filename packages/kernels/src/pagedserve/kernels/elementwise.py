"""The launch of an elementwise Triton kernel over a tensor's flat elements.

The activations (gelu.py, gelu_tanh.py, quick_gelu.py) share one kernel signature,
``(x_ptr, out_ptr, n, BLOCK)``: each program maps ``BLOCK`` consecutive elements of the
contiguous input to the same places of the output, so a launch is the same for all of them.
"""

from __future__ import annotations

import torch
import triton

BLOCK = 1024  # elements per program


def launch_elementwise(kernel, x: torch.Tensor) -> torch.Tensor:
    """``kernel`` over every element of ``x`` (made contiguous), into a new tensor of its
    shape and dtype."""
    x = x.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    if n:
        kernel[(triton.cdiv(n, BLOCK),)](x, out, n, BLOCK=BLOCK)
    return out
