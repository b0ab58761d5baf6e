"""The dense linear layer's GEMM, ``x @ weight.T + bias``: by the fastest path for the call, or,
in the batch-invariant mode, by one whose order of summation for a row never depends on the
other rows of the call.

The fastest path: on a GPU, ``F.linear`` (cuBLAS picks its kernel, tiles and split-K by the
shapes, so a row's bits follow the row count); on a CPU, a decode step's few rows go to the
numba kernel (cpu/dense_linear.py: MKL streams the weights at well under the memory's speed
there), everything else to ``F.linear`` (MKL, whose blocking also follows the row count).

Batch invariant (``batch_invariant=True``, the engine's ``--batch-invariant``): on a CPU the
numba kernel at every row count, in its four-by-four loop (each output element is one dot
product in one fixed order, four weight rows against four rows of ``x`` at a time);
on a GPU and under Triton's interpreter the Triton kernel below, with one tile shape per dtype
whatever the row count and no split-K: every output element is the same sequence of
``tl.dot`` steps over ``BLOCK_K`` slices of the input features, whichever tile its row lands in.
What it costs is cuBLAS's choice of tiles: a decode's one row fills 1 of a tile's rows.

The choice goes through ``dispatch.kernel_path`` like every other kernel's, so
``PAGEDSERVE_KERNELS=ref`` gives ``F.linear`` alone (which the batch-invariant mode refuses).
"""

from __future__ import annotations

from functools import cache
from types import ModuleType

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pagedserve.kernels.dispatch import is_cuda, kernel_path

# (BLOCK_M, BLOCK_N, BLOCK_K, warps) of the batch-invariant GEMM, by whether it computes in
# fp32 (FMA units, operands in registers: smaller tiles) or on tensor cores (fp16/bf16).
BATCH_INVARIANT_TILES = {True: (32, 64, 32, 4), False: (64, 64, 64, 4)}


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, x_row_stride, w_row_stride, out_row_stride,
    HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_M rows x BLOCK_N output features, over every input feature in
    BLOCK_K steps, accumulated in fp32 in that order (no split-K); the bias after the sum.
    ``M`` (the row count) is not specialised: it changes every step and decides nothing."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_row_stride
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * w_row_stride
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + ks[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * out_row_stride + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def linear_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Launch wrapper: ``x [..., K]``, ``weight [N, K]`` (rows contiguous), ``bias [N]``;
    returns ``[..., N]`` in ``x``'s dtype. The tile is ``BATCH_INVARIANT_TILES``' for the dtype,
    whatever the number of rows."""
    n, k = weight.shape
    if x.shape[-1] != k or weight.stride(-1) != 1:
        raise ValueError(
            f"linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} (rows contiguous) "
            "must share their last dim"
        )
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"linear: bias {tuple(bias.shape)} != ({n},)")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    if out.numel():
        dot_fp32 = x.dtype == torch.float32 or not is_cuda(x)
        block_m, block_n, block_k, warps = BATCH_INVARIANT_TILES[dot_fp32]
        grid = (triton.cdiv(x2.shape[0], block_m), triton.cdiv(n, block_n))
        _linear_kernel[grid](
            x2, weight, bias if bias is not None else out, out, x2.shape[0], n, k,
            x2.stride(0), weight.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, DOT_FP32=dot_fp32,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
        )  # fmt: skip
    return out.view(*x.shape[:-1], n)


def linear_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Reference: ``F.linear``."""
    return F.linear(x, weight, bias)


@cache
def _numba_gemm() -> ModuleType:
    """The CPU GEMM (cpu/dense_linear.py), imported on the first CPU call (numba is not
    loaded on a GPU)."""
    from pagedserve.kernels.cpu import dense_linear

    return dense_linear


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; with ``batch_invariant``, each row's result the same
    bits whatever the other rows (see the module docstring)."""
    if batch_invariant:
        return _linear_batch_invariant(x, weight, bias)
    if x.is_cpu and x.dtype is torch.float32 and kernel_path(x, has_numba=True) == "numba":
        dense = _numba_gemm()
        if dense.supports(x, weight):
            out = dense.dense_linear_numba(x, weight)
            return out if bias is None else out.add_(bias)
    return F.linear(x, weight, bias)


def _linear_batch_invariant(x, weight, bias) -> torch.Tensor:
    path = kernel_path(x, has_numba=True)
    if path == "triton":
        return linear_triton(x, weight, bias)
    if x.numel() == 0:
        return F.linear(x, weight, bias)
    if path == "numba" and _numba_gemm().supports(x, weight, max_rows=None):
        out = _numba_gemm().dense_linear_numba(x, weight, batch_invariant=True)
        return out if bias is None else out.add_(bias)
    raise ValueError(
        f"linear: no batch-invariant GEMM for {x.dtype} x {weight.dtype} on {x.device} "
        f"(kernel path {path!r}; the CPU's needs fp32 and numba, a contiguous weight)"
    )
