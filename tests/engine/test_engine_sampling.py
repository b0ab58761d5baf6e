"""The assembled engine on tiny models: seeds, logprobs, n > 1 over shared blocks, stop strings."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.logits_processors import bad_words_token_ids
from pagedserve.models.testing import transformers_greedy

PROMPT = [5, 17, 99, 240, 3, 77, 8, 120, 45, 301, 12, 9, 64, 200, 31, 18, 7, 250, 99, 4]  # 20


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def llm(llama):
    return LLM(model=llama, block_size=8, num_gpu_blocks_override=256)


@pytest.fixture(scope="module")
def hf_llama(llama):
    return AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()


def assert_no_block_held(llm: LLM) -> None:
    kv = llm.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks and not llm.engine.has_unfinished_requests()


def test_seeded_request_same_alone_and_in_a_mixed_batch_of_8(llm):
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate([{"prompt_token_ids": PROMPT}], seeded, use_tqdm=False)[0]
    others = [
        SamplingParams(temperature=0, max_tokens=5),
        SamplingParams(temperature=1.0, max_tokens=9),
        SamplingParams(temperature=0.7, top_k=20, seed=5, max_tokens=14),
        SamplingParams(temperature=1.2, min_p=0.05, repetition_penalty=1.2, max_tokens=7),
        SamplingParams(temperature=1.0, presence_penalty=0.5, logit_bias={3: 5.0}, max_tokens=6),
        SamplingParams(n=2, temperature=1.0, max_tokens=8),
        SamplingParams(temperature=0.9, frequency_penalty=1.0, min_tokens=3, max_tokens=10),
    ]
    prompts = [{"prompt_token_ids": [9 + i, 40 + 3 * i, 7, 300 - i]} for i in range(7)]
    batch = llm.generate(
        prompts[:3] + [{"prompt_token_ids": PROMPT}] + prompts[3:],
        others[:3] + [seeded] + others[3:],
        use_tqdm=False,
    )
    assert batch[3].outputs[0].token_ids == alone.outputs[0].token_ids
    assert len(batch[6].outputs) == 2
    assert_no_block_held(llm)


def test_temperature_0_is_deterministic_and_equals_transformers(llm, hf_llama):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    first, second = (
        llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0] for _ in range(2)
    )
    expected = transformers_greedy(hf_llama, PROMPT, 10)
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == expected
    # logprobs: transformers' log_softmax at each position; the top 3 and the sampled token
    with torch.inference_mode():
        logits = hf_llama(torch.tensor([PROMPT + expected])).logits[0, len(PROMPT) - 1 : -1]
    reference = torch.log_softmax(logits.float(), dim=-1)
    out = first.outputs[0]
    assert len(out.logprobs) == 10
    for step, (token, entry) in enumerate(zip(expected, out.logprobs, strict=True)):
        assert list(entry)[:3] == reference[step].topk(3).indices.tolist()
        assert entry[token] == pytest.approx(float(reference[step, token]), abs=1e-4)
    cumulative = sum(float(reference[i, t]) for i, t in enumerate(expected))
    assert out.cumulative_logprob == pytest.approx(cumulative, abs=1e-3)


def test_n_4_children_equal_separately_seeded_requests(llm):
    """Sequence i of a seeded n=4 request draws from seed + i, so it must equal a lone request
    with that seed: the fork and its copy-on-write keep every child's cache its own."""
    params = SamplingParams(n=4, temperature=1.0, seed=77, max_tokens=10, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    for i, completion in enumerate(out.outputs):
        alone = SamplingParams(temperature=1.0, seed=77 + i, max_tokens=10, ignore_eos=True)
        ref = llm.generate([{"prompt_token_ids": PROMPT}], alone, use_tqdm=False)[0]
        assert completion.token_ids == ref.outputs[0].token_ids
        assert completion.finish_reason == "length"
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert_no_block_held(llm)


def blocks_held(llm: LLM) -> int:
    kv = llm.engine.kv_cache_manager
    return kv.num_blocks - kv.num_free_blocks


def test_n_4_holds_the_prompt_blocks_once(llama):
    """20 prompt tokens in blocks of 8: 2 full blocks + a partial one. After the first decode
    step, n=4 holds the 2 full blocks once and 4 private last blocks (copy-on-write): 6 blocks.
    Four separate requests hold 4 x 3 = 12 (prefix caching off, so nothing else is shared)."""
    llm = LLM(model=llama, block_size=8, num_gpu_blocks_override=64, enable_prefix_caching=False)
    engine = llm.engine
    engine.add_request("n4", PROMPT, SamplingParams(n=4, max_tokens=5, ignore_eos=True))
    engine.step()  # prefill + fork
    engine.step()  # every child writes its first token: copy-on-write of the shared last block
    assert blocks_held(llm) == 6
    engine.abort_request("n4")
    for i in range(4):
        engine.add_request(f"s{i}", PROMPT, SamplingParams(max_tokens=5, ignore_eos=True))
    engine.step()
    engine.step()
    assert blocks_held(llm) == 12
    engine.abort_request([f"s{i}" for i in range(4)])
    assert blocks_held(llm) == 0


def test_stop_string_across_a_token_boundary(llm):
    base = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": PROMPT}], base, use_tqdm=False)[0].outputs[0]
    tokenizer = llm.get_tokenizer()
    pieces = [tokenizer.decode(out.token_ids[: i + 1]) for i in range(len(out.token_ids))]
    # a stop string made of the last character of token 4's text and the first of token 5's
    boundary = len(pieces[3])
    assert len(pieces[4]) > boundary and boundary >= 1
    stop = out.text[boundary - 1 : boundary + 1]
    first = out.text.find(stop)
    for include in (False, True):
        params = SamplingParams(
            temperature=0, max_tokens=16, ignore_eos=True, stop=[stop],
            include_stop_str_in_output=include,
        )  # fmt: skip
        got = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0]
        assert got.finish_reason == "stop" and got.stop_reason == stop
        assert got.text == out.text[: first + (len(stop) if include else 0)]
    assert_no_block_held(llm)


def test_stop_token_ids_and_min_tokens(llm, hf_llama):
    expected = transformers_greedy(hf_llama, PROMPT, 8)
    stop_at = expected[3]
    params = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_at], ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0]
    first = expected.index(stop_at)
    assert out.token_ids == expected[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    # min_tokens: the stop token cannot even be sampled before min_tokens tokens are out
    params = SamplingParams(
        temperature=0, max_tokens=8, stop_token_ids=[stop_at], ignore_eos=True, min_tokens=6
    )
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0]
    assert stop_at not in out.token_ids[:6]


@pytest.mark.parametrize("budget", [None, 8], ids=["one-chunk", "chunked-prefill"])
def test_prompt_logprobs_equal_transformers(llama, hf_llama, budget):
    """Every prompt token's logprob (and the top 2) from transformers' forward over the prompt,
    also when the prompt is read in chunks of 8 and when its blocks are in the prefix cache;
    every token's rank (vLLM's: how many tokens are at least as likely), inside the top 2 or
    not."""
    llm = LLM(model=llama, block_size=8, num_gpu_blocks_override=64, max_num_batched_tokens=budget)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    with torch.inference_mode():
        logits = hf_llama(torch.tensor([PROMPT])).logits[0, :-1]
    reference = torch.log_softmax(logits.float(), dim=-1)
    for _ in range(2):  # the second run would find the prompt's blocks in the prefix cache
        out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
        for i, entry in enumerate(out.prompt_logprobs[1:]):
            assert list(entry)[:2] == reference[i].topk(2).indices.tolist()
            token = PROMPT[i + 1]
            assert entry[token] == pytest.approx(float(reference[i, token]), abs=1e-4)
            assert entry[token].logprob == float(entry[token])
            assert entry[token].rank == int((reference[i] >= reference[i, token] - 1e-5).sum())
            assert [entry[t].rank for t in list(entry)[:2]] == [1, 2]
    assert_no_block_held(llm)


def test_n_3_when_the_first_sequence_stops_at_its_first_token(llm):
    """Sequence 0 (the parent) stops at once and frees its blocks; the other sequences, forked
    in that same step, must still run on (queued afresh over the prefix cache) unchanged."""
    free_params = SamplingParams(n=3, temperature=1.0, seed=21, max_tokens=6, ignore_eos=True)
    free = llm.generate([{"prompt_token_ids": PROMPT}], free_params, use_tqdm=False)[0].outputs
    stop = free[0].token_ids[0]
    assert any(o.token_ids[0] != stop for o in free[1:])
    params = SamplingParams(
        n=3, temperature=1.0, seed=21, max_tokens=6, ignore_eos=True, stop_token_ids=[stop]
    )
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs
    for got, ref in zip(out, free, strict=True):
        tokens = ref.token_ids
        cut = tokens.index(stop) + 1 if stop in tokens else len(tokens)
        assert got.token_ids == tokens[:cut]
        assert got.finish_reason == ("stop" if stop in tokens else "length")
    assert_no_block_held(llm)


def test_the_thinking_budget_ends_the_thinking_after_exactly_n_tokens(llm):
    """The prompt opens the thinking (as a reasoning model's chat template does); after the
    budget's tokens the end tokens follow, then the answer is free again. Without a start in
    sight nothing is forced."""
    start, end = [300], [301, 302]
    params = dict(temperature=0.9, seed=4, max_tokens=12, ignore_eos=True)
    budget = SamplingParams(
        **params,
        thinking_token_budget=5,
        thinking_start_token_ids=start,
        thinking_end_token_ids=end,
    )
    prompt = [{"prompt_token_ids": PROMPT + start}]
    out = llm.generate(prompt, budget, use_tqdm=False)[0].outputs[0].token_ids
    assert out[5:7] == end
    assert 301 not in out[:5] or out.index(301) >= 5
    free = llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0].outputs[0]
    assert free.token_ids[:5] == out[:5]  # the same draws until the budget is spent
    unopened = llm.generate([{"prompt_token_ids": PROMPT}], budget, use_tqdm=False)[0]
    plain = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(**params), use_tqdm=False)
    assert unopened.outputs[0].token_ids == plain[0].outputs[0].token_ids


def test_allowed_token_ids_and_bad_words_hold_through_the_engine(llm):
    allowed = [7, 8, 9, 10]
    params = SamplingParams(temperature=1.0, seed=2, max_tokens=10, allowed_token_ids=allowed)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0]
    assert set(out.token_ids) <= set(allowed)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    free = llm.generate([{"prompt_token_ids": PROMPT}], greedy, use_tqdm=False)[0].outputs[0]
    tokenizer = llm.get_tokenizer()
    # a token the free run writes that is a whole word on its own
    token, word = next(
        (t, tokenizer.decode([t]))
        for t in free.token_ids
        if tokenizer.decode([t]).strip()
        and [t] in bad_words_token_ids([tokenizer.decode([t])], tokenizer)
    )
    banned = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, bad_words=[word])
    out = llm.generate([{"prompt_token_ids": PROMPT}], banned, use_tqdm=False)[0].outputs[0]
    assert token in free.token_ids and token not in out.token_ids
