"""The one-pass processing of an all-plain step (output_processor.py) gives exactly what the
general path gives (``LLMEngine.output_fast_path = False``): a random mix of requests, mostly
plain and of every output kind, stepped both ways on a clock that moves once per step, makes
the same outputs (metrics included) step for step and the same stats. FINAL_ONLY requests make
no output until they finish."""

from __future__ import annotations

import dataclasses
import random
import types

import pytest

import pagedserve.engine.llm_engine as llm_engine_module
from pagedserve.engine import LLM, RequestOutputKind, SamplingParams
from pagedserve.engine.group_outputs import GroupOutputs
from pagedserve.engine.sequence_group import SequenceState


def random_params(rng: random.Random) -> SamplingParams:
    """Mostly plain requests (one greedy or seeded-temperature sequence); some with stop
    strings or prompt logprobs (plain sampling, not plain decodes) or logprobs and n = 2
    (general rows, so some steps mix both paths)."""
    general = rng.random() < 0.15
    return SamplingParams(
        n=2 if general and rng.random() < 0.5 else 1,
        temperature=rng.choice([0.0, 0.8]),
        seed=rng.randrange(100),
        max_tokens=rng.randrange(1, 14),
        stop=rng.choice([None, None, None, ["e"], ["a", "th"]]),
        logprobs=1 if general else None,
        prompt_logprobs=rng.choice([None] * 6 + [1]),
        ignore_eos=rng.choice([True, False]),
        output_kind=rng.choice(list(RequestOutputKind)),
    )


def run(tiny_checkpoint, fast: bool, monkeypatch, seed: int) -> tuple[list, object]:
    engine = LLM(model=tiny_checkpoint("llama"), block_size=8, num_gpu_blocks_override=256).engine
    engine.output_fast_path = fast
    clock = [1000.0]  # every timestamp taken in a step is the step's time
    monkeypatch.setattr(
        llm_engine_module, "time", types.SimpleNamespace(monotonic=lambda: clock[0])
    )
    rng = random.Random(seed)
    pending = [
        ([rng.randrange(1, 500) for _ in range(rng.randrange(2, 12))], random_params(rng))
        for _ in range(16)
    ]
    steps, index = [], 0
    while pending or engine.has_unfinished_requests():
        clock[0] += rng.choice([0.25, 0.5, 1.0])
        for _ in range(rng.randrange(0, 3)):  # requests join as others decode
            if pending:
                prompt, params = pending.pop()
                engine.add_request(f"q{index}", prompt, params)
                index += 1
        if index > 3 and rng.random() < 0.05 and engine.groups:  # an abort now and then
            steps.append([comparable(o) for o in engine.abort_request(next(iter(engine.groups)))])
        steps.append([comparable(o) for o in engine.step()])
    return steps, engine.get_stats()


def comparable(output) -> tuple:
    return (
        output.request_id,
        output.finished,
        output.num_cached_tokens,
        output.prompt_logprobs,
        dataclasses.astuple(output.metrics),
        [dataclasses.astuple(c) for c in output.outputs],
    )


@pytest.mark.parametrize("seed", [3, 8])
def test_one_pass_equals_the_general_path(tiny_checkpoint, monkeypatch, seed):
    calls = {"one pass": 0, "process_new_token": 0}
    real_step, real_process = llm_engine_module.process_plain_step, SequenceState.process_new_token

    def counting_step(*args):
        calls["one pass"] += 1
        return real_step(*args)

    def counting_process(self, *args, **kwargs):
        calls["process_new_token"] += 1
        return real_process(self, *args, **kwargs)

    monkeypatch.setattr(llm_engine_module, "process_plain_step", counting_step)
    monkeypatch.setattr(SequenceState, "process_new_token", counting_process)
    fast_steps, fast_stats = run(tiny_checkpoint, True, monkeypatch, seed)
    fast_calls = dict(calls)
    calls.update({"one pass": 0, "process_new_token": 0})
    slow_steps, slow_stats = run(tiny_checkpoint, False, monkeypatch, seed)

    assert fast_calls["one pass"] > 0 and calls["one pass"] == 0
    # the plain decodes skipped process_new_token: the lean branch ran
    assert fast_calls["process_new_token"] < calls["process_new_token"]
    assert fast_steps == slow_steps
    assert fast_stats.inter_token_latencies == slow_stats.inter_token_latencies
    assert fast_stats.inter_token_latencies  # the decodes' intervals were recorded
    assert fast_stats.generation_tokens_total == slow_stats.generation_tokens_total
    assert fast_stats.prompt_tokens_total == slow_stats.prompt_tokens_total
    assert fast_stats.iteration_tokens == slow_stats.iteration_tokens
    assert fast_stats.finished_requests == slow_stats.finished_requests


def test_final_only_makes_no_output_before_a_request_finishes(tiny_checkpoint, monkeypatch):
    engine = LLM(model=tiny_checkpoint("llama"), block_size=8, num_gpu_blocks_override=256).engine
    made = []
    real = GroupOutputs.make_output

    def counting(self):
        made.append(self.request_id)
        return real(self)

    monkeypatch.setattr(GroupOutputs, "make_output", counting)
    monkeypatch.setattr(GroupOutputs, "_running_plain_output", None)  # must not be reached
    for i in range(6):
        params = SamplingParams(
            temperature=0.0, max_tokens=3 + 2 * i, ignore_eos=True, output_kind="final_only"
        )
        engine.add_request(f"f{i}", [7 + i, 11, 13, 17], params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert sorted(made) == sorted(f"f{i}" for i in range(6))  # one output each, at the end
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3 + 2 * i for i in range(6)]
    assert all(o.finished for o in outputs)
