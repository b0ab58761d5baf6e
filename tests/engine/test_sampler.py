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
from pagedserve.engine.input_batch import SamplingState
from pagedserve.engine.sampler import Sampler, SamplingMetadata
from pagedserve.scheduler import Request


def state_for(params, prompt=(), output=(), stop_token_ids=(), seed=0, generator=None):
    request = Request(
        "r",
        list(prompt),
        max_tokens=64,
        min_tokens=params.min_tokens,
        stop_token_ids=frozenset(stop_token_ids),
    )
    request.output_token_ids = list(output)
    return SamplingState(request, params, generator or torch.Generator().manual_seed(seed))


def meta_for(params, prompts=None, outputs=None, seed=0):
    n = len(params)
    prompts, outputs = prompts or [[] for _ in range(n)], outputs or [[] for _ in range(n)]
    return SamplingMetadata(
        [state_for(p, prompts[i], outputs[i], seed=seed + i) for i, p in enumerate(params)]
    )


def processed(logits, meta):
    """The logits after the sampler's processors (on a copy: they work in place)."""
    logits = logits.clone()
    Sampler.process(logits, meta)
    return logits


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
    got = processed(logits, meta_for(params, prompts, outputs))
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
    got = processed(logits, meta_for(params, prompts, outputs))
    expected = logits.clone()
    for row, p in enumerate(params):  # a naive loop: mu[j] -= count * freq + (count > 0) * pres
        for token in set(outputs[row]):
            count = outputs[row].count(token)
            expected[row, token] -= count * p.frequency_penalty + p.presence_penalty
    torch.testing.assert_close(got, expected)


def test_min_tokens_masks_stop_tokens_like_transformers():
    logits = torch.randn(1, 10)
    meta = SamplingMetadata([state_for(SamplingParams(min_tokens=2), stop_token_ids={2, 7})])
    got = processed(logits, meta)
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
    meta = SamplingMetadata([state_for(sp, generator=torch.Generator().manual_seed(1234))] * draws)
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
    in_batch = Sampler()(logits.clone(), batch_meta).token_ids
    assert in_batch[0] == alone[0]


def test_logprobs_are_raw_log_softmax_with_the_sampled_token():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(6))
    params = [
        SamplingParams(temperature=0, logprobs=2),
        SamplingParams(temperature=1.0, logprobs=0, repetition_penalty=1.5),
        SamplingParams(temperature=0.5),
    ]
    out = Sampler()(logits.clone(), meta_for(params, outputs=[[1], [1, 2], []]))
    reference = torch.log_softmax(logits, dim=-1)
    assert set(out.logprobs) == {0, 1}
    for row, p in enumerate(params[:2]):
        got = out.logprobs[row]
        top = reference[row].topk(p.logprobs)
        token = int(out.token_ids[row])
        assert list(got)[: p.logprobs] == top.indices.tolist()
        assert token in got
        for t, value in got.items():
            assert value == pytest.approx(float(reference[row, t]), abs=1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_each_row_draws_what_it_draws_alone(seed):
    """Rows of every kind in one call (greedy, seeded temperature, top-k/top-p/min-p, penalties,
    bias, min_tokens, logprobs) draw exactly what each draws alone: the processors change only
    their own rows, in place, and each draw reads only its own row and generator."""
    rng = torch.Generator().manual_seed(seed)
    knobs = [
        dict(temperature=0),
        dict(temperature=0.8),
        dict(temperature=1.2, top_k=5),
        dict(temperature=0.9, top_p=0.7, min_p=0.05),
        dict(temperature=0, repetition_penalty=1.4, presence_penalty=0.5),
        dict(temperature=0.7, logit_bias={3: 5.0, 9: -100.0}),
        dict(temperature=0, min_tokens=4, logprobs=3),
        dict(temperature=1.0, frequency_penalty=1.0, logprobs=0),
    ]
    order = torch.randperm(len(knobs), generator=rng).tolist() * 2
    params = [SamplingParams(**knobs[i]) for i in order]
    logits = torch.randn(len(params), 64, generator=rng) * 3
    outputs = [torch.randint(64, (i % 5,), generator=rng).tolist() for i in range(len(params))]

    def states(rows):
        return [
            state_for(params[r], [1, 2, 3], outputs[r], stop_token_ids={3, 4}, seed=100 + r)
            for r in rows
        ]

    batch = Sampler()(logits.clone(), SamplingMetadata(states(range(len(params)))))
    for row in range(len(params)):
        alone = Sampler()(logits[row : row + 1].clone(), SamplingMetadata(states([row])))
        assert batch.token_ids[row] == alone.token_ids[0]
        assert batch.logprobs.get(row) == alone.logprobs.get(0)
    early = [r for r, p in enumerate(params) if len(outputs[r]) < p.min_tokens]
    assert early and all(batch.token_ids[r] not in (3, 4) for r in early)


def test_any_integer_seed_gives_a_generator(tiny_checkpoint):
    """Seeds outside torch's range (negative, or past 2**63 with the n > 1 offsets) still work;
    SamplingParams takes vLLM's signed 64-bit range."""
    from pagedserve.engine import LLM

    llm = LLM(model=tiny_checkpoint("llama"), block_size=8, num_gpu_blocks_override=32)
    for seed in (-5, 2**63 - 1, -(2**63)):
        params = SamplingParams(n=2, temperature=1.0, seed=seed, max_tokens=2)
        out = llm.generate([{"prompt_token_ids": [4, 5, 6]}], params, use_tqdm=False)[0]
        assert all(len(o.token_ids) >= 1 for o in out.outputs)


def test_allowed_token_ids_keep_every_draw_inside_the_set():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(7))
    allowed = [3, 17, 29, 41]
    meta = meta_for([SamplingParams(temperature=1.5, allowed_token_ids=allowed)] * 64)
    assert set(Sampler()(logits.clone(), meta).token_ids.tolist()) <= set(allowed)
    greedy = meta_for([SamplingParams(temperature=0, allowed_token_ids=allowed)])
    expected = allowed[int(logits[0, allowed].argmax())]
    assert Sampler()(logits[:1].clone(), greedy).token_ids.tolist() == [expected]


def test_a_bad_words_last_token_is_masked_once_the_tokens_before_it_are_out():
    """One-token bad words always; a two-token one only right after its first token."""
    logits = torch.zeros(1, 10)
    logits[0, 4], logits[0, 6] = 5.0, 4.0  # 4 then 6 are the greedy picks
    params = SamplingParams(temperature=0)

    def draw(history):
        request = Request("r", [1], max_tokens=8)
        request.output_token_ids = history
        state = SamplingState(request, params, torch.Generator(), bad_words_token_ids=[[4], [2, 6]])
        return Sampler()(logits.clone(), SamplingMetadata([state])).token_ids.item()

    assert draw([]) == 6  # 4 is a bad word of its own
    assert draw([2]) != 6 and draw([2]) != 4  # after 2, "2 6" would complete a bad word
    assert draw([3, 2, 5]) == 6


def test_bad_words_are_tokenized_at_the_start_of_a_text_and_after_a_space(tiny_checkpoint):
    from pagedserve.engine.logits_processors import bad_words_token_ids
    from pagedserve.models import load_tokenizer

    tokenizer = load_tokenizer(tiny_checkpoint("llama"))
    got = bad_words_token_ids(["hello world", " hello world"], tokenizer)
    first = tokenizer.encode("hello world", add_special_tokens=False)
    spaced = tokenizer.encode(" hello world", add_special_tokens=False)
    assert got == [first, spaced] or (first == spaced and got == [first])


def test_the_thinking_budget_forces_the_end_tokens_in_order():
    from pagedserve.engine.logits_processors import thinking_end_forced

    start, end = [90], [91, 92]
    assert thinking_end_forced([5, 6, 7], 2, start, end) is None  # no thinking opened
    assert thinking_end_forced([5, 90, 1], 2, start, end) is None  # one token thought
    assert thinking_end_forced([5, 90, 1, 2], 2, start, end) == 91  # the budget is spent
    assert thinking_end_forced([5, 90, 1, 2, 91], 2, start, end) == 92
    assert thinking_end_forced([5, 90, 1, 2, 91, 92], 2, start, end) is None  # closed
    assert thinking_end_forced([90, 1, 91, 92, 90, 3, 4], 2, start, end) == 91  # reopened
