"""RequestOutputKind: DELTA outputs joined up are the CUMULATIVE snapshots, step for step, and
FINAL_ONLY gives one output per request, the cumulative one's last; LLM.generate and AsyncLLM's
collapsing stream are unchanged by them."""

from __future__ import annotations

import asyncio
import copy
import dataclasses

import pytest

from pagedserve.engine import (
    LLM,
    AsyncLLM,
    EngineArgs,
    InvalidRequestError,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
)
from pagedserve.engine.async_messages import RequestStream

PROMPTS = [[5, 17, 99, 240, 3, 77, 8, 120, 45], [300, 12, 9, 64], [7, 7, 8, 9, 10, 11]]


def request_params(kind: RequestOutputKind) -> list[SamplingParams]:
    """A mix: greedy, seeded n > 1 with logprobs, stop strings (held-back text) and min_tokens."""
    return [
        SamplingParams(temperature=0, max_tokens=9, output_kind=kind),
        SamplingParams(n=3, seed=4, max_tokens=7, logprobs=2, output_kind=kind),
        SamplingParams(seed=1, max_tokens=12, stop=["e", "a "], min_tokens=2, output_kind=kind),
    ]


def run_steps(engine, kind: RequestOutputKind) -> list[list[RequestOutput]]:
    # from an empty prefix cache, so every run schedules the same batches (a prompt that hit
    # an earlier run's blocks would be prefilled in fewer rows, which may change a GEMM's bits)
    assert engine.kv_cache_manager.reset_prefix_cache()
    for i, (prompt, params) in enumerate(zip(PROMPTS, request_params(kind), strict=True)):
        engine.add_request(f"{kind.name}-{i}", prompt, params)
    steps = []
    while engine.has_unfinished_requests():
        steps.append(engine.step())
    return steps


def joined(steps: list[list[RequestOutput]]) -> list[dict[str, RequestOutput]]:
    """After each step, every request's deltas so far merged into one output (a copy)."""
    merged: dict[str, RequestOutput] = {}
    after = []
    for outputs in steps:
        for out in outputs:
            key = out.request_id.split("-")[1]
            if key in merged:
                merged[key].add(out, aggregate=True)
            else:
                merged[key] = copy.deepcopy(out)
        after.append(copy.deepcopy(merged))
    return after


def comparable(output: RequestOutput):
    return output.finished, [dataclasses.astuple(c) for c in output.outputs]


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return LLM(model=tiny_checkpoint("llama"), block_size=8, num_gpu_blocks_override=128).engine


def test_deltas_join_to_the_cumulative_snapshots_step_for_step(engine):
    cumulative = run_steps(engine, RequestOutputKind.CUMULATIVE)
    delta = run_steps(engine, RequestOutputKind.DELTA)
    assert len(cumulative) == len(delta)
    seen_cut_text = False
    for snapshots, merged in zip(cumulative, joined(delta), strict=True):
        for out in snapshots:
            key = out.request_id.split("-")[1]
            assert comparable(merged[key]) == comparable(out)
    for outputs in delta:  # a delta carries only its step's tokens
        for out in outputs:
            assert all(len(c.token_ids) <= 1 for c in out.outputs) or not out.outputs
            seen_cut_text |= any(c.stop_reason in ("e", "a ") for c in out.outputs)
    finals = {o.request_id.split("-")[1]: o for step in cumulative for o in step if o.finished}
    assert finals["1"].outputs[1].logprobs and len(finals["1"].outputs) == 3
    assert seen_cut_text or finals["2"].outputs[0].finish_reason == "length"


def test_final_only_makes_one_output_per_request_the_cumulative_last(engine):
    cumulative = run_steps(engine, RequestOutputKind.CUMULATIVE)
    final_only = run_steps(engine, RequestOutputKind.FINAL_ONLY)
    outputs = [o for step in final_only for o in step]
    assert sorted(o.request_id for o in outputs) == [f"FINAL_ONLY-{i}" for i in range(3)]
    assert all(o.finished for o in outputs)
    want = {o.request_id.split("-")[1]: o for step in cumulative for o in step if o.finished}
    for out in outputs:
        assert comparable(out) == comparable(want[out.request_id.split("-")[1]])
    stats = engine.get_stats()
    assert stats is not None


def test_llm_generate_runs_final_only_and_leaves_the_params_as_given(tiny_checkpoint, engine):
    llm = LLM.from_engine(engine)
    params = request_params(RequestOutputKind.CUMULATIVE)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    made = []
    step = engine.step

    def counting_step():
        outputs = step()
        made.extend(outputs)
        return outputs

    engine.step = counting_step
    assert engine.kv_cache_manager.reset_prefix_cache()  # as run_steps below starts
    try:
        results = llm.generate(prompts, params, use_tqdm=False)
    finally:
        del engine.step
    assert len(made) == 3  # no per-step snapshots
    assert all(p.output_kind is RequestOutputKind.CUMULATIVE for p in params)
    cumulative = run_steps(engine, RequestOutputKind.CUMULATIVE)
    want = {o.request_id.split("-")[1]: o for step in cumulative for o in step if o.finished}
    for i, out in enumerate(results):
        assert comparable(out) == comparable(want[str(i)])


def test_beam_search_refuses_delta_by_name():
    with pytest.raises(InvalidRequestError, match="output_kind DELTA") as error:
        SamplingParams(n=2, temperature=0, use_beam_search=True, output_kind="delta")
    assert error.value.param == "output_kind"
    beam = SamplingParams(n=2, temperature=0, use_beam_search=True, output_kind=2)
    assert beam.output_kind is RequestOutputKind.FINAL_ONLY
    with pytest.raises(InvalidRequestError, match="output_kind must be one of"):
        SamplingParams(output_kind="sometimes")


def test_a_slow_consumer_gets_the_deltas_merged(engine):
    """AsyncLLM's stream collapses what is queued: deltas are merged, not dropped."""
    steps = run_steps(engine, RequestOutputKind.DELTA)
    mine = [o for step in steps for o in step if o.request_id == "DELTA-1"]
    want = joined([[o] for o in mine])[-1]["1"]

    async def consume() -> list[RequestOutput]:
        stream = RequestStream(asyncio.get_running_loop(), aggregate=True)
        for out in mine[:3]:
            stream.put(out)
        await asyncio.sleep(0)
        got = [await stream.get()]  # three queued deltas, as one
        for out in mine[3:]:
            stream.put(out)
        await asyncio.sleep(0)
        while not got[-1].finished:
            got.append(await stream.get())
        return got

    got = asyncio.run(consume())
    assert len(got) <= 2 and len(got[0].outputs[0].token_ids) == 3
    merged = got[0]
    for out in got[1:]:
        merged.add(out, aggregate=True)
    assert comparable(merged) == comparable(want)


def test_async_llm_streams_deltas(tiny_checkpoint):
    async def collect() -> dict[RequestOutputKind, list[RequestOutput]]:
        llm = AsyncLLM(EngineArgs(model=tiny_checkpoint("llama"), block_size=8))
        got = {}
        try:
            for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
                params = SamplingParams(temperature=0, max_tokens=8, output_kind=kind)
                got[kind] = [o async for o in llm.generate(PROMPTS[0], params, kind.name)]
        finally:
            await llm.shutdown()
        return got

    got = asyncio.run(collect())
    cumulative, deltas = got[RequestOutputKind.CUMULATIVE], got[RequestOutputKind.DELTA]
    text = "".join(o.outputs[0].text for o in deltas)
    tokens = [t for o in deltas for t in o.outputs[0].token_ids]
    assert (text, tokens) == (cumulative[-1].outputs[0].text, cumulative[-1].outputs[0].token_ids)
    assert len(tokens) == 8 and deltas[-1].finished
