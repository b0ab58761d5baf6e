"""Repetition, presence and frequency penalties on a batch of next-token logits (vLLM's).

For row b and token v, with ``count = output_counts[b, v]`` (times v was generated so far)
and ``seen = prompt_mask[b, v] or count > 0``:

1. repetition (on every seen token): ``logit / r`` if ``logit > 0`` else ``logit * r``;
2. frequency: ``logit -= frequency * count``;  3. presence: ``logit -= presence * (count > 0)``.

Penalties of 1.0 / 0.0 / 0.0 leave a row unchanged. The input is not modified.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.dispatch import use_triton


@triton.jit
def _apply_penalties_kernel(
    logits_ptr, prompt_mask_ptr, output_counts_ptr, repetition_ptr, presence_ptr,
    frequency_ptr, out_ptr, vocab_size, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < vocab_size
    offs = row * vocab_size + cols
    logits = tl.load(logits_ptr + offs, mask=mask, other=0.0)
    counts = tl.load(output_counts_ptr + offs, mask=mask, other=0)
    in_prompt = tl.load(prompt_mask_ptr + offs, mask=mask, other=0) != 0
    repetition = tl.load(repetition_ptr + row)
    penalised = tl.where(logits > 0, logits / repetition, logits * repetition)
    logits = tl.where(in_prompt | (counts > 0), penalised, logits)
    logits = logits - tl.load(frequency_ptr + row) * counts.to(tl.float32)
    logits = logits - tl.load(presence_ptr + row) * (counts > 0).to(tl.float32)
    tl.store(out_ptr + offs, logits, mask=mask)


def apply_penalties_triton(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    repetition_penalty: torch.Tensor,
    presence_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
) -> torch.Tensor:
    """Launch wrapper: one program per (row, vocab tile)."""
    _check(
        logits, prompt_mask, output_counts, repetition_penalty, presence_penalty, frequency_penalty
    )
    n_rows, vocab_size = logits.shape
    out = torch.empty_like(logits)
    if out.numel():
        block = 1024
        _apply_penalties_kernel[(n_rows, triton.cdiv(vocab_size, block))](
            logits.contiguous(), prompt_mask.contiguous().view(torch.uint8),
            output_counts.contiguous(), repetition_penalty.float().contiguous(),
            presence_penalty.float().contiguous(), frequency_penalty.float().contiguous(),
            out, vocab_size, BLOCK=block,
        )  # fmt: skip
    return out


def _check(logits, prompt_mask, output_counts, repetition, presence, frequency) -> None:
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(
            f"apply_penalties: logits must be [B, V] fp32, got {tuple(logits.shape)} {logits.dtype}"
        )
    if prompt_mask.shape != logits.shape or output_counts.shape != logits.shape:
        raise ValueError(
            "apply_penalties: prompt_mask and output_counts must be [B, V] like logits"
        )
    if prompt_mask.dtype != torch.bool:
        raise ValueError(f"apply_penalties: prompt_mask must be bool, got {prompt_mask.dtype}")
    for name, t in (("repetition", repetition), ("presence", presence), ("frequency", frequency)):
        if t.shape != (logits.shape[0],):
            raise ValueError(f"apply_penalties: {name}_penalty must be [B], got {tuple(t.shape)}")


def apply_penalties_ref(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    repetition_penalty: torch.Tensor,
    presence_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
) -> torch.Tensor:
    """Reference: the three penalties as whole-batch tensor ops, in the order above."""
    _check(
        logits, prompt_mask, output_counts, repetition_penalty, presence_penalty, frequency_penalty
    )
    counts = output_counts.float()
    generated = output_counts > 0
    repetition = repetition_penalty.float()[:, None]
    penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(prompt_mask | generated, penalised, logits)
    logits = logits - frequency_penalty.float()[:, None] * counts
    return logits - presence_penalty.float()[:, None] * generated.float()


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    repetition_penalty: torch.Tensor,
    presence_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
) -> torch.Tensor:
    """Penalised copy of ``logits [B, V]``; see the module docstring for the rules."""
    args = (
        logits,
        prompt_mask,
        output_counts,
        repetition_penalty,
        presence_penalty,
        frequency_penalty,
    )
    if use_triton(logits):
        return apply_penalties_triton(*args)
    return apply_penalties_ref(*args)
