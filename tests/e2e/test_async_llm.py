"""AsyncLLM: concurrent streams equal transformers, aborts free their blocks, failures surface."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve.engine import AsyncLLM, EngineArgs, EngineDeadError, SamplingParams
from pagedserve.models.testing import transformers_greedy

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def hf_llama(llama):
    return AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()


def make_engine(path: str, **kwargs) -> AsyncLLM:
    kwargs.setdefault("block_size", 8)
    kwargs.setdefault("num_gpu_blocks_override", 64)
    return AsyncLLM.from_engine_args(EngineArgs(model=path, **kwargs))


def assert_all_blocks_free(llm: AsyncLLM) -> None:
    kv = llm.engine.kv_cache_manager
    assert not llm.engine.has_unfinished_requests()
    assert kv.block_tables == {}
    assert kv.num_free_blocks == kv.num_blocks


async def collect(llm: AsyncLLM, prompt_ids, params, request_id):
    outputs = [o async for o in llm.generate(prompt_ids, params, request_id)]
    return outputs


def test_stream_is_cumulative_and_equals_transformers(llama, hf_llama):
    prompt = [5, 17, 99, 240, 3, 77, 8]

    async def main():
        llm = make_engine(llama)
        try:
            return llm, await collect(llm, prompt, GREEDY, "r0")
        finally:
            await llm.shutdown()

    llm, outputs = asyncio.run(main())
    expected = transformers_greedy(hf_llama, prompt, MAX_TOKENS)
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    token_lists = [o.outputs[0].token_ids for o in outputs]
    for shorter, longer in zip(token_lists, token_lists[1:]):
        assert longer[: len(shorter)] == shorter and len(longer) > len(shorter)
    final = outputs[-1].outputs[0]
    assert final.token_ids == expected
    assert final.finish_reason == "length"
    assert final.text == llm.tokenizer.decode(expected, skip_special_tokens=True)
    assert_all_blocks_free(llm)


@pytest.mark.slow
def test_fifty_concurrent_requests_ten_aborted(llama, hf_llama):
    """40 requests finish equal to transformers; 10 are aborted at random points (half by the
    consumer walking away, half through ``abort``) and no block stays held."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(3, 40))] for _ in range(50)]
    aborted = set(rng.sample(range(50), 10))
    abort_after = {i: rng.randint(1, MAX_TOKENS - 2) for i in aborted}
    # An aborted request could run far longer, so the abort always lands before it ends.
    long_run = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def run_one(llm: AsyncLLM, i: int):
        outputs = []
        params = long_run if i in aborted else GREEDY
        async for output in llm.generate(prompts[i], params, f"req-{i}"):
            outputs.append(output)
            if i in aborted and len(output.outputs[0].token_ids) >= abort_after[i]:
                if i % 2:
                    break  # the consumer walks away: the request must be aborted for it
                await llm.abort(f"req-{i}")
        return outputs

    async def main():
        llm = make_engine(llama)
        try:
            results = await asyncio.gather(*(run_one(llm, i) for i in range(50)))
            await asyncio.sleep(0.05)  # let the engine thread apply the walk-away aborts
            for _ in range(100):
                if not llm.engine.has_unfinished_requests():
                    break
                await asyncio.sleep(0.02)
            return llm, results
        finally:
            await llm.shutdown()

    llm, results = asyncio.run(main())
    for i, outputs in enumerate(results):
        last = outputs[-1]
        tokens = last.outputs[0].token_ids
        if i in aborted:
            assert abort_after[i] <= len(tokens) < 200
            assert tokens == transformers_greedy(hf_llama, prompts[i], len(tokens))
            if i % 2 == 0:
                assert last.finished and last.outputs[0].finish_reason == "abort"
            continue
        assert last.finished
        assert last.outputs[0].token_ids == transformers_greedy(hf_llama, prompts[i], MAX_TOKENS)
    assert_all_blocks_free(llm)
    stats = llm.get_stats()
    assert stats.num_requests_finished == 50
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.kv_cache_usage == 0.0


def test_bad_requests_raise_before_anything_is_yielded(llama):
    async def first(llm, prompt, request_id, params=GREEDY):
        agen = llm.generate(prompt, params, request_id)
        try:
            return await agen.__anext__()
        finally:
            await agen.aclose()

    async def main():
        llm = make_engine(llama, max_model_len=64)
        try:
            with pytest.raises(ValueError, match="max_model_len"):
                await first(llm, [5] * 80, "too-long")
            with pytest.raises(ValueError, match="prompt token ids"):
                await first(llm, [5, 100000], "bad-token")
            with pytest.raises(ValueError, match="empty"):
                await first(llm, [], "empty")
            with pytest.raises(ValueError, match="stop_token_ids"):
                await first(llm, [5], "bad-stop", SamplingParams(stop_token_ids=[10**6]))
            with pytest.raises(ValueError, match="logit_bias"):
                await first(llm, [5], "bad-bias", SamplingParams(logit_bias={10**6: 1.0}))
            agen = llm.generate([5, 6, 7], SamplingParams(max_tokens=40), "dup")
            await agen.__anext__()
            with pytest.raises(ValueError, match="already in use"):
                await first(llm, [5, 6, 7], "dup")
            await agen.aclose()
            # the engine is still healthy and serves a good request
            outputs = await collect(llm, [5, 6, 7], GREEDY, "ok")
            assert outputs[-1].finished
            await llm.check_health()
            return llm
        finally:
            await llm.shutdown()

    llm = asyncio.run(main())
    assert_all_blocks_free(llm)


def test_cancelled_consumer_frees_its_blocks(llama):
    async def main():
        llm = make_engine(llama)
        started = asyncio.Event()

        async def consume():
            async for _ in llm.generate([9, 8, 7, 6], SamplingParams(max_tokens=400), "c"):
                started.set()

        try:
            task = asyncio.create_task(consume())
            await started.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(200):
                if not llm.engine.has_unfinished_requests():
                    break
                await asyncio.sleep(0.01)
            return llm
        finally:
            await llm.shutdown()

    llm = asyncio.run(main())
    assert_all_blocks_free(llm)


def test_consumer_cancelled_just_as_its_request_is_added_still_aborts_it(llama):
    """The engine thread may accept the request while the caller is being cancelled, before
    the caller's loop has seen the acceptance: the request must still be aborted, not left to
    run to ``max_tokens`` with nobody listening."""

    async def main():
        llm = make_engine(llama)

        async def consume():
            params = SamplingParams(max_tokens=400, ignore_eos=True)
            async for _ in llm.generate([9, 8, 7, 6], params, "c"):
                pass

        try:
            task = asyncio.create_task(consume())
            await asyncio.sleep(0)  # the add command is queued; the caller awaits its answer
            # Block the loop (no await) until the engine thread has accepted the request, so
            # its acceptance is still queued on the loop when the cancellation lands.
            for _ in range(5000):
                if llm.engine.unfinished_request_ids():
                    break
                time.sleep(0.001)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(500):
                if not llm.engine.has_unfinished_requests():
                    break
                await asyncio.sleep(0.01)
            return llm, llm.get_stats().finished_requests
        finally:
            await llm.shutdown()

    llm, finished = asyncio.run(main())
    assert [(f.request_id, f.finish_reason) for f in finished] == [("c", "abort")]
    assert finished[0].num_generation_tokens < 400
    assert_all_blocks_free(llm)


def test_engine_death_reaches_every_caller(llama, monkeypatch):
    async def main():
        llm = make_engine(llama)
        real_step, calls = llm.engine.step, []

        def failing_step():
            calls.append(1)
            if len(calls) > 3:
                raise RuntimeError("simulated device failure")
            return real_step()

        monkeypatch.setattr(llm.engine, "step", failing_step)
        params = SamplingParams(max_tokens=50, ignore_eos=True)
        results = await asyncio.gather(
            *(collect(llm, [4, 5, 6 + i], params, f"d{i}") for i in range(4)),
            return_exceptions=True,
        )
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert llm.errored and not llm.is_running
        assert isinstance(llm.dead_error, RuntimeError)
        with pytest.raises(EngineDeadError, match="simulated device failure"):
            await llm.check_health()
        with pytest.raises(EngineDeadError):
            await collect(llm, [4, 5], params, "after")
        await llm.shutdown()

    asyncio.run(main())


def test_shutdown_is_clean_and_final(llama):
    async def main():
        llm = make_engine(llama)
        await collect(llm, [4, 5, 6], GREEDY, "a")
        thread = llm.engine_thread
        await llm.shutdown()
        assert not thread.is_alive()
        assert not llm.is_running and not llm.errored
        with pytest.raises(EngineDeadError, match="shut down"):
            await collect(llm, [4, 5, 6], GREEDY, "b")
        await llm.shutdown()  # idempotent

    asyncio.run(main())


def test_stats_count_tokens_and_latencies(llama):
    async def main():
        llm = make_engine(llama)
        try:
            prompts = [[3, 4, 5, 6, 7], [8, 9, 10]]
            for i, p in enumerate(prompts):
                await collect(llm, p, GREEDY, f"s{i}")
            return llm, prompts
        finally:
            await llm.shutdown()

    llm, prompts = asyncio.run(main())
    stats = llm.get_stats()
    assert stats.prompt_tokens_total == sum(len(p) for p in prompts)
    assert stats.generation_tokens_total == MAX_TOKENS * len(prompts)
    assert stats.prefix_cache_queries == sum(len(p) for p in prompts)
    assert [f.request_id for f in stats.finished_requests] == ["s0", "s1"]
    for f in stats.finished_requests:
        assert f.finish_reason == "length" and f.num_generation_tokens == MAX_TOKENS
        assert 0 <= f.queue_time <= f.time_to_first_token <= f.e2e_latency
        assert f.time_per_output_token > 0
    assert llm.get_stats().finished_requests == []  # drained


def test_streamed_text_is_never_retracted_and_n_streams_together(llama):
    """With a stop string the stream holds back a possible stop prefix: every streamed text is a
    prefix of the final one, which ends before the stop string. n=3 streams 3 completions."""
    prompt = [5, 17, 99, 240, 3, 77, 8]

    async def main():
        llm = make_engine(llama)
        try:
            free = await collect(
                llm, prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), "free"
            )
            text = free[-1].outputs[0].text
            stop = text[5:8]
            params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])
            stopped = await collect(llm, prompt, params, "stopped")
            sampled = await collect(llm, prompt, SamplingParams(n=3, seed=3, max_tokens=6), "n3")
            return llm, text, stop, stopped, sampled
        finally:
            await llm.shutdown()

    llm, text, stop, stopped, sampled = asyncio.run(main())
    final = stopped[-1].outputs[0]
    assert final.finish_reason == "stop" and final.text == text[: text.find(stop)]
    assert all(final.text.startswith(o.outputs[0].text) for o in stopped)
    assert [o.index for o in sampled[-1].outputs] == [0, 1, 2]
    assert all(o.finish_reason is not None for o in sampled[-1].outputs)
    assert_all_blocks_free(llm)
