"""QuickGELU, CLIP's own GELU approximation: ``x * sigmoid(1.702 x)``, computed in fp32.

OpenAI trained CLIP with this activation, so its checkpoints (the vision tower of LLaVA
among them, ``hidden_act = "quick_gelu"``) need exactly it: neither the exact GELU (gelu.py)
nor the tanh approximation (gelu_tanh.py) reproduces its hidden states. The reference is
transformers' QuickGELUActivation spelled the same way, so in fp32 the two agree bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.dispatch import use_triton
from pagedserve.kernels.elementwise import launch_elementwise


@triton.jit
def _quick_gelu_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # sigmoid(z), z = 1.702 x: 1 / (1 + e) for z >= 0, else e / (1 + e); e = exp(-|z|) <= 1
    # never overflows, where exp(-z) would for z < -88.
    e = tl.exp(-1.702 * tl.abs(x))
    y = tl.where(x < 0, x * e, x) / (1.0 + e)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def quick_gelu_triton(x: torch.Tensor) -> torch.Tensor:
    """Launch wrapper: elementwise over the flattened contiguous input."""
    return launch_elementwise(_quick_gelu_kernel, x)


def quick_gelu_ref(x: torch.Tensor) -> torch.Tensor:
    """Reference: ``x * sigmoid(1.702 x)`` in fp32, cast back."""
    xf = x.float()
    return (xf * torch.sigmoid(1.702 * xf)).to(x.dtype)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """QuickGELU of ``x``, same shape and dtype."""
    if use_triton(x):
        return quick_gelu_triton(x)
    return quick_gelu_ref(x)
