"""GELU, exact (the erf form): BERT's ``gelu``.

gelu(x) = 0.5 * x * (1 + erf(x / sqrt(2))), computed in fp32. Encoder models trained with
the exact form (BERT, MiniLM, XLM-RoBERTa) drift from their embeddings under the tanh
approximation (gelu_tanh.py) by ~1e-3, more than the fp32 comparison against transformers
allows, so they get their own kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pagedserve.kernels.dispatch import use_triton
from pagedserve.kernels.elementwise import launch_elementwise


@triton.jit
def _gelu_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def gelu_triton(x: torch.Tensor) -> torch.Tensor:
    """Launch wrapper: elementwise over the flattened contiguous input."""
    return launch_elementwise(_gelu_kernel, x)


def gelu_ref(x: torch.Tensor) -> torch.Tensor:
    """Reference: torch's exact GELU in fp32, cast back."""
    return F.gelu(x.float()).to(x.dtype)


def gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU (exact, erf) of ``x``, same shape and dtype."""
    if use_triton(x):
        return gelu_triton(x)
    return gelu_ref(x)
