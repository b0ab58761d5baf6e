"""Preemption by recompute and chunked prefill change nothing in the output.

A KV pool far too small for the batch forces many preemptions (each preempted request is freed
and later recomputed, partly from the prefix cache), and a token budget smaller than the prompts
forces chunked prefill. Every output must still be identical, token for token, to the run with
room to spare, for greedy and for seeded sampling alike (a recomputed request samples nothing
until it reaches its last known token, so its random generator advances exactly as before).
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve.engine import LLM, SamplingParams
from pagedserve.models.testing import transformers_greedy

MAX_TOKENS = 24


def random_prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab_size) for _ in range(12)]  # a common prefix for a few
    prompts = []
    for i, n in enumerate(lengths):
        head = shared[: min(n, 12)] if i % 3 == 0 else []
        prompts.append(head + [rng.randrange(3, vocab_size) for _ in range(n - len(head))])
    return prompts


def generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def constrained_llm(model: str, num_blocks: int, budget: int, caching: bool) -> LLM:
    return LLM(
        model=model,
        block_size=8,
        num_gpu_blocks_override=num_blocks,
        max_num_batched_tokens=budget,
        enable_prefix_caching=caching,
    )


@pytest.mark.slow
def test_tiny_model_outputs_survive_preemption_and_chunked_prefill(tiny_checkpoint):
    model = tiny_checkpoint("llama")
    prompts = random_prompts(256, [37, 5, 21, 30, 9, 40, 14, 26])
    greedy = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)] * 4
    seeded = [
        SamplingParams(temperature=1.0, seed=100 + i, max_tokens=MAX_TOKENS, ignore_eos=True)
        for i in range(4)
    ]
    params = greedy + seeded
    roomy = generate(LLM(model=model, block_size=8, num_gpu_blocks_override=64), prompts, params)

    # The longest request holds at most ceil((40 + 24 - 1) / 8) = 8 blocks; 10 blocks for eight
    # requests, and a budget of 12 tokens, force preemptions and chunks at almost every step.
    for caching in (True, False):
        llm = constrained_llm(model, num_blocks=10, budget=12, caching=caching)
        assert generate(llm, prompts, params) == roomy, f"prefix caching {caching}"
        assert llm.engine.scheduler.stats.num_preemptions > 0
        assert llm.engine.kv_cache_manager.num_free_blocks == 10

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    for prompt, tokens in zip(prompts[:4], roomy[:4], strict=True):
        assert tokens == transformers_greedy(hf, prompt, MAX_TOKENS)


@pytest.mark.slow
def test_smollm2_outputs_survive_preemption_and_chunked_prefill(
    default_model_path, smollm2_greedy_batch
):
    """The real model, checked against the session's unconstrained greedy batch (which
    test_smollm2_greedy.py holds equal to transformers). Two blocks of 16 for three requests (the
    19-token prompt and its 10 tokens fill both alone) and a budget of 8 tokens force preemption
    and chunked prefill; the run is kept short, as this model is slow on a CPU."""
    llm = LLM(
        model=default_model_path,
        block_size=16,
        num_gpu_blocks_override=2,
        max_num_batched_tokens=8,
        max_model_len=64,
    )
    texts = [
        "The capital of France is",
        "Once upon a time, in a small village by the sea, there lived an old fisherman who",
        "def fibonacci(n):",
    ]
    roomy = [smollm2_greedy_batch.outputs[t] for t in texts]
    prompts = [o.prompt_token_ids for o in roomy]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    tight = generate(llm, prompts, [params] * len(prompts))
    assert llm.engine.scheduler.stats.num_preemptions > 0
    assert tight == [o.outputs[0].token_ids[:10] for o in roomy]
