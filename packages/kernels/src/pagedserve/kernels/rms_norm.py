"""RMSNorm, optionally fused with the residual add that precedes it in every decoder layer.

Without a residual: ``out = rmsnorm(x) * weight``. With one: ``new_residual = x + residual``
and ``out = rmsnorm(new_residual) * weight``; both are returned, because the next layer
adds onto ``new_residual``. Numerics follow transformers' LlamaRMSNorm (and vLLM): the sum
is rounded to ``x.dtype`` first (that is the residual stream the model carries), the
normalisation runs in fp32 and is cast to ``x.dtype`` before the weight multiplies it, so
bf16/fp16 results match the model written in PyTorch rounding for rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.dispatch import kernel_path


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    new_residual_ptr,
    hidden,
    x_row_stride,
    residual_row_stride,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        res = tl.load(residual_ptr + row * residual_row_stride + cols, mask=mask, other=0.0)
        summed = (x + res.to(tl.float32)).to(new_residual_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * hidden + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    variance = tl.sum(x * x, axis=0) / hidden
    normed = (x * (1.0 / tl.sqrt(variance + eps))).to(out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * hidden + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask
    )


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Launch wrapper: one program per row; the whole row fits one tile."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} != ({hidden},)")
    x2 = _rows(x)
    res2 = _rows(residual) if residual is not None else x2
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rms_norm: residual {tuple(residual.shape)} != x {tuple(x.shape)}")
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    new_res = torch.empty_like(out) if residual is not None else out
    if out.numel():
        _rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight.contiguous(), out, new_res, hidden, x2.stride(0), res2.stride(0),
            eps, HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden),
        )  # fmt: skip
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), new_res.view(x.shape)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, hidden]`` with a unit stride along hidden (a view when possible)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Reference: transformers' LlamaRMSNorm, with the residual add folded in."""
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = (normed.to(x.dtype).float() * weight.float()).to(x.dtype)
    return out if residual is None else (out, x)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``x`` (or of ``x + residual``, returned too) over the last dim."""
    path = kernel_path(x, has_numba=True)
    if path == "triton":
        return rms_norm_triton(x, weight, eps, residual)
    if path == "numba":
        from pagedserve.kernels.cpu import layer_ops as ops

        if ops.supports(x, weight, *(() if residual is None else (residual,))):
            return ops.rms_norm_numba(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)
