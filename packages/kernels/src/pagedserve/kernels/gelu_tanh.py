"""GELU with the tanh approximation: GPT-2's ``gelu_new``.

gelu(x) = 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3))), computed in fp32.
The reference is torch's fused ``gelu(approximate="tanh")``: one pass, ~3x faster on CPU
than transformers' NewGELUActivation, which spells the formula out in five tensor ops;
the two agree to an ulp or two (attention and matmul orders already differ by more).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pagedserve.kernels.dispatch import use_triton
from pagedserve.kernels.elementwise import launch_elementwise


@triton.jit
def _gelu_tanh_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    # tanh(y) = sign(y) * (1 - e) / (1 + e), e = exp(-2|y|) <= 1: no libdevice, no overflow.
    e = tl.exp(-2.0 * tl.abs(inner))
    tanh_abs = (1.0 - e) / (1.0 + e)
    tanh = tl.where(inner < 0, -tanh_abs, tanh_abs)
    tl.store(out_ptr + offs, (0.5 * x * (1.0 + tanh)).to(out_ptr.dtype.element_ty), mask=mask)


def gelu_tanh_triton(x: torch.Tensor) -> torch.Tensor:
    """Launch wrapper: elementwise over the flattened contiguous input."""
    return launch_elementwise(_gelu_tanh_kernel, x)


def gelu_tanh_ref(x: torch.Tensor) -> torch.Tensor:
    """Reference: torch's tanh-approximated GELU in fp32, cast back."""
    return F.gelu(x.float(), approximate="tanh").to(x.dtype)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU (tanh approximation) of ``x``, same shape and dtype."""
    if use_triton(x):
        return gelu_tanh_triton(x)
    return gelu_tanh_ref(x)
