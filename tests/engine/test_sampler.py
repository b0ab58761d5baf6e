"""The sampler against transformers' logits processors and warpers, and against its own rules."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from pagedserve.engine import SamplingParams
from pagedserve.engine.sampler import (
    Sampler,
    SamplingMetadata,
    apply_logit_processors,
    penalise,
)


def meta_for(params, prompts=None, outputs=None, masked=None, seed=0):
    n = len(params)
    return SamplingMetadata(
        params=params,
        generators=[torch.Generator().manual_seed(seed + i) for i in range(n)],
        prompt_token_ids=prompts or [[] for _ in range(n)],
        output_token_ids=outputs or [[] for _ in range(n)],
        masked_token_ids=masked or [frozenset() for _ in range(n)],
    )


def test_top_k_1_equals_greedy_and_temperature_0_is_deterministic():
    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(1))
    greedy = logits.argmax(-1)
    top1 = Sampler()(logits, meta_for([SamplingParams(temperature=1.3, top_k=1)] * 16))
    assert torch.equal(top1.token_ids, greedy)
    for seed in (0, 7):
        zero = Sampler()(logits, meta_for([SamplingParams(temperature=0)] * 16, seed=seed))
        assert torch.equal(zero.token_ids, greedy)


def test_penalties_and_logit_bias_match_transformers_processors():
    vocab = 50
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, vocab, generator=gen) * 3
    prompts = [[1, 2, 3, 3], [4, 5], [7]]
    outputs = [[3, 9, 9, 9], [5, 11], []]
    bias = {2: 1.5, 9: -4.0, 30: 2.25}
    params = [
        SamplingParams(repetition_penalty=1.3, logit_bias=bias),
        SamplingParams(repetition_penalty=0.7),
        SamplingParams(repetition_penalty=2.0, logit_bias={7: 100.0}),
    ]
    meta = meta_for(params, prompts, outputs)
    got = penalise(apply_logit_processors(logits, meta), meta)
    for row, p in enumerate(params):
        input_ids = torch.tensor([prompts[row] + outputs[row]])
        expected = logits[row : row + 1].clone()
        if p.logit_bias:
            sequence_bias = {(t,): b for t, b in p.logit_bias.items()}
            expected = SequenceBiasLogitsProcessor(sequence_bias)(input_ids, expected)
        expected = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(input_ids, expected)
        torch.testing.assert_close(got[row : row + 1], expected, atol=1e-6, rtol=1e-6)


def test_presence_and_frequency_penalties_follow_openai_formula():
    vocab = 20
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(4))
    prompts, outputs = [[1, 2], [3]], [[2, 5, 5, 5], [3, 3, 8]]
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(presence_penalty=-1.0, frequency_penalty=1.5),
    ]
    got = penalise(logits, meta_for(params, prompts, outputs))
    expected = logits.clone()
    for row, p in enumerate(params):  # a naive loop: mu[j] -= count * freq + (count > 0) * pres
        for token in set(outputs[row]):
            count = outputs[row].count(token)
            expected[row, token] -= count * p.frequency_penalty + p.presence_penalty
    torch.testing.assert_close(got, expected)


def test_min_tokens_masks_stop_tokens_like_transformers():
    logits = torch.randn(1, 10)
    meta = meta_for([SamplingParams()], masked=[frozenset({2, 7})])
    got = apply_logit_processors(logits, meta)
    expected = MinNewTokensLengthLogitsProcessor(3, 2, [2, 7])(
        torch.tensor([[4, 4, 4]]), logits.clone()
    )
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    torch.testing.assert_close(got[~torch.isinf(got)], expected[~torch.isinf(expected)])


@pytest.mark.parametrize(
    "params, warper",
    [
        (dict(top_k=3, temperature=0.7), [TopKLogitsWarper(3)]),
        (dict(top_p=0.8), [TopPLogitsWarper(0.8)]),
        (dict(min_p=0.1, temperature=1.5), [MinPLogitsWarper(0.1)]),
        (dict(top_k=5, top_p=0.9, temperature=0.9), [TopKLogitsWarper(5), TopPLogitsWarper(0.9)]),
    ],
    ids=["top_k", "top_p", "min_p", "top_k+top_p"],
)
def test_samples_stay_in_the_allowed_set_with_reference_frequencies(params, warper):
    """20 000 draws on a vocabulary of 8: only tokens transformers' warpers allow appear, and
    each frequency is within 5 standard deviations (sqrt(p(1-p)/N) <= 0.0036) of its probability."""
    draws = 20_000
    logits = torch.tensor([[2.0, 1.6, 1.5, 0.9, 0.4, 0.0, -0.5, -3.0]])
    temperature = params.get("temperature", 1.0)
    reference = TemperatureLogitsWarper(temperature)(None, logits.clone())
    for w in warper:
        reference = w(None, reference)
    probs = torch.softmax(reference, dim=-1)[0]
    sp = SamplingParams(**params)
    generator = torch.Generator().manual_seed(1234)
    meta = SamplingMetadata(
        params=[sp] * draws,
        generators=[generator] * draws,
        prompt_token_ids=[[]] * draws,
        output_token_ids=[[]] * draws,
        masked_token_ids=[frozenset()] * draws,
    )
    tokens = Sampler()(logits.expand(draws, -1).contiguous(), meta).token_ids
    freq = torch.bincount(tokens, minlength=8).float() / draws
    assert set(tokens.unique().tolist()) <= set(torch.nonzero(probs > 0).flatten().tolist())
    sigma = (probs * (1 - probs) / draws).sqrt()
    assert torch.all((freq - probs).abs() <= 5 * sigma + 1e-9), (freq, probs)


def test_a_row_draws_only_from_its_own_generator():
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(temperature=1.0, seed=11)] + [SamplingParams(temperature=0.9)] * 5
    alone = Sampler()(logits[:1], meta_for(params[:1], seed=42)).token_ids
    batch_meta = meta_for(params, seed=100)
    batch_meta.generators[0] = torch.Generator().manual_seed(42)
    in_batch = Sampler()(logits, batch_meta).token_ids
    assert in_batch[0] == alone[0]


def test_logprobs_are_raw_log_softmax_with_the_sampled_token():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(6))
    params = [
        SamplingParams(temperature=0, logprobs=2),
        SamplingParams(temperature=1.0, logprobs=0, repetition_penalty=1.5),
        SamplingParams(temperature=0.5),
    ]
    out = Sampler()(logits, meta_for(params, outputs=[[1], [1, 2], []]))
    reference = torch.log_softmax(logits, dim=-1)
    for row, p in enumerate(params[:2]):
        got = out.row_logprobs(row, p.logprobs)
        top = reference[row].topk(p.logprobs)
        token = int(out.token_ids[row])
        assert list(got)[: p.logprobs] == top.indices.tolist()
        assert token in got
        for t, value in got.items():
            assert value == pytest.approx(float(reference[row, t]), abs=1e-6)


def test_any_integer_seed_gives_a_generator(tiny_checkpoint):
    """Seeds outside torch's range (negative, or past 2**64 with the n > 1 offsets) still work."""
    from pagedserve.engine import LLM

    llm = LLM(model=tiny_checkpoint("llama"), block_size=8, num_gpu_blocks_override=32)
    for seed in (-5, 2**64 - 1, 2**70):
        params = SamplingParams(n=2, temperature=1.0, seed=seed, max_tokens=2)
        out = llm.generate([{"prompt_token_ids": [4, 5, 6]}], params, use_tqdm=False)[0]
        assert all(len(o.token_ids) >= 1 for o in out.outputs)
