"""Speculative decoding with the n-gram proposer, end to end on tiny random models.

Greedy outputs must be token for token those of the same engine without speculation: across a
batch, under chunked prefill, under preemption in a tiny KV pool, with n > 1 forks, and when a
stop (string, stop token, max_tokens) falls inside an accepted run. The prompts repeat
themselves so that the proposer proposes and the target accepts; every test checks that
proposals were accepted, so none can pass with speculation doing nothing.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from pagedserve.engine import EngineArgs, LLMEngine, SamplingParams

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}
BLOCK_SIZE = 8


def repetitive_prompts(num: int, seed: int = 0) -> list[list[int]]:
    """Short random phrases repeated a few times, of varied lengths."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        phrase = [rng.randrange(3, 500) for _ in range(rng.randint(3, 7))]
        prompts.append((phrase * rng.randint(2, 5))[: rng.randint(10, 40)])
    return prompts


def run(path, prompts, params, speculative: bool | dict, after_step=None, **engine_kwargs):
    """Step an engine to the end; returns (final outputs by id, tokens emitted per step by id,
    engine). After every step each running sequence holds exactly the blocks its computed
    tokens need: none kept for rejected proposals. ``speculative``: True for NGRAM, or a
    speculative config; ``after_step(engine)`` runs after every step (more invariants)."""
    engine_kwargs.setdefault("block_size", BLOCK_SIZE)
    engine_kwargs.setdefault("num_gpu_blocks_override", 256)
    spec = NGRAM if speculative is True else (speculative or None)
    engine = LLMEngine(EngineArgs(model=path, speculative_config=spec, **engine_kwargs))
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, p)
    final, chunks, seen = {}, {}, {}
    kv = engine.kv_cache_manager
    while engine.has_unfinished_requests():
        for out in engine.step():
            count = len(out.outputs[0].token_ids)
            if count > seen.get(out.request_id, 0):
                chunks.setdefault(out.request_id, []).append(count - seen.get(out.request_id, 0))
                seen[out.request_id] = count
            if out.finished:
                final[out.request_id] = out
        for request in engine.scheduler.running:
            needed = -(-request.num_computed_tokens // kv.block_size)
            assert len(kv.block_tables[request.request_id]) == needed
        if after_step is not None:
            after_step(engine)
    return final, chunks, engine


def token_ids(final) -> dict[str, list[list[int]]]:
    return {rid: [c.token_ids for c in out.outputs] for rid, out in final.items()}


def assert_accepted(engine) -> None:
    stats = engine.get_stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens > 0


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_greedy_batch_with_chunked_prefill_equals_no_speculation(arch, tiny_checkpoint):
    path = tiny_checkpoint(arch)
    prompts = repetitive_prompts(6)
    kwargs = dict(max_num_batched_tokens=24, long_prefill_token_threshold=16)
    base, _, _ = run(path, prompts, GREEDY, speculative=False, **kwargs)
    spec, chunks, engine = run(path, prompts, GREEDY, speculative=True, **kwargs)
    assert token_ids(spec) == token_ids(base)
    assert {rid: out.outputs[0].text for rid, out in spec.items()} == {
        rid: out.outputs[0].text for rid, out in base.items()
    }
    assert_accepted(engine)
    assert max(max(c) for c in chunks.values()) > 1  # some step emitted an accepted run
    stats = engine.get_stats()
    assert 0 < stats.spec_decode_acceptance_rate <= 1
    assert stats.spec_decode_mean_acceptance_length > 1
    assert stats.generation_tokens_total == sum(len(t[0]) for t in token_ids(spec).values())
    kv = engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks  # every block back: nothing leaked


def test_greedy_under_preemption_in_a_tiny_pool(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    prompts = repetitive_prompts(8, seed=1)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kwargs = dict(num_gpu_blocks_override=24, max_num_batched_tokens=64)
    base, _, _ = run(path, prompts, params, speculative=False, **kwargs)
    spec, _, engine = run(path, prompts, params, speculative=True, **kwargs)
    assert engine.get_stats().num_preemptions > 0
    assert token_ids(spec) == token_ids(base)
    assert_accepted(engine)
    assert engine.kv_cache_manager.num_free_blocks == 24


def test_greedy_n2_forks_and_logprobs(tiny_checkpoint):
    """n = 2 children share the prompt's blocks (copy-on-write under proposals); logprobs of
    the accepted tokens are the target's, as without speculation."""
    path = tiny_checkpoint("llama")
    prompts = repetitive_prompts(3, seed=2)
    params = SamplingParams(n=2, temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    base, _, _ = run(path, prompts, params, speculative=False)
    spec, _, engine = run(path, prompts, params, speculative=True)
    assert token_ids(spec) == token_ids(base)
    assert_accepted(engine)
    for rid, out in spec.items():
        for got, want in zip(out.outputs, base[rid].outputs, strict=True):
            assert len(got.logprobs) == len(got.token_ids)
            for got_step, want_step in zip(got.logprobs, want.logprobs, strict=True):
                assert got_step.keys() == want_step.keys()
                for token, value in want_step.items():
                    assert got_step[token] == pytest.approx(value, abs=1e-4)


def inside_runs(chunks: list[int]) -> list[int]:
    """Output positions that a verify step emitted with more tokens after them in the same
    step (so a stop there cuts an accepted run)."""
    positions, emitted = [], 0
    for count in chunks:
        positions.extend(range(emitted, emitted + count - 1))
        emitted += count
    return positions


def stop_inside_a_run(
    path, kind: str, speculative: bool | dict = True
) -> tuple[list[int], SamplingParams, int]:
    """A prompt and a stop of ``kind`` that ends its greedy output at index i, where the
    speculative run emitted token i with more tokens after it in the same verify step.

    (A stop token inside a run is tested in tests/scheduler: an accepted n-gram proposal is
    a token the sequence has already produced, so it would have stopped there first.)"""
    from pagedserve.models import load_tokenizer

    tokenizer = load_tokenizer(path)
    free = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for prompt in repetitive_prompts(8, seed=4):
        final, chunks, _ = run(path, [prompt], free, speculative=speculative)
        tokens = final["0"].outputs[0].token_ids
        candidates = inside_runs(chunks["0"])
        for i in candidates:
            if kind == "max_tokens" and i - 1 in candidates:
                # nothing is proposed past max_tokens: the run is cut to what fits, and i - 1
                # of the same run is still an accepted proposal
                return prompt, replace(free, max_tokens=i + 1), i
            if kind == "stop":  # the shortest text ending with token i seen nowhere before
                text = tokenizer.decode(tokens[: i + 1])
                before = len(tokenizer.decode(tokens[:i]))
                fresh = len(text) > before and tokenizer.decode(tokens[: i + 2]).startswith(text)
                for start in range(before - 1, -1, -1) if fresh else ():
                    if text.find(text[start:]) == start:
                        return prompt, replace(free, stop=[text[start:]]), i
    raise AssertionError(f"no prompt gave a {kind} stop inside an accepted run")


@pytest.mark.parametrize("kind", ["max_tokens", "stop"])
def test_a_stop_inside_an_accepted_run_ends_the_output_there(kind, tiny_checkpoint):
    path = tiny_checkpoint("llama")
    prompt, stopped, index = stop_inside_a_run(path, kind)
    base, _, _ = run(path, [prompt], stopped, speculative=False)
    spec, _, engine = run(path, [prompt], stopped, speculative=True)
    got, want = spec["0"].outputs[0], base["0"].outputs[0]
    assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
        want.token_ids,
        want.text,
        want.finish_reason,
        want.stop_reason,
    )
    assert len(got.token_ids) == index + 1
    assert got.finish_reason == ("length" if kind == "max_tokens" else "stop")
    assert_accepted(engine)
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks


def test_sampling_with_many_rejections_leaks_no_block_and_is_reproducible(tiny_checkpoint):
    """Sampled (temperature 0.1), most proposals are rejected; seeded requests draw the same
    tokens in any batch, and every block comes back."""
    path = tiny_checkpoint("llama")
    prompts = repetitive_prompts(6, seed=3)
    params = [
        SamplingParams(temperature=0.1, top_p=0.95, max_tokens=30, seed=i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    first, _, engine = run(path, prompts, params, speculative=True, num_gpu_blocks_override=40)
    stats = engine.get_stats()
    assert stats.spec_decode_num_draft_tokens > stats.spec_decode_num_accepted_tokens > 0
    assert engine.kv_cache_manager.num_free_blocks == 40
    alone, _, _ = run(path, prompts[2:3], params[2:3], speculative=True)
    assert alone["0"].outputs[0].token_ids == first["2"].outputs[0].token_ids


def test_beam_search_with_speculation_is_refused_at_request_time(tiny_checkpoint):
    from pagedserve.engine import InvalidRequestError

    args = EngineArgs(
        model=tiny_checkpoint("llama"), speculative_config=NGRAM, num_gpu_blocks_override=16
    )
    engine = LLMEngine(args)
    params = SamplingParams(n=2, use_beam_search=True, temperature=0, max_tokens=4)
    with pytest.raises(InvalidRequestError, match="speculative") as info:
        engine.add_request("0", [5, 6, 7], params)
    assert info.value.param == "use_beam_search"
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_streaming_and_abort_with_speculation(method, tiny_checkpoint):
    """AsyncLLM streams cumulative outputs that may grow by several tokens a step; a stream
    aborted mid-way frees every block at once. (draft_model: the target as its own draft.)"""
    import asyncio

    from pagedserve.engine import AsyncLLM

    path = tiny_checkpoint("llama")
    spec = NGRAM if method == "ngram" else {"method": method, "model": path}
    prompts = repetitive_prompts(2, seed=5)
    base, _, _ = run(path, prompts[:1], GREEDY, speculative=False)

    async def main():
        args = EngineArgs(
            model=path, block_size=BLOCK_SIZE, num_gpu_blocks_override=64, speculative_config=spec
        )
        llm = AsyncLLM.from_engine_args(args)
        try:
            streamed = [o async for o in llm.generate(prompts[0], GREEDY, "a")]
            aborted = []
            async for out in llm.generate(prompts[1], GREEDY, "b"):
                aborted.append(out)
                if len(out.outputs[0].token_ids) >= 3:
                    await llm.abort("b")
                    break
            for _ in range(50):
                if not llm.engine.has_unfinished_requests():
                    break
                await asyncio.sleep(0.05)
            return llm, streamed, aborted
        finally:
            await llm.shutdown()

    llm, streamed, aborted = asyncio.run(main())
    assert streamed[-1].finished
    assert streamed[-1].outputs[0].token_ids == base["0"].outputs[0].token_ids
    lengths = [len(o.outputs[0].token_ids) for o in streamed]
    assert lengths == sorted(lengths) and len(lengths) < lengths[-1]  # several tokens a step
    kv = llm.engine.kv_cache_manager
    assert not llm.engine.has_unfinished_requests() and kv.num_free_blocks == kv.num_blocks


def test_structured_output_requests_get_no_proposals_beside_speculating_ones(tiny_checkpoint):
    """A grammar's mask is not applied at proposal positions, so a constrained sequence is not
    speculated on; it still obeys its constraint, beside a greedy request that speculates."""
    import re

    from pagedserve.engine.structured_output import StructuredOutputsParams

    path = tiny_checkpoint("llama")
    constrained = SamplingParams(
        temperature=0,
        max_tokens=24,
        structured_outputs=StructuredOutputsParams(regex=r"(ab){3,8}c"),
    )
    prompts = repetitive_prompts(4)
    params = [GREEDY] * 3 + [constrained]
    final, chunks, engine = run(path, prompts, params, speculative=True)
    base, _, _ = run(path, prompts[:3], GREEDY, speculative=False)
    assert token_ids(final) == {**token_ids(base), "3": token_ids(final)["3"]}
    assert re.fullmatch(r"(ab){3,8}c", final["3"].outputs[0].text)
    assert max(chunks["3"]) == 1  # one token a step: never a verified run
    assert_accepted(engine)
