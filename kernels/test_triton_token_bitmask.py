"""apply_token_bitmask: the Triton kernel (or the implementation given with --impl) against the
reference, exactly (it only writes -inf where a bit is clear)."""

import pytest
import torch
from contracts import implementation
from suite_grid import DEVICE, pick

from pagedserve.kernels.token_bitmask import apply_token_bitmask_ref

VOCABS = pick([100, 4097, 49152], [32000, 49152, 128256, 151936])


def _inputs(vocab: int, rows: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, words), generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    bitmask[0] = -1  # an unconstrained row: all allowed
    bitmask[-1, : words // 2] = 0  # a row whose first half is forbidden
    return logits.to(DEVICE), bitmask.to(DEVICE)


@pytest.mark.contract("apply_token_bitmask")
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("with_indices", [False, True])
def test_apply_token_bitmask_equals_reference(vocab, with_indices):
    logits, bitmask = _inputs(vocab, rows=5, seed=vocab)
    indices = torch.tensor([4, 1, 2], device=DEVICE) if with_indices else None
    expected = logits.clone()
    apply_token_bitmask_ref(expected, bitmask, indices)
    implementation("apply_token_bitmask")(logits, bitmask, indices)
    assert torch.equal(logits.cpu(), expected.cpu())
    assert torch.isinf(expected).any() and torch.isfinite(expected[0]).all()


@pytest.mark.contract("apply_token_bitmask")
def test_apply_token_bitmask_on_a_row_view_of_wider_logits():
    """The sampler masks a view of the runner's logits (its first rows): strides are honoured
    and the rows not asked for are left alone."""
    logits, bitmask = _inputs(300, rows=4, seed=3)
    wide = torch.randn(6, 300, device=DEVICE)
    wide[:4] = logits
    expected = wide.clone()
    apply_token_bitmask_ref(expected[:4], bitmask)
    implementation("apply_token_bitmask")(wide[:4], bitmask)
    assert torch.equal(wide.cpu(), expected.cpu())
