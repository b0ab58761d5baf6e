"""The engine step: every group decides through one interface, sampling rows are drawn in one
sampler call per step, and a beam whose sibling is recomputing waits (rewound by the scheduler)
without changing the search's result."""

from __future__ import annotations

import pytest

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.beam_search import BeamSearchParams
from pagedserve.scheduler import Scheduler

PROMPTS = [[5, 17, 99, 240, 3, 77, 8, 120, 45], [300, 12, 9, 64], [7, 7, 8, 9, 10, 11]]


def test_one_sampler_call_per_step_for_single_forked_and_beam_requests(tiny_checkpoint):
    llm = LLM(model=tiny_checkpoint("llama"), block_size=8, num_gpu_blocks_override=128)
    engine = llm.engine
    calls: list[int] = []
    sampler = engine.sampler

    def counting_sampler(logits, meta):
        calls.append(logits.shape[0])
        return sampler(logits, meta)

    engine.sampler = counting_sampler
    engine.add_request("single", PROMPTS[0], SamplingParams(temperature=0, max_tokens=4))
    engine.add_request("forked", PROMPTS[1], SamplingParams(n=3, seed=1, max_tokens=4))
    beam = SamplingParams(n=2, temperature=0, use_beam_search=True, max_tokens=4)
    engine.add_request("beams", PROMPTS[2], beam)
    steps = 0
    finished = {}
    while engine.has_unfinished_requests():
        before = len(calls)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        assert len(calls) - before <= 1  # never one sampler call per group
    assert set(finished) == {"single", "forked", "beams"}
    # The first step samples "single" once and "forked" three times (its n sequences draw from
    # the one prompt row); beams never go through the sampler.
    assert calls[0] == 4
    assert len(calls) == 4 and steps >= 4
    assert [len(o.token_ids) for o in finished["forked"].outputs] == [4, 4, 4]


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
