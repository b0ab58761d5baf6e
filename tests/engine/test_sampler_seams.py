"""The sampler's seams for later features, and its host fast paths, against naive references.

Structured outputs hand the sampler a per-row token mask; speculative decoding asks it to score
k proposed tokens per row; the engine hands it the sampled rows of the step's logits.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine import SamplingParams
from pagedserve.engine.sampler import (
    Sampler,
    SamplingMetadata,
    score_proposed_tokens,
    select_rows,
    unpack_token_bitmask,
)


def meta_for(params, mask=None, outputs=None, seed=0):
    n = len(params)
    return SamplingMetadata(
        params=params,
        generators=[torch.Generator().manual_seed(seed + i) for i in range(n)],
        prompt_token_ids=[[1, 2, 3] for _ in range(n)],
        output_token_ids=outputs or [[] for _ in range(n)],
        masked_token_ids=[frozenset() for _ in range(n)],
        allowed_token_mask=mask,
    )


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


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, repetition_penalty=1.3, logprobs=3),
        SamplingParams(temperature=0.7, top_k=5, logit_bias={7: 100.0}),
    ],
)
def test_masked_tokens_are_never_picked_and_the_mask_comes_first(params, packed):
    rows, vocab = 8, 70
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(3))
    mask = random_mask(rows, vocab, seed=4)
    given = pack(mask) if packed else mask
    for step in range(20):
        out = Sampler()(logits, meta_for([params] * rows, given, seed=step))
        assert mask[torch.arange(rows), out.token_ids].all()
    # greedy under the mask is the argmax over the allowed tokens alone, even where logit_bias
    # pushes a forbidden token to the top (the mask is applied before the bias)
    if params.is_greedy:
        expected = torch.where(mask, logits, float("-inf")).argmax(-1)
        assert torch.equal(out.token_ids, expected)
    if params.logprobs is not None:  # logprobs stay those of the raw distribution
        raw = torch.log_softmax(logits, -1)
        assert torch.allclose(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))


def test_unpacking_the_bitmask_is_the_inverse_of_packing():
    mask = random_mask(3, 100, seed=8)
    assert torch.equal(unpack_token_bitmask(pack(mask), 100), mask)


def test_a_mask_of_the_wrong_shape_is_refused():
    with pytest.raises(ValueError, match="allowed_token_mask"):
        Sampler()(
            torch.zeros(2, 10), meta_for([SamplingParams()] * 2, torch.ones(2, 9, dtype=bool))
        )


def test_proposed_tokens_are_scored_as_a_per_position_softmax():
    rows, k, vocab = 4, 3, 50
    logits = torch.randn(rows * (k + 1), vocab, generator=torch.Generator().manual_seed(9))
    proposed = torch.randint(vocab, (rows, k), generator=torch.Generator().manual_seed(10))
    proposed[0, 1] = logits[1].argmax()  # a greedy row's proposal that the target agrees with
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=2.0),
    ]
    scores = score_proposed_tokens(logits, proposed, params)
    assert scores.probs.shape == scores.logprobs.shape == (rows, k)
    for r, p in enumerate(params):
        for j in range(k):
            position = logits[r * (k + 1) + j]
            token = int(proposed[r, j])
            raw = torch.log_softmax(position, -1)[token]
            assert scores.logprobs[r, j] == pytest.approx(float(raw), abs=1e-6)
            if p.is_greedy:
                expected = 1.0 if token == int(position.argmax()) else 0.0
            else:
                expected = float(torch.softmax(position / p.temperature, -1)[token])
            assert scores.probs[r, j] == pytest.approx(expected, abs=1e-6)
        assert torch.equal(scores.bonus_logits[r], logits[r * (k + 1) + k])
    assert scores.probs[0, 1] == 1.0


def test_selecting_every_row_in_order_copies_nothing():
    logits = torch.randn(6, 20)
    view = select_rows(logits, [0, 1, 2, 3])
    assert view.data_ptr() == logits.data_ptr() and torch.equal(view, logits[:4])
    gathered = select_rows(logits, [0, 2, 2, 5])
    assert gathered.data_ptr() != logits.data_ptr()
    assert torch.equal(gathered, logits[torch.tensor([0, 2, 2, 5])])
    assert select_rows(logits, []).shape == (0, 20)


def test_the_sampler_leaves_its_input_logits_untouched():
    """The engine hands it a view of the step's logits, which beam groups read afterwards."""
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(2))
    before = logits.clone()
    params = [
        SamplingParams(temperature=0.0, logit_bias={3: 5.0}),
        SamplingParams(temperature=1.0, repetition_penalty=2.0, presence_penalty=0.5),
        SamplingParams(temperature=0.8, min_tokens=2, stop_token_ids=[4]),
        SamplingParams(temperature=0.0),
    ]
    meta = meta_for(params, random_mask(4, 30, seed=1), outputs=[[1], [2, 2], [], [3]])
    meta.masked_token_ids[2] = frozenset({4})
    Sampler()(logits, meta)
    assert torch.equal(logits, before)
