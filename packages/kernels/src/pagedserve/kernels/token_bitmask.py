"""Structured outputs' mask: tokens a grammar forbids get -inf, in place, before sampling.

The grammar backend fills one packed bitmask per step: int32 ``[B, ceil(V / 32)]``, bit
``t % 32`` of word ``t // 32`` set where row b may take token t (xgrammar's layout). Rows of
unconstrained requests are all ones (-1) or are left out of ``indices``, so constrained and
unconstrained requests share one launch. Vocabulary entries past the bitmask's last word (a
model whose embedding is padded past the tokenizer) are forbidden.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.dispatch import use_triton


@triton.jit
def _apply_token_bitmask_kernel(
    logits_ptr, bitmask_ptr, indices_ptr, vocab_size, logits_stride, bitmask_stride,
    num_bitmask_tokens, HAS_INDICES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    if HAS_INDICES:
        row = tl.load(indices_ptr + tl.program_id(0)).to(tl.int64)
    else:
        row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = cols < vocab_size
    in_mask = cols < num_bitmask_tokens
    words = tl.load(bitmask_ptr + row * bitmask_stride + cols // 32, mask=in_mask, other=0)
    allowed = ((words >> (cols % 32)) & 1) != 0
    tl.store(logits_ptr + row * logits_stride + cols, -float("inf"), mask=in_vocab & ~allowed)


def apply_token_bitmask_triton(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None
) -> None:
    """Launch wrapper: one program per (row to mask, vocabulary tile)."""
    _check(logits, bitmask, indices)
    rows = logits.shape[0] if indices is None else indices.numel()
    if rows == 0 or logits.shape[1] == 0:
        return
    block = 4096
    vocab_size = logits.shape[1]
    _apply_token_bitmask_kernel[(rows, triton.cdiv(vocab_size, block))](
        logits, bitmask, bitmask if indices is None else indices, vocab_size, logits.stride(0),
        bitmask.stride(0), bitmask.shape[1] * 32, HAS_INDICES=indices is not None, BLOCK=block,
    )  # fmt: skip


def _check(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(
            f"apply_token_bitmask: logits must be [B, V] with unit stride over V, got "
            f"{tuple(logits.shape)} strides {logits.stride()}"
        )
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32 or bitmask.stride(1) != 1:
        raise ValueError(
            f"apply_token_bitmask: bitmask must be int32 [B, W] contiguous over W, got "
            f"{tuple(bitmask.shape)} {bitmask.dtype}"
        )
    if bitmask.shape[0] != logits.shape[0]:
        raise ValueError(
            f"apply_token_bitmask: {bitmask.shape[0]} bitmask rows for {logits.shape[0]} logits rows"
        )
    if indices is not None and (
        indices.dim() != 1 or indices.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError("apply_token_bitmask: indices must be a 1-d int32/int64 tensor of rows")


def unpack_token_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The packed int32 bitmask ``[B, W]`` as bool ``[B, vocab_size]`` (True = allowed; tokens
    past ``32 * W`` are not)."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = ((bitmask[:, :, None] >> shifts) & 1).reshape(bitmask.shape[0], -1).bool()
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    pad = torch.zeros(
        bits.shape[0], vocab_size - bits.shape[1], dtype=torch.bool, device=bits.device
    )
    return torch.cat([bits, pad], dim=1)


def apply_token_bitmask_ref(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None
) -> None:
    """Reference: unpack the rows' bits and fill the forbidden logits with -inf, in place."""
    _check(logits, bitmask, indices)
    if indices is None:
        logits.masked_fill_(~unpack_token_bitmask(bitmask, logits.shape[1]), float("-inf"))
        return
    rows = indices.long()
    allowed = unpack_token_bitmask(bitmask.index_select(0, rows), logits.shape[1])
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None
) -> None:
    """Mask ``logits [B, V]`` in place with ``bitmask [B, ceil(V / 32)]``: every row, or only
    the rows listed in ``indices``."""
    if use_triton(logits):
        apply_token_bitmask_triton(logits, bitmask, indices)
    else:
        apply_token_bitmask_ref(logits, bitmask, indices)
