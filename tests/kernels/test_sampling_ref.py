"""sample_tokens_ref and apply_penalties_ref against row-by-row naive implementations."""

import pytest
import torch

from pagedserve.kernels.penalties import apply_penalties, apply_penalties_ref
from pagedserve.kernels.sampling import sample_tokens, sample_tokens_ref


def naive_kept(logits_row, temperature, top_k, top_p, min_p) -> set[int]:
    """The kept set by the definitions, with a sort and Python loops (float64)."""
    p = torch.softmax(logits_row.double() / temperature, dim=-1)
    order = sorted(range(len(p)), key=lambda i: -p[i].item())
    kept = set(range(len(p)))
    if 0 < top_k < len(p):
        kth = p[order[top_k - 1]].item()
        kept = {i for i in kept if p[i].item() >= kth}
    if top_p < 1.0:
        mass_k = sum(p[i].item() for i in kept)
        running, threshold = 0.0, None
        for i in order:
            if i in kept:
                running += p[i].item()
                if running >= top_p * mass_k:
                    threshold = p[i].item()
                    break
        kept = {i for i in kept if p[i].item() >= threshold}
    return {i for i in kept if p[i].item() >= min_p * p.max().item()}


ROWS = [  # temperature, top_k, top_p, min_p
    (1.0, 0, 1.0, 0.0),
    (0.7, 5, 1.0, 0.0),
    (1.3, 0, 0.6, 0.0),
    (1.0, 0, 1.0, 0.2),
    (0.9, 12, 0.8, 0.05),
    (1.0, 1, 1.0, 0.0),
    (2.0, 64, 0.5, 0.0),
]


def _params(rows):
    t, k, p, m = zip(*rows)
    return (torch.tensor(t), torch.tensor(k, dtype=torch.int32), torch.tensor(p), torch.tensor(m))


def test_tokens_are_the_exponential_race_winner_within_the_naive_kept_set():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(ROWS), 64, generator=gen) * 2
    temperature, top_k, top_p, min_p = _params(ROWS)
    for _ in range(5):
        noise = torch.empty(logits.shape).exponential_(generator=gen)
        tokens = sample_tokens_ref(logits, temperature, top_k, top_p, min_p, noise)
        for b, (t, k, p, m) in enumerate(ROWS):
            kept = naive_kept(logits[b], t, k, p, m)
            probs = torch.softmax(logits[b].double() / t, dim=-1)
            winner = max(kept, key=lambda i: (probs[i] / noise[b, i]).item())
            assert tokens[b].item() == winner, (b, ROWS[b])


def test_ties_at_the_kth_value_are_kept():
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0]])
    temperature, top_k, top_p, min_p = _params([(1.0, 2, 1.0, 0.0)])
    noise = torch.tensor([[1e3, 1e-3, 1.0, 1e3, 1e-9]])  # favours index 1 among the kept
    assert sample_tokens_ref(logits, temperature, top_k, top_p, min_p, noise).item() == 1
    assert naive_kept(logits[0], 1.0, 2, 1.0, 0.0) == {0, 1, 2, 3}


def test_greedy_rows_take_the_first_argmax_whatever_the_noise():
    logits = torch.tensor([[0.0, 5.0, 5.0, 1.0], [2.0, 1.0, 0.0, 2.0]])
    params = _params([(0.0, 0, 1.0, 0.0), (1e-6, 2, 0.5, 0.1)])
    noise = torch.tensor([[1.0, 1e3, 1e-9, 1.0]] * 2)
    assert sample_tokens_ref(logits, *params, noise).tolist() == [1, 0]


def test_draws_follow_the_renormalised_kept_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    params = _params([(1.0, 3, 1.0, 0.0)])  # keeps 0.5/0.3/0.15 -> renormalised /0.95
    gen = torch.Generator().manual_seed(1)
    n = 4000
    noise = torch.empty(n, 4).exponential_(generator=gen)
    rows = [t.expand(n).contiguous() for t in params]
    tokens = sample_tokens_ref(logits.expand(n, 4).contiguous(), *rows, noise)
    freq = torch.bincount(tokens, minlength=4).double() / n
    torch.testing.assert_close(
        freq, torch.tensor([0.5, 0.3, 0.15, 0.0]).double() / 0.95, atol=0.03, rtol=0
    )


def test_public_functions_use_the_references_on_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    logits = torch.randn(2, 10)
    params = _params([(1.0, 3, 0.9, 0.0), (0.0, 0, 1.0, 0.0)])
    noise = torch.rand(2, 10) + 0.1
    assert torch.equal(
        sample_tokens(logits, *params, noise), sample_tokens_ref(logits, *params, noise)
    )
    args = (logits, torch.zeros(2, 10, dtype=torch.bool), torch.zeros(2, 10, dtype=torch.int32))
    args += (torch.ones(2), torch.zeros(2), torch.zeros(2))
    assert torch.equal(apply_penalties(*args), logits)


@pytest.mark.parametrize("seed", [0, 1])
def test_penalties_match_a_per_token_loop(seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 20, generator=gen)
    prompt_mask = torch.rand(3, 20, generator=gen) < 0.3
    counts = (torch.rand(3, 20, generator=gen) * 4).int() * (torch.rand(3, 20, generator=gen) < 0.3)
    repetition, presence, frequency = (
        torch.tensor([1.0, 1.3, 0.8]),
        torch.tensor([0.0, 0.5, 1.0]),
        torch.tensor([0.2, 0.0, 0.7]),
    )
    out = apply_penalties_ref(logits, prompt_mask, counts, repetition, presence, frequency)
    expect = logits.clone()
    for b in range(3):
        for v in range(20):
            c = counts[b, v].item()
            if prompt_mask[b, v] or c > 0:
                x = expect[b, v].item()
                expect[b, v] = x / repetition[b] if x > 0 else x * repetition[b]
            expect[b, v] -= frequency[b] * c + presence[b] * (c > 0)
    torch.testing.assert_close(out, expect)


def test_sampling_probs_is_the_softmax_renormalised_over_the_naive_kept_set():
    from pagedserve.kernels.sampling import sampling_probs

    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(len(ROWS) + 1, 64, generator=gen) * 2
    temperature, top_k, top_p, min_p = _params([*ROWS, (0.0, 0, 1.0, 0.0)])  # + one greedy row
    probs = sampling_probs(logits, temperature, top_k, top_p, min_p)
    for b, (t, k, p, m) in enumerate(ROWS):
        kept = sorted(naive_kept(logits[b], t, k, p, m))
        expected = torch.zeros(64, dtype=torch.float64)
        expected[kept] = torch.softmax(logits[b, kept].double() / t, dim=-1)
        assert torch.allclose(probs[b].double(), expected, atol=1e-6), ROWS[b]
    greedy = torch.zeros(64)
    greedy[logits[-1].argmax()] = 1.0
    assert torch.equal(probs[-1], greedy)
