"""Prefix caching and copy-on-write through the whole engine, greedy, fp32.

- A prompt served from the prefix cache gives exactly the tokens it gives cold, and transformers'.
- A request sharing a long prefix with an earlier one (or with one admitted in the same step)
  reports exactly the shared full blocks in ``num_cached_tokens``.
- Blocks written while decoding are cached too, and serve a later prompt that extends them.
- Fork after prefill (scheduler + model runner): parent and child share every block, then
  decode different tokens; the shared, partly filled block is copied before the first write,
  and each keeps its own KV: its logits equal transformers' on its own tokens, step after step.
- The same through the engine: ``SamplingParams(n=2)`` children diverge, and each equals an
  n=1 run with its own seed.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve.engine import LLM, SamplingParams
from pagedserve.models.testing import transformers_greedy
from pagedserve.scheduler import Request, RequestStatus

BLOCK = 8
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _prompt(seed: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (length,), generator=g).tolist()


def _generate(llm: LLM, prompts: list[list[int]], params=GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


@pytest.fixture(scope="module")
def llm(tiny):
    """One engine for the module: each test uses prompts no other test shares a block with."""
    return LLM(model=tiny[0], block_size=BLOCK, num_gpu_blocks_override=128)


def test_warm_prompt_equals_cold_and_transformers(tiny, llm):
    hf = tiny[1]
    stats = llm.engine.kv_cache_manager.prefix_cache_stats
    before = (stats.requests, stats.hits)
    odd, aligned = _prompt(0, 37), _prompt(1, 32)  # 32 = 4 full blocks: the last is recomputed
    cold = _generate(llm, [odd, aligned])
    warm = _generate(llm, [odd, aligned])
    assert [o.num_cached_tokens for o in cold] == [0, 0]
    assert [o.num_cached_tokens for o in warm] == [32, 24]
    for prompt, c, w in zip([odd, aligned], cold, warm, strict=True):
        assert w.outputs[0].token_ids == c.outputs[0].token_ids
        assert c.outputs[0].token_ids == transformers_greedy(hf, prompt, GREEDY.max_tokens)
    assert (stats.requests - before[0], stats.hits - before[1]) == (4, 32 + 24)


def test_shared_prefix_reports_the_shared_full_blocks(tiny, llm):
    hf = tiny[1]
    prefix = _prompt(2, 45)  # 5 full blocks and 5 tokens of a sixth
    first, second = prefix + _prompt(3, 6), prefix + _prompt(4, 9)
    (out_first,) = _generate(llm, [first])
    (out_second,) = _generate(llm, [second])
    assert out_first.num_cached_tokens == 0
    assert out_second.num_cached_tokens == 40
    for prompt, out in [(first, out_first), (second, out_second)]:
        assert out.outputs[0].token_ids == transformers_greedy(hf, prompt, GREEDY.max_tokens)


def test_requests_admitted_in_the_same_step_share_blocks(tiny, llm):
    """The second request hits blocks the first registers in the very step that computes them
    (both fit the first step's token budget): every layer stores the batch before attending."""
    hf = tiny[1]
    prefix = _prompt(5, 24)
    prompts = [prefix + _prompt(6, 5), prefix + _prompt(7, 3)]
    outputs = _generate(llm, prompts)
    assert [o.num_cached_tokens for o in outputs] == [0, 24]
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == transformers_greedy(hf, prompt, GREEDY.max_tokens)


def test_blocks_written_while_decoding_serve_a_later_prompt(tiny, llm):
    hf = tiny[1]
    prompt = _prompt(8, 13)
    (first,) = _generate(llm, [prompt])
    follow_up = prompt + first.outputs[0].token_ids + _prompt(9, 4)  # 13 + 12 + 4 = 29 tokens
    (second,) = _generate(llm, [follow_up])
    assert second.num_cached_tokens == 24  # prompt and generated tokens up to block 3
    assert second.outputs[0].token_ids == transformers_greedy(hf, follow_up, GREEDY.max_tokens)


def test_prefix_caching_off_computes_everything(tiny):
    path, _ = tiny
    llm = LLM(model=path, block_size=BLOCK, num_gpu_blocks_override=32, enable_prefix_caching=False)
    prompt = _prompt(10, 30)
    cold, warm = _generate(llm, [prompt]), _generate(llm, [prompt])
    assert cold[0].num_cached_tokens == warm[0].num_cached_tokens == 0
    assert cold[0].outputs[0].token_ids == warm[0].outputs[0].token_ids


def _step(engine, choose):
    """One scheduler step through the real model runner; ``choose(request_id, logits)``."""
    out = engine.scheduler.schedule()
    model_input, layout = engine.runner.prepare_input(out)
    logits = engine.runner.execute_model(model_input, out.blocks_to_copy)
    rows = dict(zip(layout.sampled, logits, strict=True))
    engine.scheduler.update(out, {r: [choose(r, row)] for r, row in rows.items()})
    return out, rows


def test_forked_children_keep_separate_kv(tiny, llm):
    hf = tiny[1]
    engine = llm.engine
    prompt = _prompt(11, 21)  # the last block holds 5 of 8 tokens: shared and partly filled
    engine.scheduler.add_request(Request("parent", prompt, max_tokens=8))
    _, logits = _step(engine, lambda r, row: int(row.argmax()))
    parent = engine.scheduler.requests["parent"]
    second_best = int(logits["parent"].topk(2).indices[1])
    child = Request("child", list(prompt), max_tokens=8, output_token_ids=[second_best])
    engine.scheduler.add_forked_request("parent", child)
    kv = engine.kv_cache_manager
    assert kv.get_block_table("child") == kv.get_block_table("parent")

    copies = []
    for _ in range(5):
        out, logits = _step(engine, lambda r, row: int(row.argmax()))
        copies += out.blocks_to_copy
        for request in (parent, child):
            tokens = request.all_token_ids[:-1]  # the logits were for the token just appended
            with torch.inference_mode():
                ref = hf(torch.tensor([tokens])).logits[0, -1]
            torch.testing.assert_close(logits[request.request_id], ref, atol=1e-4, rtol=1e-4)
    # Exactly one copy: the shared partial block, by whichever of the two wrote into it first.
    ((src, dst),) = copies
    assert {src, dst} == {kv.get_block_table("child")[2], kv.get_block_table("parent")[2]}
    assert kv.get_block_table("child")[:2] == kv.get_block_table("parent")[:2]
    n = len(parent.output_token_ids) - 1
    assert parent.output_token_ids[1:] == transformers_greedy(
        hf, prompt + [parent.output_token_ids[0]], n
    )
    assert child.output_token_ids[1:] == transformers_greedy(hf, prompt + [second_best], n)
    engine.scheduler.finish_requests(["parent", "child"], RequestStatus.FINISHED_ABORTED)


def test_n2_children_diverge_and_each_equals_its_own_run(tiny, llm):
    """Sampling with n=2: the two sequences fork after the prompt (sharing its partly filled
    last block), diverge at once, and each equals an n=1 run with its own seed (seed + i)."""
    prompt = _prompt(12, 21)
    params = dict(temperature=1.0, max_tokens=12, ignore_eos=True)
    (both,) = _generate(llm, [prompt], SamplingParams(n=2, seed=5, **params))
    children = [c.token_ids for c in both.outputs]
    assert children[0][0] != children[1][0]
    for i, child in enumerate(children):
        (alone,) = _generate(llm, [prompt], SamplingParams(seed=5 + i, **params))
        assert child == alone.outputs[0].token_ids


@pytest.mark.slow
def test_smollm2_shared_system_prompt_warm_equals_cold(default_model_path):
    llm = LLM(model=default_model_path, block_size=16, num_gpu_blocks_override=64)
    system = (
        "You are a careful assistant for a small bakery. You answer questions about opening "
        "hours, bread, cakes and allergies briefly and politely, and you never invent prices."
    )
    questions = ["When do you open on Sunday?", "Do you sell rye bread?"]
    conversations = [
        [{"role": "system", "content": system}, {"role": "user", "content": q}] for q in questions
    ]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    cold = llm.chat(conversations[0], params, use_tqdm=False)[0]
    other = llm.chat(conversations[1], params, use_tqdm=False)[0]
    warm = llm.chat(conversations[0], params, use_tqdm=False)[0]
    shared = 0
    for a, b in zip(cold.prompt_token_ids, other.prompt_token_ids, strict=False):
        if a != b:
            break
        shared += 1
    assert shared >= 32  # the system prompt spans at least two full blocks
    assert cold.num_cached_tokens == 0
    assert other.num_cached_tokens == shared // 16 * 16
    assert warm.num_cached_tokens == (len(cold.prompt_token_ids) - 1) // 16 * 16
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
