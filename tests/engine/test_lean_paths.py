"""The lean paths of the common request (``SequenceState.process_new_token``'s plain decode,
``make_output``'s one running plain sequence) give exactly what the general paths give: a
random mix of requests, stepped with the lean paths on and forced off, makes the same outputs
step for step, for each output kind."""

from __future__ import annotations

import dataclasses
import random

import pytest

from pagedserve.engine import LLM, RequestOutputKind, SamplingParams
from pagedserve.engine.group_outputs import GroupOutputs
from pagedserve.engine.sequence_group import SequenceState


def random_params(rng: random.Random, kind: RequestOutputKind) -> SamplingParams:
    return SamplingParams(
        n=rng.choice([1, 1, 1, 2]),
        temperature=rng.choice([0.0, 0.8]),
        seed=rng.randrange(100),
        max_tokens=rng.randrange(1, 12),
        stop=rng.choice([None, None, ["e"]]),
        logprobs=rng.choice([None, None, 1]),
        prompt_logprobs=rng.choice([None, None, None, 1]),
        ignore_eos=rng.choice([True, False]),
        output_kind=kind,
    )


def run(engine, kind: RequestOutputKind, lean: bool, monkeypatch) -> list:
    monkeypatch.setattr(SequenceState, "lean_path_enabled", lean)
    # Both runs start from an empty prefix cache, so they schedule the same batches: a prompt
    # that hit the first run's blocks would be prefilled in fewer rows, and a GEMM's last bits
    # may differ with its row count (MKL's kernels change with it).
    assert engine.kv_cache_manager.reset_prefix_cache()
    rng = random.Random(11)
    pending = [
        ([rng.randrange(1, 500) for _ in range(rng.randrange(2, 12))], random_params(rng, kind))
        for _ in range(12)
    ]
    steps, index = [], 0
    while pending or engine.has_unfinished_requests():
        for _ in range(rng.randrange(0, 3)):  # requests join as others decode
            if pending:
                prompt, params = pending.pop()
                engine.add_request(f"q{index}", prompt, params)
                index += 1
        steps.append(
            [
                (
                    o.request_id,
                    o.finished,
                    o.prompt_logprobs,
                    [dataclasses.astuple(c) for c in o.outputs],
                )
                for o in engine.step()
            ]
        )
    return steps


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return LLM(model=tiny_checkpoint("llama"), block_size=8, num_gpu_blocks_override=256).engine


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_lean_paths_equal_the_general_ones(engine, kind, monkeypatch):
    calls = []
    real = GroupOutputs._running_plain_output

    def counting(self, request, state):
        calls.append(request.request_id)
        return real(self, request, state)

    monkeypatch.setattr(GroupOutputs, "_running_plain_output", counting)
    lean = run(engine, kind, True, monkeypatch)
    assert calls or kind is RequestOutputKind.FINAL_ONLY  # the lean path ran
    assert lean == run(engine, kind, False, monkeypatch)
