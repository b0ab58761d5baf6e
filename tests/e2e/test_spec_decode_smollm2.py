"""Speculative decoding on the real default model: with n-gram proposals, SmolLM2's greedy
tokens are those it gives without speculation, token for token, on prompts whose answers
repeat their context (so proposals are made and accepted)."""

from __future__ import annotations

import pytest

from pagedserve.engine import LLM, SamplingParams

PROMPTS = [
    "Copy the list exactly.\nList: apple, banana, cherry, date, elderberry, fig, grape.\n"
    "Copy: apple, banana,",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. "
    "The quick brown",
]
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
}


@pytest.mark.slow
def test_smollm2_greedy_is_unchanged_by_ngram_speculation(default_model_path):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    kwargs = dict(block_size=16, num_gpu_blocks_override=64)
    base = LLM(model=default_model_path, **kwargs).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(model=default_model_path, speculative_config=NGRAM, **kwargs)
    spec = llm.generate(PROMPTS, params, use_tqdm=False)
    for want, got in zip(base, spec, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids, want.prompt
        assert got.outputs[0].text == want.outputs[0].text
    stats = llm.engine.get_stats()
    assert stats.spec_decode_acceptance_rate > 0.3  # the answers repeat their prompts
    assert stats.spec_decode_mean_acceptance_length > 1.5
    kv = llm.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
