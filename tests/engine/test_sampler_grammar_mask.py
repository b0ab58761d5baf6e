"""The sampler's structured-output mask: each constrained row's grammar matcher fills its row
of one packed bitmask (xgrammar's layout), applied before every other processor; a stand-in
matcher holds a random allowed set, checked against a mask packed the slow way."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine import SamplingParams
from pagedserve.engine.input_batch import SamplingState
from pagedserve.engine.sampler import Sampler, SamplingMetadata
from pagedserve.kernels.token_bitmask import unpack_token_bitmask
from pagedserve.scheduler import Request


class FixedMatcher:
    """A grammar matcher whose allowed set never changes (its row of ``mask``)."""

    def __init__(self, packed_row: torch.Tensor) -> None:
        self.packed_row = packed_row

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = self.packed_row


def meta_for(params, mask: torch.Tensor | None, seed=0):
    """One state per row; row r constrained by ``mask[r]`` (None: unconstrained)."""
    packed = None if mask is None else pack(mask)
    states = []
    for r in range(len(params)):
        request = Request("r", [1, 2, 3], max_tokens=8)
        generator = torch.Generator().manual_seed(seed + r)
        matcher = None if packed is None else FixedMatcher(packed[r])
        states.append(SamplingState(request, params[r], generator, grammar_matcher=matcher))
    return SamplingMetadata(states)


def random_mask(rows: int, vocab: int, seed: int) -> torch.Tensor:
    mask = torch.rand(rows, vocab, generator=torch.Generator().manual_seed(seed)) < 0.2
    mask[:, 0] = True  # never empty
    return mask


def pack(mask: torch.Tensor) -> torch.Tensor:
    """The xgrammar layout, written the slow way: bit t % 32 of int32 word t // 32."""
    rows, vocab = mask.shape
    words = torch.zeros(rows, -(-vocab // 32), dtype=torch.int64)
    for r in range(rows):
        for t in range(vocab):
            if mask[r, t]:
                words[r, t // 32] |= 1 << (t % 32)
    words[words >= 2**31] -= 2**32  # as int32 holds them
    return words.to(torch.int32)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, structured_outputs={"regex": "a"}),
        SamplingParams(
            temperature=1.0, repetition_penalty=1.3, logprobs=3, structured_outputs={"regex": "a"}
        ),
        SamplingParams(
            temperature=0.7, top_k=5, logit_bias={7: 100.0}, structured_outputs={"regex": "a"}
        ),
    ],
)
def test_masked_tokens_are_never_picked_and_the_mask_comes_first(params):
    rows, vocab = 8, 70
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(3))
    mask = random_mask(rows, vocab, seed=4)
    for step in range(20):
        out = Sampler()(logits.clone(), meta_for([params] * rows, mask, seed=step))
        assert mask[torch.arange(rows), out.token_ids].all()
    # greedy under the mask is the argmax over the allowed tokens alone, even where logit_bias
    # pushes a forbidden token to the top (the mask is applied before the bias)
    if params.is_greedy:
        expected = torch.where(mask, logits, float("-inf")).argmax(-1)
        assert torch.equal(out.token_ids, expected)
    if params.logprobs is not None:  # logprobs stay those of the raw distribution
        raw = torch.log_softmax(logits, -1)
        for row in range(rows):
            token = int(out.token_ids[row])
            assert out.logprobs[row][token] == pytest.approx(float(raw[row, token]), abs=1e-6)


def test_only_constrained_rows_are_masked():
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(5))
    mask = random_mask(4, 40, seed=6)
    meta = meta_for([SamplingParams(temperature=0.0, structured_outputs={"regex": "a"})] * 4, mask)
    meta.states[1].grammar_matcher = None  # row 1's grammar has not compiled: it is free
    got = Sampler()(logits.clone(), meta).token_ids
    assert got[1] == logits[1].argmax()
    for row in (0, 2, 3):
        assert got[row] == torch.where(mask[row], logits[row], float("-inf")).argmax()


def test_unpacking_the_bitmask_is_the_inverse_of_packing():
    mask = random_mask(3, 100, seed=8)
    assert torch.equal(unpack_token_bitmask(pack(mask), 100), mask)
