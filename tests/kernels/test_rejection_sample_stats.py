"""The acceptance rule keeps the target's distribution: a chi-square test over a small
vocabulary, with a draft distribution that differs from the target's.

200 000 draws per test: a token whose probability is off by 0.01 (absolute) adds about
N * 0.01^2 / p ~ 100 to the statistic, far past the 0.1 % critical value of chi-square with
5 degrees of freedom (20.52); the power check below holds the test to that.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.rejection_sample import rejection_sample

VOCAB = 6
DRAWS = 200_000
CRITICAL = 20.515  # chi-square, 5 degrees of freedom, upper 0.1 % point


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    expected = probs.double() * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


def draws(target: torch.Tensor, draft: torch.Tensor | None, proposed: torch.Tensor, seed: int):
    """Emitted tokens ``[N, K + 1]`` for N rows that each verify ``proposed`` (drawn from
    ``draft`` when it is given) against the same fixed ``target [K + 1, V]``."""
    gen = torch.Generator().manual_seed(seed)
    k = target.shape[0] - 1
    rows_target = target[:k].expand(DRAWS, k, VOCAB).contiguous()
    draft_probs = None if draft is None else draft.expand(DRAWS, k, VOCAB).contiguous()
    bonus = torch.multinomial(target[k], DRAWS, replacement=True, generator=gen)
    uniform = torch.rand(DRAWS, k, generator=gen)
    noise = torch.empty(DRAWS, k, VOCAB).exponential_(generator=gen)
    return rejection_sample(
        proposed, torch.full((DRAWS,), k), draft_probs, rows_target, bonus, uniform, noise
    )


def _target(gen) -> torch.Tensor:
    return torch.softmax(torch.randn(3, VOCAB, generator=gen) * 1.5, dim=-1)


def test_emitted_tokens_follow_the_target_under_a_different_draft():
    gen = torch.Generator().manual_seed(0)
    target = _target(gen)
    draft = torch.softmax(torch.randn(2, VOCAB, generator=gen) * 1.5, dim=-1)
    assert (target[:2] - draft).abs().max() > 0.1  # the two really differ
    proposed = torch.stack(
        [torch.multinomial(draft[j], DRAWS, replacement=True, generator=gen) for j in range(2)],
        dim=1,
    )
    out = draws(target, draft, proposed, seed=1)
    assert chi_square(out[:, 0], target[0]) < CRITICAL
    # the second token, wherever the first was an accepted proposal, follows target[1]
    accepted = out[:, 1] >= 0
    assert accepted.sum() > DRAWS // 10
    assert chi_square(out[accepted, 1], target[1]) < CRITICAL
    # power: the same draws against a target moved by 0.01 fail the test
    shifted = target[0].clone()
    shifted[0] += 0.01
    shifted[1] -= 0.01
    assert chi_square(out[:, 0], shifted) > CRITICAL


def test_a_deterministic_proposal_keeps_the_target_distribution():
    """An n-gram proposal (one-hot draft): accepted with probability p(d), else a token drawn
    from p without d; together exactly p."""
    gen = torch.Generator().manual_seed(2)
    target = _target(gen)
    proposed = torch.tensor([[3, 1]]).expand(DRAWS, 2).contiguous()
    out = draws(target, None, proposed, seed=3)
    assert chi_square(out[:, 0], target[0]) < CRITICAL
    accepted_rate = (out[:, 0] == 3).double().mean()
    assert abs(float(accepted_rate) - float(target[0, 3])) < 0.005
