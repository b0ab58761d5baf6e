"""The gated MLP activation of Llama-family models: silu(gate) * up.

``x`` is ``[..., 2d]`` with the gate projection first (as the fused gate_up projection
writes it); the result is ``[..., d]``. Computed in fp32, cast back to ``x.dtype``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pagedserve.kernels.dispatch import kernel_path


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, x_row_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_row_stride + d + cols, mask=mask, other=0.0).to(tl.float32)
    silu = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + row * d + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def launch_gated_activation(kernel, name: str, x: torch.Tensor, *scalars) -> torch.Tensor:
    """Launch a gated activation's ``kernel(x, out, d, x_row_stride, *scalars, BLOCK)`` over
    ``x [..., 2d]`` (gate first) into a new ``[..., d]``: one program per (row, column tile).
    Shared by silu_and_mul and swigluoai_and_mul."""
    if x.shape[-1] % 2:
        raise ValueError(f"{name}: last dim must be even, got {x.shape[-1]}")
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], d, dtype=x.dtype, device=x.device)
    if out.numel():
        block = min(1024, triton.next_power_of_2(d))
        grid = (x2.shape[0], triton.cdiv(d, block))
        kernel[grid](x2, out, d, x2.stride(0), *scalars, BLOCK=block)
    return out.view(*x.shape[:-1], d)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Launch wrapper: one program per (row, column tile) of the output."""
    return launch_gated_activation(_silu_and_mul_kernel, "silu_and_mul", x)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Reference: silu(x[..., :d]) * x[..., d:] in fp32. An fp32 ``x`` skips the two casts
    (no-ops, but each a dispatch) and multiplies into silu's result: the same arithmetic, and
    at a decode step, where this is the CPU engine's path, a quarter less time."""
    d = x.shape[-1] // 2
    if x.dtype == torch.float32:
        return F.silu(x[..., :d]).mul_(x[..., d:])
    xf = x.float()
    return (F.silu(xf[..., :d]) * xf[..., d:]).to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for ``x = [gate | up]`` along the last dim."""
    path = kernel_path(x, has_numba=True)
    if path == "triton":
        return silu_and_mul_triton(x)
    if path == "numba":
        from pagedserve.kernels.cpu import layer_ops as ops  # numba: on CPU only

        if ops.supports(x):
            return ops.silu_and_mul_numba(x)
    return silu_and_mul_ref(x)
