"""LayerNorm over the last dim (GPT-2), computed in fp32 and cast back to ``x.dtype``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pagedserve.kernels.dispatch import use_triton


@triton.jit
def _layer_norm_kernel(
    x_ptr, weight_ptr, bias_ptr, out_ptr, hidden, x_row_stride, eps, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / hidden
    centred = tl.where(mask, x - mean, 0.0)
    variance = tl.sum(centred * centred, axis=0) / hidden
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    bias = tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = centred * (1.0 / tl.sqrt(variance + eps)) * weight + bias
    tl.store(out_ptr + row * hidden + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def layer_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    """Launch wrapper: one program per row; the whole row fits one tile."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,) or bias.shape != (hidden,):
        raise ValueError(
            f"layer_norm: weight {tuple(weight.shape)} / bias {tuple(bias.shape)} != ({hidden},)"
        )
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if out.numel():
        _layer_norm_kernel[(x2.shape[0],)](
            x2, weight.contiguous(), bias.contiguous(), out, hidden, x2.stride(0), eps,
            BLOCK=triton.next_power_of_2(hidden),
        )  # fmt: skip
    return out.view(x.shape)


def layer_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    """Reference: torch's layer_norm in fp32."""
    y = F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps)
    return y.to(x.dtype)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    """LayerNorm of ``x`` over its last dim with an affine ``weight``/``bias``."""
    if use_triton(x):
        return layer_norm_triton(x, weight, bias, eps)
    return layer_norm_ref(x, weight, bias, eps)
