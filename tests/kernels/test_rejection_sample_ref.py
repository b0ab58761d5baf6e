"""rejection_sample_ref (the CPU engine's path) against the rule written out row by row."""

import pytest
import torch

from pagedserve.kernels.rejection_sample import rejection_sample, rejection_sample_ref


def rejection_sample_spec(draft, num_draft, draft_probs, target, bonus, uniform, noise):
    """Leviathan et al.'s rule, literally: walk each row's proposals, accept with probability
    min(1, p/q), resample the first rejection from (p - q)+ (exponential race), else bonus."""
    rows, k, vocab = target.shape
    out = [[-1] * (k + 1) for _ in range(rows)]
    for r in range(rows):
        for j in range(int(num_draft[r])):
            d = int(draft[r, j])
            q = draft_probs[r, j] if draft_probs is not None else torch.eye(vocab)[d]
            p = target[r, j]
            if p[d] > 0 and uniform[r, j] * q[d] <= p[d]:
                out[r][j] = d
                continue
            scores = [max(p[v] - q[v], 0.0) * (1.0 / noise[r, j, v]) for v in range(vocab)]
            out[r][j] = max(range(vocab), key=lambda v: (scores[v], -v))
            break
        else:
            out[r][int(num_draft[r])] = int(bonus[r])
    return out


@pytest.mark.parametrize("draft_model", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_reference_follows_the_rule(draft_model, seed):
    gen = torch.Generator().manual_seed(seed)
    rows, k, vocab = 6, 3, 11
    target = torch.softmax(torch.randn(rows, k, vocab, generator=gen) * 2, dim=-1)
    draft = torch.where(
        torch.rand(rows, k, generator=gen) < 0.6,
        target.argmax(-1),
        torch.randint(vocab, (rows, k), generator=gen),
    )
    draft_probs = (
        torch.softmax(torch.randn(rows, k, vocab, generator=gen), dim=-1) if draft_model else None
    )
    num_draft = torch.tensor([0, 1, 2, 3, 3, 3])
    bonus = torch.randint(vocab, (rows,), generator=gen)
    uniform = torch.rand(rows, k, generator=gen)
    noise = torch.empty(rows, k, vocab).exponential_(generator=gen)
    args = (draft, num_draft, draft_probs, target, bonus, uniform, noise)
    assert rejection_sample_ref(*args).tolist() == rejection_sample_spec(*args)
    assert rejection_sample(*args).tolist() == rejection_sample_spec(*args)


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="uniform"):
        rejection_sample_ref(
            torch.zeros(2, 3, dtype=torch.long),
            torch.zeros(2),
            None,
            torch.zeros(2, 3, 5),
            torch.zeros(2, dtype=torch.long),
            torch.zeros(2, 2),
            torch.ones(2, 3, 5),
        )
