"""``kv_cache_dtype``: a 16-bit KV cache under an fp32 model, end to end on CPU.

The cache stores float16 / bfloat16 (twice the blocks in the same memory), attention computes
in fp32 over the widened values; greedy decoding of a tiny GQA llama then matches the fp32
cache's tokens over 24 steps (chunked prefill, decode), and each chosen token's logprob stays
within the 16-bit rounding of K and V (measured: <= 2e-3 for fp16, <= 2e-2 for bf16 on this
model). An fp8 cache is refused at configuration.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.blockmgr import CacheConfig
from pagedserve.engine import LLM, EngineArgs, SamplingParams

PROMPTS = [{"prompt_token_ids": list(range(5 + 7 * i, 45 + 11 * i))} for i in range(3)]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
LOGPROB_ATOL = {"float16": 5e-3, "bfloat16": 5e-2}


def _run(path: str, kv_cache_dtype: str):
    llm = LLM(
        model=path,
        kv_cache_dtype=kv_cache_dtype,
        block_size=8,
        kv_cache_memory=4 << 20,
        max_num_batched_tokens=16,
    )
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    runner = llm.engine.runner
    return runner, [(o.token_ids, o.logprobs) for o in outs]


@pytest.fixture(scope="module")
def tiny_llama(tiny_checkpoint) -> str:
    return tiny_checkpoint("llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=2)


@pytest.fixture(scope="module")
def fp32_run(tiny_llama):
    return _run(tiny_llama, "auto")


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16"])
def test_16bit_cache_matches_the_fp32_cache_greedily(tiny_llama, fp32_run, kv_cache_dtype):
    fp32_runner, expected = fp32_run
    runner, got = _run(tiny_llama, kv_cache_dtype)
    assert fp32_runner.kv_caches[0][0].dtype == torch.float32
    assert runner.kv_caches[0][0].dtype == getattr(torch, kv_cache_dtype)
    assert runner.num_blocks == 2 * fp32_runner.num_blocks  # half the bytes per token
    for (want_ids, want_lps), (ids, lps) in zip(expected, got):
        assert ids == want_ids
        for want, lp, token in zip(want_lps, lps, ids):
            assert lp[token] == pytest.approx(want[token], abs=LOGPROB_ATOL[kv_cache_dtype])


def test_fp8_cache_is_refused_with_a_clear_message():
    with pytest.raises(ValueError, match="fp8 KV cache is not implemented"):
        CacheConfig(cache_dtype="fp8")
    with pytest.raises(ValueError, match="cache_dtype must be one of"):
        CacheConfig(cache_dtype="float64")
    assert EngineArgs(model="unused", kv_cache_dtype="bfloat16").kv_cache_dtype == "bfloat16"
