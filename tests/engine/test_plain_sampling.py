"""The plain sampling path (decisions.py ``PlainRequests``) gives exactly what the general path
gives: the same tokens, the same generator draws, in all-plain steps and in steps that mix
plain rows with rows that need penalties, logprobs, top-k, forks or min_tokens."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.decisions import is_plain_sampling
from pagedserve.engine.sampler import PlainSamplingMetadata, Sampler, SamplingMetadata

VOCAB = 96


def _general_metadata(params, generators):
    n = len(params)
    return SamplingMetadata(
        params=params,
        generators=generators,
        prompt_token_ids=[[1, 2, 3]] * n,
        output_token_ids=[[4, 5]] * n,
        masked_token_ids=[frozenset()] * n,
    )


def _generators(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plain_pass_equals_the_general_path_row_for_row(seed):
    rng = random.Random(seed)
    logits = torch.randn(10, VOCAB, generator=torch.Generator().manual_seed(seed))
    temps = [rng.choice([0.0, 0.5, 1.0, 1.7]) for _ in range(10)]
    seeds = [rng.randrange(2**31) for _ in range(10)]
    plain_gens, general_gens = _generators(seeds), _generators(seeds)
    plain = Sampler()(logits, PlainSamplingMetadata(temps, plain_gens)).token_ids
    params = [SamplingParams(temperature=t) for t in temps]
    general = Sampler()(logits, _general_metadata(params, general_gens)).token_ids
    assert plain.tolist() == general.tolist()
    for a, b in zip(plain_gens, general_gens):  # the same draws: the generators moved alike
        assert torch.equal(a.get_state(), b.get_state())
    greedy = Sampler()(logits, PlainSamplingMetadata()).token_ids
    assert greedy.tolist() == logits.argmax(dim=-1).tolist()


def test_a_mixed_call_draws_the_general_rows_as_the_general_path_alone():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(7))
    general_rows = [1, 4]
    general_params = [
        SamplingParams(temperature=0.8, top_k=5, logprobs=2),
        SamplingParams(temperature=0.0, repetition_penalty=1.5, logprobs=1),
    ]
    temps = [0.9, 0.0, 0.0, 1.2, 0.0, 0.0]  # rows 1 and 4 (general) are greedy in the plain pass
    gens = _generators(range(6))
    meta = PlainSamplingMetadata(temps, [g if r not in general_rows else None for r, g in
                                         enumerate(gens)])  # fmt: skip
    meta.general_rows = general_rows
    meta.general = _general_metadata(general_params, [gens[1], gens[4]])
    mixed = Sampler()(logits, meta)

    alone_gens = _generators(range(6))
    alone = Sampler()(
        logits[general_rows], _general_metadata(general_params, [alone_gens[1], alone_gens[4]])
    )
    assert mixed.token_ids.tolist() == alone.token_ids.tolist()
    assert mixed.row_logprobs(0, 2) == alone.row_logprobs(0, 2)
    plain_alone = Sampler()(logits, PlainSamplingMetadata(temps, _generators(range(6))))
    assert mixed.plain_token_ids.tolist() == plain_alone.token_ids.tolist()


def test_only_requests_with_nothing_but_a_temperature_are_plain():
    assert is_plain_sampling(SamplingParams(temperature=0.0))
    assert is_plain_sampling(SamplingParams(temperature=0.7, seed=3, stop=["x"], max_tokens=9))
    for field, value in [
        ("n", 2), ("logprobs", 0), ("min_tokens", 2), ("logit_bias", {3: 1.0}),
        ("repetition_penalty", 1.1), ("presence_penalty", 0.5), ("frequency_penalty", 0.5),
        ("top_k", 4), ("top_p", 0.9), ("min_p", 0.1),
    ]:  # fmt: skip
        assert not is_plain_sampling(SamplingParams(**{field: value})), field


def _random_requests(rng: random.Random, num: int, plain_share: float):
    """(prompt, params) pairs: plain greedy/temperature rows with per-request seeds (or none:
    the engine draws one), and, for ``1 - plain_share`` of them, a knob the plain path lacks."""
    knobs = [
        dict(logprobs=2), dict(repetition_penalty=1.3), dict(top_k=7), dict(n=2),
        dict(min_tokens=3), dict(top_p=0.8, logprobs=1), dict(frequency_penalty=0.4),
    ]  # fmt: skip
    requests = []
    for _ in range(num):
        prompt = [rng.randrange(3, 250) for _ in range(rng.randint(2, 20))]
        kwargs = dict(
            temperature=rng.choice([0.0, 0.0, 0.6, 1.0]),
            seed=rng.choice([None, rng.randrange(1000)]),
            max_tokens=rng.randint(1, 9),
        )
        if rng.random() >= plain_share:
            kwargs.update(rng.choice(knobs))
        requests.append((prompt, SamplingParams(**kwargs)))
    return requests


def _run(path: str, requests, plain_path: bool, added_per_step: int):
    """Every request's outputs, requests added a few per step (steps then mix prefills,
    decodes, plain and general rows in varying shares)."""
    llm = LLM(
        model=path, block_size=8, num_gpu_blocks_override=256, max_num_batched_tokens=48, seed=5
    )
    engine = llm.engine
    engine.plain_requests.enabled = plain_path
    plain_calls = []
    sample_plain = engine.sampler.sample_plain

    def counting(logits, meta):
        plain_calls.append(meta.general is not None)
        return sample_plain(logits, meta)

    engine.sampler.sample_plain = counting
    pending, results = list(enumerate(requests)), {}
    while pending or engine.has_unfinished_requests():
        for i, (prompt, params) in pending[:added_per_step]:
            engine.add_request(f"r{i}", prompt, params)
        pending = pending[added_per_step:]
        for out in engine.step():
            if out.finished:
                assert out.metrics.first_scheduled_time is not None
                results[out.request_id] = [
                    (o.token_ids, o.logprobs, o.finish_reason) for o in out.outputs
                ]
    return results, plain_calls


@pytest.mark.parametrize("seed, plain_share", [(0, 1.0), (1, 0.8), (2, 0.4)])
def test_the_engine_gives_the_same_tokens_with_the_plain_path_forced_off(
    tiny_checkpoint, seed, plain_share
):
    path = tiny_checkpoint("llama")
    requests = _random_requests(random.Random(seed), 14, plain_share)
    on, calls_on = _run(path, requests, plain_path=True, added_per_step=3)
    off, calls_off = _run(path, requests, plain_path=False, added_per_step=3)
    assert on == off
    assert len(on) == len(requests)
    assert calls_on and not calls_off  # the plain path ran, and only when it was on
    if plain_share < 1.0:
        assert any(calls_on)  # some step drew plain and general rows in one call


def test_a_reused_request_id_is_planned_afresh(tiny_checkpoint):
    llm = LLM(model=tiny_checkpoint("llama"), block_size=8, num_gpu_blocks_override=64)
    engine = llm.engine
    outputs = {}
    for params in (SamplingParams(temperature=0, max_tokens=2),
                   SamplingParams(temperature=0, max_tokens=2, logprobs=1)):  # fmt: skip
        engine.add_request("same", [5, 6, 7], params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs[params.logprobs] = out.outputs[0]
    assert outputs[None].logprobs is None
    assert outputs[1].token_ids == outputs[None].token_ids
    assert len(outputs[1].logprobs) == 2  # the second, non-plain, request got its logprobs
    assert "same" not in engine.plain_requests.states
