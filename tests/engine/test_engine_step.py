"""The engine step: single, forked (n > 1) and beam-search requests share steps without
changing each other's tokens, and a beam whose sibling is recomputing waits (rewound by the
scheduler) without changing the search's result."""

from __future__ import annotations

import pytest

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.beam_search import BeamSearchParams
from pagedserve.scheduler import Scheduler

PROMPTS = [[5, 17, 99, 240, 3, 77, 8, 120, 45], [300, 12, 9, 64], [7, 7, 8, 9, 10, 11]]
PARAMS = {
    "single": SamplingParams(temperature=0, max_tokens=4),
    "forked": SamplingParams(n=3, seed=1, max_tokens=4, logprobs=1),
    "beams": SamplingParams(n=2, temperature=0, use_beam_search=True, max_tokens=4),
}


def _run(engine, names) -> dict:
    for name in names:
        engine.add_request(name, PROMPTS[list(PARAMS).index(name)], PARAMS[name])
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = [(o.token_ids, o.logprobs) for o in out.outputs]
    return finished


def test_single_forked_and_beam_requests_in_one_batch_give_what_each_gives_alone(
    tiny_checkpoint,
):
    engine = LLM(model=tiny_checkpoint("llama"), block_size=8, num_gpu_blocks_override=128).engine
    together = _run(engine, list(PARAMS))
    for name in PARAMS:  # the same tokens; logprobs within what another batch's GEMM changes
        (alone,) = _run(engine, [name]).values()
        assert [tokens for tokens, _ in alone] == [tokens for tokens, _ in together[name]]
        for (_, got), (_, expected) in zip(alone, together[name], strict=True):
            assert (got is None) == (expected is None)
            for row, ref in zip(got or [], expected or [], strict=True):
                assert row.keys() == ref.keys()
                assert list(row.values()) == pytest.approx(list(ref.values()), abs=1e-4)
    assert [len(tokens) for tokens, _ in together["forked"]] == [4, 4, 4]
    assert len({tuple(tokens) for tokens, _ in together["forked"]}) > 1  # three draws, not one
    assert engine.step() == []  # the runner forgets the last finished sequences at a step
    assert not engine.runner.input_batch.states
    kv = engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.slow
def test_beam_search_under_preemption_equals_the_roomy_run(tiny_checkpoint, monkeypatch):
    path = tiny_checkpoint("llama")
    params = BeamSearchParams(beam_width=3, max_tokens=12)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    roomy = LLM(model=path, block_size=8, num_gpu_blocks_override=128)
    expected = roomy.beam_search(prompts, params, use_tqdm=False)

    rewinds: list[tuple[str, int]] = []
    rewind = Scheduler.rewind

    def recording_rewind(self, request_id, num_tokens):
        rewinds.append((request_id, num_tokens))
        return rewind(self, request_id, num_tokens)

    monkeypatch.setattr(Scheduler, "rewind", recording_rewind)
    tight = LLM(model=path, block_size=8, num_gpu_blocks_override=8)
    outputs = tight.beam_search(prompts, params, use_tqdm=False)
    assert tight.engine.scheduler.stats.num_preemptions > 0
    assert rewinds and all(n == 1 for _, n in rewinds)  # some beam waited for a sibling
    for out, ref in zip(outputs, expected, strict=True):
        assert [o.token_ids for o in out.outputs] == [o.token_ids for o in ref.outputs]
        for o, r in zip(out.outputs, ref.outputs, strict=True):
            assert o.cumulative_logprob == pytest.approx(r.cumulative_logprob, abs=1e-5)
    kv = tight.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
