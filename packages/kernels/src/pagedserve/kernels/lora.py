"""LoRA shrink and expand: many adapters applied to one batch, one launch each (Punica's BGMV).

A LoRA adapter adds ``x A^T B^T`` to a linear layer's output ``x W^T``: ``A`` is ``[r, in]``
(the *shrink* to a small rank ``r``), ``B`` is ``[out, r]`` (the *expand* back). Serving many
adapters at once keeps every resident adapter's weights in stacked per-slot tensors
(``lora_a_stacked [slots, r, in]``, ``lora_b_stacked [slots, out, r]``) and gives each token of
the flat batch its slot (``token_slot [T]``, -1 for the base model). Each kernel is then one
batched gather-matrix-vector product (BGMV): token ``t`` multiplies by its own slot's matrix,
so a step that mixes adapters and base rows costs one launch per projection, not one per
adapter.

- ``lora_shrink(x, lora_a_stacked, token_slot, scale) -> y [T, r]`` in fp32 (the rank is small:
  keeping the intermediate in fp32 costs nothing and loses nothing between the two products);
  a row without an adapter is zero.
- ``lora_expand(y, lora_b_stacked, token_slot, base_out, slice_offset)`` adds ``y B^T`` into
  columns ``[slice_offset, slice_offset + out)`` of ``base_out``, in place. A fused projection
  (qkv, gate_up) has one slice per part, each with its own A and B: one shrink over the parts'
  A stacked along the rank, then one expand per part into its columns.

An adapter of rank below the slots' rank is zero-padded; the zeros add nothing. The kernels
read one program's tile of the slot's matrix per token: the decode-sized batches that dominate
serving. (Punica's SGMV, which sorts a prefill's tokens by adapter for tensor-core tiles, is the
step up for long prompts.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.dispatch import use_triton
from pagedserve.kernels.linear import linear

# Ranks per tile, whatever the adapter's rank (8..64 in 16s): one compiled variant per layer
# shape serves every rank, so loading an adapter of a new rank compiles nothing.
RANK_TILE = 16


@triton.jit(do_not_specialize=["T"])
def _lora_shrink_kernel(
    x_ptr, a_ptr, slot_ptr, out_ptr,
    T, R, K,
    stride_xt, stride_as, stride_ar, stride_ot,
    scale,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One program per (token, BLOCK_R ranks): ``out[t, r] = scale * x[t] . A[slot[t], r]``."""
    t = tl.program_id(0)
    ranks = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    # A row without an adapter reads nothing: its bounds shrink to zero.
    k_end = tl.where(slot >= 0, K, 0)
    rank_ok = ranks < tl.where(slot >= 0, R, 0)
    a_rows = a_ptr + tl.maximum(slot, 0) * stride_as + ranks.to(tl.int64)[:, None] * stride_ar
    x_row = x_ptr + t.to(tl.int64) * stride_xt
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < k_end
        x = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)
        a = tl.load(a_rows + k[None, :], mask=rank_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
    out = out_ptr + t.to(tl.int64) * stride_ot + ranks
    tl.store(out, acc * scale, mask=ranks < R)


@triton.jit(do_not_specialize=["T"])
def _lora_expand_kernel(
    y_ptr, b_ptr, slot_ptr, out_ptr,
    T, N, R,
    stride_yt, stride_bs, stride_bn, stride_ot,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):  # fmt: skip
    """One program per (token, BLOCK_N output features): ``out[t, n] += y[t] . B[slot[t], n]``.
    ``out_ptr`` already points at the slice's first column. Rows without an adapter are left
    untouched (not even rewritten)."""
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    col_ok = cols < tl.where(slot >= 0, N, 0)  # a row without an adapter: nothing to touch
    b_rows = b_ptr + tl.maximum(slot, 0) * stride_bs + cols.to(tl.int64)[:, None] * stride_bn
    y_row = y_ptr + t.to(tl.int64) * stride_yt
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_ok = r < R
        y = tl.load(y_row + r, mask=r_ok, other=0.0)
        b = tl.load(b_rows + r[None, :], mask=col_ok[:, None] & r_ok[None, :], other=0.0)
        acc += tl.sum(b.to(tl.float32) * y[None, :], axis=1)
    out = out_ptr + t.to(tl.int64) * stride_ot + cols
    base = tl.load(out, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(out, (base + acc).to(out_ptr.dtype.element_ty), mask=col_ok)


def _check(name: str, rows: torch.Tensor, stacked: torch.Tensor, token_slot: torch.Tensor) -> None:
    if rows.dim() != 2 or stacked.dim() != 3 or token_slot.dim() != 1:
        raise ValueError(f"{name}: expected a [T, features] input, [slots, rows, cols] weights "
                         f"and a [T] slot index; got {tuple(rows.shape)}, {tuple(stacked.shape)}, "
                         f"{tuple(token_slot.shape)}")  # fmt: skip
    if rows.shape[0] != token_slot.shape[0]:
        raise ValueError(f"{name}: {rows.shape[0]} rows but {token_slot.shape[0]} slot indices")
    if stacked.stride(-1) != 1 or rows.stride(-1) != 1:
        raise ValueError(f"{name}: the weights' and the input's last dimension must be contiguous")


def lora_shrink_triton(
    x: torch.Tensor, lora_a_stacked: torch.Tensor, token_slot: torch.Tensor, scale: float = 1.0
) -> torch.Tensor:
    """Launch wrapper: ``x [T, in]``, ``lora_a_stacked [slots, r, in]`` -> fp32 ``[T, r]``."""
    _check("lora_shrink", x, lora_a_stacked, token_slot)
    t, k = x.shape
    r = lora_a_stacked.shape[1]
    if lora_a_stacked.shape[2] != k:
        raise ValueError(f"lora_shrink: A has {lora_a_stacked.shape[2]} input features, x {k}")
    out = torch.empty(t, r, dtype=torch.float32, device=x.device)
    if out.numel():
        grid = (t, triton.cdiv(r, RANK_TILE))
        _lora_shrink_kernel[grid](
            x, lora_a_stacked, token_slot, out, t, r, k,
            x.stride(0), lora_a_stacked.stride(0), lora_a_stacked.stride(1), out.stride(0),
            float(scale), BLOCK_R=RANK_TILE, BLOCK_K=64,
        )  # fmt: skip
    return out


def lora_expand_triton(
    y: torch.Tensor,
    lora_b_stacked: torch.Tensor,
    token_slot: torch.Tensor,
    base_out: torch.Tensor,
    slice_offset: int = 0,
) -> torch.Tensor:
    """Launch wrapper: ``y [T, r]`` (fp32, rows may be strided), ``lora_b_stacked [slots, out,
    r]``; adds into ``base_out[:, slice_offset:slice_offset + out]`` and returns ``base_out``."""
    _check("lora_expand", y, lora_b_stacked, token_slot)
    t, r = y.shape
    n = lora_b_stacked.shape[1]
    if lora_b_stacked.shape[2] != r or base_out.shape[0] != t:
        raise ValueError(f"lora_expand: B {tuple(lora_b_stacked.shape)} and output "
                         f"{tuple(base_out.shape)} do not fit y {tuple(y.shape)}")  # fmt: skip
    if slice_offset < 0 or slice_offset + n > base_out.shape[1] or base_out.stride(-1) != 1:
        raise ValueError(f"lora_expand: columns [{slice_offset}, {slice_offset + n}) outside "
                         f"an output of {base_out.shape[1]} (last dimension contiguous)")  # fmt: skip
    if t and n:
        y = y.float()  # a no-op for the shrink's fp32 output
        grid = (t, triton.cdiv(n, 64))
        _lora_expand_kernel[grid](
            y, lora_b_stacked, token_slot, base_out[:, slice_offset:], t, n, r,
            y.stride(0), lora_b_stacked.stride(0), lora_b_stacked.stride(1), base_out.stride(0),
            BLOCK_N=64, BLOCK_R=RANK_TILE,
        )  # fmt: skip
    return base_out


RowsPerSlot = list[tuple[int, torch.Tensor | None]]


def rows_per_slot(token_slot: torch.Tensor) -> RowsPerSlot:
    """(slot, the rows that use it) for each adapter present; rows ``None`` when every row of
    the batch uses that one slot (no gather needed). The references' grouping: a caller that
    applies many layers to one batch computes it once and passes it to every call."""
    slots = torch.unique(token_slot).tolist()
    if len(slots) == 1:
        return [(slots[0], None)] if slots[0] >= 0 else []
    return [(s, (token_slot == s).nonzero(as_tuple=True)[0]) for s in slots if s >= 0]


def _torch_gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` in fp32 by torch (MKL on a CPU): the references' product."""
    return x.float() @ w.float().T


def _batch_invariant_gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` in fp32, each row's bits whatever the other rows (kernels.linear)."""
    return linear(x.float(), w.float().contiguous(), batch_invariant=True)


def _shrink_rows(x, lora_a_stacked, token_slot, scale, groups, gemm) -> torch.Tensor:
    out = torch.zeros(x.shape[0], lora_a_stacked.shape[1], dtype=torch.float32, device=x.device)
    for slot, rows in rows_per_slot(token_slot) if groups is None else groups:
        a = lora_a_stacked[slot]
        if rows is None:
            out = gemm(x, a) * scale
        else:
            out[rows] = gemm(x[rows], a) * scale
    return out


def _expand_rows(y, lora_b_stacked, token_slot, base_out, slice_offset, groups, gemm):
    cols = slice(slice_offset, slice_offset + lora_b_stacked.shape[1])
    for slot, rows in rows_per_slot(token_slot) if groups is None else groups:
        b = lora_b_stacked[slot]
        if rows is None:
            target = base_out[:, cols]
            target.copy_(target.float() + gemm(y, b))
        else:
            part = base_out[rows, cols].float() + gemm(y[rows], b)
            base_out[rows, cols] = part.to(base_out.dtype)
    return base_out


def lora_shrink_ref(
    x: torch.Tensor,
    lora_a_stacked: torch.Tensor,
    token_slot: torch.Tensor,
    scale: float = 1.0,
    groups: RowsPerSlot | None = None,
) -> torch.Tensor:
    """Reference (the CPU path): the rows of each adapter present, one matmul per adapter
    (``groups``: ``rows_per_slot(token_slot)``, if the caller has it already)."""
    return _shrink_rows(x, lora_a_stacked, token_slot, scale, groups, _torch_gemm)


def lora_expand_ref(
    y: torch.Tensor,
    lora_b_stacked: torch.Tensor,
    token_slot: torch.Tensor,
    base_out: torch.Tensor,
    slice_offset: int = 0,
    groups: RowsPerSlot | None = None,
) -> torch.Tensor:
    """Reference (the CPU path): each adapter's rows get ``y B^T`` added to their slice's
    columns, summed in fp32 and rounded once, as the kernel does."""
    return _expand_rows(y, lora_b_stacked, token_slot, base_out, slice_offset, groups, _torch_gemm)


def lora_shrink(
    x: torch.Tensor,
    lora_a_stacked: torch.Tensor,
    token_slot: torch.Tensor,
    scale: float = 1.0,
    groups: RowsPerSlot | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """``scale * x A[slot]^T`` per row (zero where the slot is -1), fp32 ``[T, r]``.
    ``groups`` (``rows_per_slot(token_slot)``) spares the reference its grouping.
    ``batch_invariant``: each row's bits whatever the other rows (the Triton kernel's one
    program per token is; on a CPU the reference's grouping with kernels.linear's GEMM)."""
    if use_triton(x):
        return lora_shrink_triton(x, lora_a_stacked, token_slot, scale)
    gemm = _batch_invariant_gemm if batch_invariant else _torch_gemm
    return _shrink_rows(x, lora_a_stacked, token_slot, scale, groups, gemm)


def lora_expand(
    y: torch.Tensor,
    lora_b_stacked: torch.Tensor,
    token_slot: torch.Tensor,
    base_out: torch.Tensor,
    slice_offset: int = 0,
    groups: RowsPerSlot | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """``base_out[:, slice] += y B[slot]^T`` per row with an adapter, in place;
    ``batch_invariant`` as for :func:`lora_shrink`."""
    if use_triton(base_out):
        return lora_expand_triton(y, lora_b_stacked, token_slot, base_out, slice_offset)
    gemm = _batch_invariant_gemm if batch_invariant else _torch_gemm
    return _expand_rows(y, lora_b_stacked, token_slot, base_out, slice_offset, groups, gemm)
