"""Micro-batches: a pipeline of P stages keeps up to P steps in flight (the engine's
``max_steps_in_flight``), so that stage 0 computes step N+1 while rank 0 finishes step N.

Every check runs the same requests through one process and through two stages (gloo on
CPU) and wants the same tokens: seeded sampling with logprobs, n > 1, a grammar and beam
search beside greedy requests; a request aborted while its step is in flight (its result
dropped, every block back); and one step at a time (``max_steps_in_flight = 1``, what a
speculator needs) gives the same tokens too.
"""

from __future__ import annotations

import pytest

from pagedserve.engine import LLM, SamplingParams

PROMPTS = [list(range(5, 22)), [100, 200, 300], list(range(30, 70)), [7], list(range(40, 52))]
ENGINE_ARGS = dict(block_size=8, max_num_batched_tokens=24, num_gpu_blocks_override=48)


def mixed_params() -> list[SamplingParams]:
    """One request of each kind the engine samples differently."""
    return [
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
        SamplingParams(
            temperature=0.9, top_p=0.9, seed=3, max_tokens=10, logprobs=2, ignore_eos=True
        ),
        SamplingParams(temperature=0.8, n=2, seed=5, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=6, structured_outputs={"regex": "[0-9]{4}"}),
        SamplingParams(n=2, use_beam_search=True, temperature=0, max_tokens=6, ignore_eos=True),
    ]


def run(engine, prompts, params, abort: str | None = None, after: int = 3):
    """Drive the engine step by step; ``abort`` that request once it is in a step in flight
    (after ``after`` steps). Returns each request's outputs' tokens and logprobs, and the most
    steps left in flight between two calls of ``step`` (one: the steps overlapped)."""
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, p)
    finals, most_in_flight, steps = {}, 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        steps += 1
        most_in_flight = max(most_in_flight, len(engine.scheduler.steps_in_flight))
        if abort is not None and steps >= after and in_flight(engine, abort):
            engine.abort_request(abort)
            abort = None
    assert abort is None, "the request to abort was never seen in flight"
    results = {
        rid: [(list(o.token_ids), _logprobs(o)) for o in out.outputs]
        for rid, out in finals.items()
        if out.outputs[0].finish_reason != "abort"
    }
    return results, most_in_flight


def in_flight(engine, request_id: str) -> bool:
    steps = engine.scheduler.steps_in_flight.request_ids() or frozenset()
    return any(
        id(r) in steps for r in engine.scheduler.requests.values() if r.request_id == request_id
    )


def _logprobs(completion):
    if completion.logprobs is None:
        return None
    return [{t: lp.logprob for t, lp in entry.items()} for entry in completion.logprobs]


def assert_same(got, expected):
    """The same requests, tokens and logprobs' tokens; logprobs equal to fp32 rounding (the
    steps hold other rows when steps overlap)."""
    assert got.keys() == expected.keys()
    for rid, outputs in expected.items():
        assert [t for t, _ in got[rid]] == [t for t, _ in outputs], rid
        for (_, lps), (_, want) in zip(got[rid], outputs, strict=True):
            if want is None:
                assert lps is None
                continue
            assert [e.keys() for e in lps] == [e.keys() for e in want], rid
            for entry, wanted in zip(lps, want, strict=True):
                assert entry == pytest.approx(wanted, abs=1e-4), rid


@pytest.mark.slow
def test_two_steps_in_flight_equal_one_process(tiny_checkpoint, one_thread):
    path = tiny_checkpoint("llama")
    single = LLM(model=path, **ENGINE_ARGS).engine
    expected, most = run(single, PROMPTS, mixed_params())
    assert most == 0 and len(expected) == len(PROMPTS)
    staged = LLM(model=path, pipeline_parallel_size=2, **ENGINE_ARGS)
    engine = staged.engine
    try:
        assert engine.max_steps_in_flight == 2
        got, most = run(engine, PROMPTS, mixed_params())
        assert most == 1  # stage 0 had the next step while rank 0 finished the last
        assert_same(got, expected)
        # an abort while the request's step is in flight: the others are as before
        got, _ = run(engine, PROMPTS, mixed_params(), abort="2")
        assert_same(got, {k: v for k, v in expected.items() if k != "2"})
        free, total = engine.kv_cache_manager.num_free_blocks, engine.runner.num_blocks
        assert free == total  # nothing leaked, the aborted request's blocks included
        engine.max_steps_in_flight = 1  # one step at a time: the same tokens, nothing overlaps
        got, most = run(engine, PROMPTS, mixed_params())
        assert_same(got, expected)
        assert most == 0
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_a_speculator_runs_one_step_at_a_time(tiny_checkpoint, one_thread):
    """An ngram speculator proposes for every running request after each step, from its
    newest token: the pipeline keeps one step in flight with it, and the tokens stay those of
    one process."""
    path = tiny_checkpoint("llama")
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    greedy = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * len(PROMPTS)
    expected, _ = run(
        LLM(model=path, speculative_config=ngram, **ENGINE_ARGS).engine, PROMPTS, greedy
    )
    staged = LLM(model=path, pipeline_parallel_size=2, speculative_config=ngram, **ENGINE_ARGS)
    try:
        assert staged.engine.max_steps_in_flight == 1
        got, most = run(staged.engine, PROMPTS, greedy)
        assert got == expected and most == 0
    finally:
        staged.engine.shutdown()
