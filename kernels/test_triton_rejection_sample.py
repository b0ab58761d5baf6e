"""rejection_sample: the Triton kernel (or the implementation given with --impl) against the
reference, token for token, with and without draft probabilities, greedy rows included."""

import pytest
import torch
from contracts import implementation
from suite_grid import DEVICE, pick

from pagedserve.kernels.rejection_sample import rejection_sample_ref

VOCABS = pick([50, 300], [32000, 151936])


def _case(vocab: int, draft_model: bool, seed: int):
    """Rows with 0..K proposals; half of the proposals are the target's argmax (so runs of
    accepts happen), greedy rows (one-hot target, u = 1, E = 1) beside sampled ones."""
    gen = torch.Generator().manual_seed(seed)
    rows, k = 7, 4
    target = torch.softmax(torch.randn(rows, k, vocab, generator=gen) * 3, dim=-1)
    draft = torch.randint(vocab, (rows, k), generator=gen)
    likely = torch.rand(rows, k, generator=gen) < 0.5
    draft = torch.where(likely, target.argmax(-1), draft)
    num_draft = torch.tensor([0, 1, 2, 3, 4, 4, 4], dtype=torch.int32)
    uniform = torch.rand(rows, k, generator=gen)
    noise = torch.empty(rows, k, vocab).exponential_(generator=gen)
    greedy = torch.tensor([False, True, False, True, False, True, False])
    one_hot = torch.nn.functional.one_hot(target.argmax(-1), vocab).float()
    target = torch.where(greedy[:, None, None], one_hot, target)
    uniform = torch.where(greedy[:, None], 1.0, uniform)
    noise = torch.where(greedy[:, None, None], 1.0, noise)
    draft_probs = None
    if draft_model:
        draft_probs = torch.softmax(torch.randn(rows, k, vocab, generator=gen), dim=-1)
    bonus = torch.randint(vocab, (rows,), generator=gen)
    args = (draft, num_draft, draft_probs, target, bonus, uniform, noise)
    return [a if a is None else a.to(DEVICE) for a in args]


@pytest.mark.contract("rejection_sample")
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("draft_model", [False, True], ids=["ngram", "draft_model"])
@pytest.mark.parametrize("seed", [0, 1])
def test_rejection_sample_same_tokens_on_the_same_draws(vocab, draft_model, seed):
    args = _case(vocab, draft_model, seed)
    out = implementation("rejection_sample")(*args)
    expected = rejection_sample_ref(*args)
    assert out.dtype == torch.int64 and out.shape == expected.shape
    assert torch.equal(out.cpu(), expected.cpu())
    emitted = (expected >= 0).sum(dim=1)
    assert emitted.min() >= 1 and emitted.max() > 2  # every row emits; some accept a run


@pytest.mark.contract("rejection_sample")
def test_rejection_sample_no_proposals_emits_the_bonus_token():
    vocab = 40
    args = [
        torch.zeros(3, 0, dtype=torch.int64),
        torch.zeros(3, dtype=torch.int32),
        None,
        torch.zeros(3, 0, vocab),
        torch.tensor([5, 6, 7]),
        torch.zeros(3, 0),
        torch.ones(3, 0, vocab),
    ]
    args = [a if a is None else a.to(DEVICE) for a in args]
    out = implementation("rejection_sample")(*args)
    assert out.cpu().tolist() == [[5], [6], [7]]
