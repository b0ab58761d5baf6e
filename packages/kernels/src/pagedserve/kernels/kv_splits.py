"""How paged attention's KV splits are combined (flash-decoding's reduce), and the
batch-invariant fold that every split of every row goes through.

A long decode's KV positions are cut into splits that run as programs of their own
(paged_attention.py): each leaves its normalised output and its log-sum-exp (exp2 units), and
a reduce weighs the splits by ``exp2(lse - max lse)``. ``_merge_kv_splits_kernel`` does so over
all splits at once (a ``tl.sum``, whose tree follows the split count). The batch-invariant
mode needs a row's bits to follow its own positions alone, so there every row, decode or
prefill, is cut at the same fixed positions and its splits are folded one after the other by
``_fold_split``: inside the attention program that walks them, or by
``_fold_kv_splits_kernel`` over the partials of split programs, with the same arithmetic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _normalised(m_i, l_i, acc):
    """A KV range's output (``acc / l``; 0 for a row that saw nothing) and log-sum-exp
    (exp2 units; -inf for a row that saw nothing) from its online-softmax state."""
    safe = tl.where(l_i > 0, l_i, 1.0)
    return acc / safe[:, None], tl.where(l_i > 0, m_i + tl.log2(safe), float("-inf"))


@triton.jit
def _fold_split(m_run, w_run, acc_run, out_s, lse_s):
    """Fold one KV split's normalised output ``out_s [R, D]`` and log-sum-exp ``lse_s [R]``
    (exp2 units) into the running ``(max, weight, weighted sum)`` of its rows. The
    batch-invariant attention folds every row's splits with this one function, in split
    order, whether one program walks them or the split programs' partials are folded after
    (``_fold_kv_splits_kernel``): the same bits either way. A split that saw nothing
    (``lse_s`` -inf) changes nothing."""
    m_new = tl.maximum(m_run, lse_s)
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    keep = tl.exp2(m_run - shift)
    weight = tl.exp2(lse_s - shift)
    add = tl.where(weight[:, None] > 0, out_s * weight[:, None], 0.0)
    return m_new, tl.fma(w_run, keep, weight), tl.fma(acc_run, keep[:, None], add)


@triton.jit(do_not_specialize=["n_splits", "lse_token_stride", "lse_head_stride"])
def _merge_kv_splits_kernel(
    partial_ptr, lse_ptr, out_ptr, n_splits, head_dim,
    partial_token_stride, partial_head_stride, lse_token_stride, lse_head_stride,
    out_token_stride, out_head_stride,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Flash-decoding's reduce: each split's output weighted by exp2(its log-sum-exp)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    s_mask = splits < n_splits
    lse = tl.load(
        lse_ptr + token * lse_token_stride + head * lse_head_stride + splits,
        mask=s_mask, other=float("-inf"),
    )  # fmt: skip
    m = tl.max(lse, axis=0)
    weight = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    off = token * partial_token_stride + head * partial_head_stride
    off += splits[:, None] * head_dim + dims[None, :]
    part = tl.load(partial_ptr + off, mask=s_mask[:, None] & (dims < head_dim)[None, :], other=0.0)
    # Splits that saw nothing (weight 0) may hold uninitialised memory: drop, do not scale.
    part = tl.where(weight[:, None] > 0, part, 0.0)
    total = tl.sum(weight, axis=0)
    out = tl.sum(weight[:, None] * part, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + token * out_token_stride + head * out_head_stride + dims,
        out.to(out_ptr.dtype.element_ty), mask=dims < head_dim,
    )  # fmt: skip


@triton.jit(do_not_specialize=["n_splits", "lse_token_stride", "lse_head_stride"])
def _fold_kv_splits_kernel(
    partial_ptr, lse_ptr, out_ptr, sinks_ptr, n_splits, head_dim,
    partial_token_stride, partial_head_stride, lse_token_stride, lse_head_stride,
    out_token_stride, out_head_stride,
    BLOCK_D: tl.constexpr, SINKS: tl.constexpr,
):  # fmt: skip
    """The batch-invariant reduce: one (token, head)'s splits folded in split order with
    ``_fold_split``, exactly as a program that walks every split folds them (from the head's
    sink, SINKS, as that program does: a state of max ``sink`` and weight 1)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dims = tl.arange(0, BLOCK_D)
    d_mask = (dims < head_dim)[None, :]
    lse_row = lse_ptr + token * lse_token_stride + head * lse_head_stride + tl.arange(0, 1)
    part_row = partial_ptr + token * partial_token_stride + head * partial_head_stride
    m_run = tl.full([1], float("-inf"), tl.float32)
    w_run = tl.zeros([1], tl.float32)
    if SINKS:  # exp2 units, as the attention kernel reads it
        m_run = tl.load(sinks_ptr + head + tl.arange(0, 1)).to(tl.float32) * 1.4426950408889634
        w_run = tl.full([1], 1.0, tl.float32)
    acc_run = tl.zeros([1, BLOCK_D], tl.float32)
    for split in range(0, n_splits):
        lse = tl.load(lse_row + split)
        part = tl.load(part_row + split * head_dim + dims[None, :], mask=d_mask, other=0.0)
        m_run, w_run, acc_run = _fold_split(m_run, w_run, acc_run, part, lse)
    out = acc_run / tl.where(w_run > 0, w_run, 1.0)[:, None]
    out_row = out_ptr + token * out_token_stride + head * out_head_stride
    tl.store(out_row + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=d_mask)


def merge_kv_splits(
    partial: torch.Tensor,
    lse: torch.Tensor,
    out: torch.Tensor,
    in_order: bool = False,
    sinks: torch.Tensor | None = None,
) -> None:
    """Launch the merge of ``partial [T, Hq, splits, D]`` into ``out [T, Hq, D]``; with
    ``in_order``, the batch-invariant fold, which starts from ``sinks [Hq]`` where given (the
    default merge's splits carry the sink in split 0's partial: ``sinks`` is not read)."""
    n_tokens, n_q_heads, splits, head_dim = partial.shape
    args = (
        partial, lse, out, splits, head_dim, partial.stride(0), partial.stride(1),
        lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
    )  # fmt: skip
    block_d = triton.next_power_of_2(head_dim)
    if in_order:
        sink_ptr = out if sinks is None else sinks
        _fold_kv_splits_kernel[(n_tokens, n_q_heads)](
            partial, lse, out, sink_ptr, *args[3:], BLOCK_D=block_d, SINKS=sinks is not None
        )
    else:
        _merge_kv_splits_kernel[(n_tokens, n_q_heads)](
            *args, BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d
        )


def merge_kv_splits_ref(
    partial: torch.Tensor,
    lse: torch.Tensor,
    out: torch.Tensor,
    in_order: bool = False,
    sinks: torch.Tensor | None = None,
) -> None:
    """Reference for ``merge_kv_splits``, in fp32 torch: every split's output weighted by
    ``exp2(its lse - the max lse)``; a split that saw nothing (lse -inf) adds nothing. The
    in-order fold computes the same sum (its order only fixes the rounding); its ``sinks`` are
    one more split that starts the fold, of output 0 and lse ``sink * log2(e)``."""
    part, lse32 = partial.float(), lse.float()
    if in_order and sinks is not None:
        n_tokens, n_q_heads, _, head_dim = part.shape
        sink_lse = (sinks.float() * 1.4426950408889634).expand(n_tokens, n_q_heads)[..., None]
        lse32 = torch.cat([sink_lse, lse32], dim=-1)
        part = torch.cat([part.new_zeros(n_tokens, n_q_heads, 1, head_dim), part], dim=2)
    top = lse32.amax(dim=-1, keepdim=True)
    weight = torch.exp2(lse32 - torch.where(top == float("-inf"), 0.0, top))
    part = torch.where(weight[..., None] > 0, part, 0.0)
    total = weight.sum(dim=-1, keepdim=True)
    merged = (weight[..., None] * part).sum(dim=2) / torch.where(total > 0, total, 1.0)
    out.copy_(merged.to(out.dtype))
