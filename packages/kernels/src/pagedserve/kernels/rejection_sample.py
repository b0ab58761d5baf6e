"""Rejection sampling for speculative decoding: which proposed tokens the target model keeps.

For each row (one sequence of a verify step) with ``n <= K`` proposed tokens ``d_j``, target
distributions ``p_j`` (j = 0..n-1) and draft distributions ``q_j``, the rule of Leviathan et al.
and Chen et al. (2023):

- proposal j is accepted with probability ``min(1, p_j(d_j) / q_j(d_j))``, tested as
  ``p_j(d_j) > 0 and u_j * q_j(d_j) <= p_j(d_j)`` with ``u_j ~ U[0, 1)``;
- at the first rejection the row ends with a token drawn from ``(p_j - q_j)+`` renormalised
  (the recovered token), drawn by the exponential race ``argmax_v (p_j - q_j)+_v / E_v`` with
  ``E ~ Exp(1)`` (as ``1 / E`` times the difference: a product is rounded alike everywhere);
- when all n are accepted, the row ends with the bonus token (drawn by the caller from the
  target distribution after the last proposal).

The emitted tokens are then distributed exactly as the target model's own draws. Without a
draft distribution (``draft_probs`` None: an n-gram proposer, sure of its guess) q is one-hot
at the proposed token. Greedy rows are the special case the caller sets up with one-hot
targets at the argmax, ``u = 1`` and ``E = 1``: a proposal is kept exactly when it is the
argmax, and the first rejection emits the argmax.

Output ``[R, K + 1]`` int64: each row's accepted proposals, then its recovered or bonus token,
then -1 (vLLM's placeholder) to the end. Randomness is an input (the engine draws it from each
request's seeded generator), so the Triton kernel and the reference agree token for token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.dispatch import use_triton

PLACEHOLDER_TOKEN_ID = -1


@triton.jit(do_not_specialize=["max_spec_len"])  # k varies per step: one variant per vocabulary
def _recovered_tokens_kernel(
    draft_ptr, num_draft_ptr, draft_probs_ptr, target_probs_ptr, inv_noise_ptr, recovered_ptr,
    max_spec_len, vocab_size, HAS_DRAFT_PROBS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One program per (row, position): argmax over the vocabulary of (p - q)+ / E."""
    row = tl.program_id(0).to(tl.int64)
    pos = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, 1)
    if pos < tl.load(num_draft_ptr + row):
        index = row * max_spec_len + pos
        draft = tl.load(draft_ptr + index + offs)
        base = index * vocab_size
        best = tl.full([1], -1.0, tl.float32)
        best_idx = tl.zeros([1], tl.int64)
        for start in range(0, vocab_size, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < vocab_size
            p = tl.load(target_probs_ptr + base + cols, mask=mask, other=0.0)
            if HAS_DRAFT_PROBS:
                q = tl.load(draft_probs_ptr + base + cols, mask=mask, other=0.0)
            else:
                q = tl.where(cols == draft, 1.0, 0.0)
            inv_noise = tl.load(inv_noise_ptr + base + cols, mask=mask, other=0.0)
            score = tl.where(mask, tl.maximum(p - q, 0.0) * inv_noise, -1.0)
            m = tl.max(score, axis=0)
            idx = tl.min(tl.where(score == m, cols, 2147483647), axis=0).to(tl.int64)
            better = m > best  # strict: an earlier chunk wins ties
            best_idx = tl.where(better, idx, best_idx)
            best = tl.where(better, m, best)
        tl.store(recovered_ptr + index + offs, best_idx)


@triton.jit(do_not_specialize=["max_spec_len"])
def _rejection_kernel(
    draft_ptr, num_draft_ptr, draft_probs_ptr, target_probs_ptr, uniform_ptr, recovered_ptr,
    bonus_ptr, out_ptr, max_spec_len, vocab_size, HAS_DRAFT_PROBS: tl.constexpr,
):  # fmt: skip
    """One program per row: walk the proposals in order until the first rejection."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, 1)
    n = tl.load(num_draft_ptr + row + offs)
    alive = tl.full([1], 1, tl.int32)
    for j in range(0, max_spec_len):
        index = row * max_spec_len + j
        valid = (j < n) & (alive == 1)
        draft = tl.load(draft_ptr + index + offs, mask=valid, other=0)
        p = tl.load(target_probs_ptr + index * vocab_size + draft, mask=valid, other=0.0)
        if HAS_DRAFT_PROBS:
            q = tl.load(draft_probs_ptr + index * vocab_size + draft, mask=valid, other=1.0)
        else:
            q = tl.full([1], 1.0, tl.float32)
        u = tl.load(uniform_ptr + index + offs, mask=valid, other=1.0)
        accept = (p > 0.0) & (u * q <= p)
        recovered = tl.load(recovered_ptr + index + offs, mask=valid, other=0)
        token = tl.where(accept, draft, recovered)
        tl.store(out_ptr + row * (max_spec_len + 1) + j + offs, token, mask=valid)
        alive = tl.where(valid & ~accept, 0, alive)
    bonus = tl.load(bonus_ptr + row + offs)
    tl.store(out_ptr + row * (max_spec_len + 1) + n + offs, bonus, mask=alive == 1)


def _inverse_noise(noise: torch.Tensor) -> torch.Tensor:
    """``1 / E``, computed once with torch for both paths; a zero draw counts as the smallest
    normal float (0 * inf would be NaN, which the two argmaxes treat differently)."""
    return noise.float().clamp(min=torch.finfo(torch.float32).tiny).reciprocal()


def _check(draft_token_ids, num_draft_tokens, draft_probs, target_probs, bonus, uniform, noise):
    rows, k = draft_token_ids.shape
    if target_probs.dim() != 3 or target_probs.shape[:2] != (rows, k):
        raise ValueError(
            f"rejection_sample: target_probs must be [R, K, V] with R, K = {rows}, {k}, "
            f"got {tuple(target_probs.shape)}"
        )
    if target_probs.dtype != torch.float32:
        raise ValueError(f"rejection_sample: target_probs must be fp32, got {target_probs.dtype}")
    for name, t in (("draft_probs", draft_probs), ("recovery_noise", noise)):
        if t is not None and t.shape != target_probs.shape:
            raise ValueError(f"rejection_sample: {name} must be shaped like target_probs")
    if uniform.shape != (rows, k):
        raise ValueError(f"rejection_sample: uniform must be [R, K], got {tuple(uniform.shape)}")
    for name, t in (("num_draft_tokens", num_draft_tokens), ("bonus_token_ids", bonus)):
        if t.shape != (rows,):
            raise ValueError(f"rejection_sample: {name} must be [R], got {tuple(t.shape)}")


def rejection_sample_triton(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    uniform: torch.Tensor,
    recovery_noise: torch.Tensor,
) -> torch.Tensor:
    """Launch wrapper: the recovered token of every (row, position), then one walk per row."""
    args = (draft_token_ids, num_draft_tokens, draft_probs, target_probs, bonus_token_ids)
    _check(*args, uniform, recovery_noise)
    rows, k, vocab_size = target_probs.shape
    device = target_probs.device
    out = torch.full((rows, k + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
    if rows == 0:
        return out
    draft = draft_token_ids.to(torch.int64).contiguous()
    num_draft = num_draft_tokens.to(torch.int32).contiguous()
    target = target_probs.contiguous()
    has_draft = draft_probs is not None
    q = draft_probs.float().contiguous() if has_draft else target  # unread without draft probs
    inv_noise = _inverse_noise(recovery_noise).contiguous()
    recovered = torch.zeros(rows, k, dtype=torch.int64, device=device)
    if k:
        block = min(4096, triton.next_power_of_2(vocab_size))
        _recovered_tokens_kernel[(rows, k)](
            draft, num_draft, q, target, inv_noise, recovered, k, vocab_size,
            HAS_DRAFT_PROBS=has_draft, BLOCK=block,
        )  # fmt: skip
    _rejection_kernel[(rows,)](
        draft, num_draft, q, target, uniform.float().contiguous(), recovered,
        bonus_token_ids.to(torch.int64).contiguous(), out, k, vocab_size,
        HAS_DRAFT_PROBS=has_draft,
    )  # fmt: skip
    return out


def rejection_sample_ref(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    uniform: torch.Tensor,
    recovery_noise: torch.Tensor,
) -> torch.Tensor:
    """Reference: every position's test and recovered token at once; the leading run of
    accepts (a cumulative product) says where each row stops."""
    args = (draft_token_ids, num_draft_tokens, draft_probs, target_probs, bonus_token_ids)
    _check(*args, uniform, recovery_noise)
    rows, k, vocab_size = target_probs.shape
    device = target_probs.device
    draft = draft_token_ids.to(torch.int64)
    num_draft = num_draft_tokens.to(torch.int64)
    valid = torch.arange(k, device=device)[None, :] < num_draft[:, None]
    safe = torch.where(valid, draft, 0)
    q = (
        draft_probs.float()
        if draft_probs is not None
        else torch.nn.functional.one_hot(safe, vocab_size).float()
    )
    p_draft = target_probs.gather(2, safe[:, :, None]).squeeze(2)
    q_draft = q.gather(2, safe[:, :, None]).squeeze(2)
    accept = valid & (p_draft > 0) & (uniform.float() * q_draft <= p_draft)
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)
    score = (target_probs - q).clamp(min=0) * _inverse_noise(recovery_noise)
    recovered = score.argmax(dim=-1)
    out = torch.full((rows, k + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
    positions = torch.arange(k + 1, device=device)[None, :]
    out[:, :k] = torch.where(positions[:, :k] < num_accepted[:, None], draft, out[:, :k])
    bonus = bonus_token_ids.to(torch.int64)
    recovered_at = (
        recovered.gather(1, num_accepted.clamp(max=k - 1)[:, None]).squeeze(1) if k else bonus
    )
    last = torch.where(num_accepted < num_draft, recovered_at, bonus)
    out.scatter_(1, num_accepted[:, None], last[:, None])
    return out


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    uniform: torch.Tensor,
    recovery_noise: torch.Tensor,
) -> torch.Tensor:
    """``[R, K + 1]`` emitted tokens per row (-1 padded); the rule is in the module docstring."""
    args = (draft_token_ids, num_draft_tokens, draft_probs, target_probs, bonus_token_ids)
    if use_triton(target_probs):
        return rejection_sample_triton(*args, uniform, recovery_noise)
    return rejection_sample_ref(*args, uniform, recovery_noise)
