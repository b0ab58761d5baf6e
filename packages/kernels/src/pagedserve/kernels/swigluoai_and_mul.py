"""gpt-oss's expert activation, the clamped SwiGLU (vLLM's ``swigluoai``):
``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``.

``x`` is ``[..., 2d]`` with the gate first, then the up projection (the fused gate_up layout,
as ``silu_and_mul`` reads it: gpt-oss's checkpoints interleave the two, and the model
separates them at load); the result is ``[..., d]``. gpt-oss uses ``alpha = 1.702`` (the
sigmoid approximation of GELU) and ``limit = 7.0`` (its config's ``swiglu_alpha`` and
``swiglu_limit``). Computed in fp32, cast back to ``x.dtype``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.dispatch import use_triton
from pagedserve.kernels.silu_and_mul import launch_gated_activation


@triton.jit
def _swigluoai_and_mul_kernel(x_ptr, out_ptr, d, x_row_stride, alpha, limit, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_row_stride + d + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    glu = gate / (1.0 + tl.exp(-alpha * gate))
    tl.store(out_ptr + row * d + cols, ((up + 1.0) * glu).to(out_ptr.dtype.element_ty), mask=mask)


def swigluoai_and_mul_triton(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """Launch wrapper: one program per (row, column tile) of the output."""
    return launch_gated_activation(_swigluoai_and_mul_kernel, "swigluoai_and_mul", x, alpha, limit)


def swigluoai_and_mul_ref(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """Reference (and the CPU path), in fp32, as transformers' GptOssExperts computes it."""
    d = x.shape[-1] // 2
    xf = x.float()
    gate, up = xf[..., :d].clamp(max=limit), xf[..., d:].clamp(-limit, limit)
    return ((up + 1) * (gate * torch.sigmoid(gate * alpha))).to(x.dtype)


def swigluoai_and_mul(x: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """The clamped SwiGLU of ``x = [gate | up]`` along the last dim."""
    if use_triton(x):
        return swigluoai_and_mul_triton(x, alpha, limit)
    return swigluoai_and_mul_ref(x, alpha, limit)
