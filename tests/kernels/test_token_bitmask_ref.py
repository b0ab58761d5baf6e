"""apply_token_bitmask_ref against a per-token reading of the bit layout (bit t % 32 of word
t // 32 = token t allowed)."""

import pytest
import torch

from pagedserve.kernels.token_bitmask import apply_token_bitmask, apply_token_bitmask_ref


def _naive(logits, bitmask, rows):
    out = logits.clone()
    for row in rows:
        for token in range(logits.shape[1]):
            word = token // 32
            allowed = word < bitmask.shape[1] and (int(bitmask[row, word]) >> (token % 32)) & 1
            if not allowed:
                out[row, token] = float("-inf")
    return out


@pytest.mark.parametrize("vocab", [31, 32, 33, 70])
@pytest.mark.parametrize("indices", [None, [2, 0]])
def test_reference_matches_the_bit_layout(vocab, indices):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(3, vocab, generator=gen)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=gen).to(torch.int32)
    rows = range(3) if indices is None else indices
    expected = _naive(logits, bitmask, rows)
    index = None if indices is None else torch.tensor(indices)
    apply_token_bitmask_ref(logits, bitmask, index)
    assert torch.equal(logits, expected)


def test_tokens_past_the_bitmask_are_forbidden_and_dispatch_masks_in_place():
    logits = torch.zeros(1, 40)
    bitmask = torch.tensor([[-1]], dtype=torch.int32)  # 32 tokens covered, 8 padded ones not
    apply_token_bitmask(logits, bitmask)
    assert torch.isfinite(logits[0, :32]).all() and torch.isinf(logits[0, 32:]).all()


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask_ref(torch.zeros(1, 8), torch.zeros(1, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="rows"):
        apply_token_bitmask_ref(torch.zeros(2, 8), torch.zeros(1, 1, dtype=torch.int32))
