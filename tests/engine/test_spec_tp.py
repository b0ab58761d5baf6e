"""Speculative decoding under tensor parallelism (2 ranks, gloo on CPU): the verify step's
1 + k tokens per sequence go to every rank as one prepared batch, and a draft model runs
unsharded beside rank 0 (its KV cache there only, on the same block ids). Greedy outputs are
the single-process ones without speculation."""

from __future__ import annotations

import pytest
import torch
from test_spec_decode import NGRAM, repetitive_prompts
from test_tensor_parallel import tp_llm

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.kv_cache import bytes_per_block
from pagedserve.models import KVCacheSpec

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.mark.slow
def test_speculation_over_two_ranks_gives_the_single_process_tokens(
    tiny_checkpoint,
    one_thread,  # noqa: F811
):
    path = tiny_checkpoint("llama")
    prompts = [{"prompt_token_ids": p} for p in repetitive_prompts(4, seed=6)]
    budget = 4 << 20
    engine_args = dict(block_size=8, max_num_batched_tokens=32, kv_cache_memory=budget)
    expected = [o.outputs[0].token_ids for o in LLM(model=path, **engine_args).generate(
        prompts, GREEDY, use_tqdm=False
    )]  # fmt: skip
    draft = {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    for spec_config in (NGRAM, draft):
        with tp_llm(path, 2, speculative_config=spec_config, **engine_args) as llm:
            outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outputs] == expected, spec_config["method"]
            stats = llm.engine.get_stats()
            assert stats.spec_decode_num_accepted_tokens > 0
            if spec_config is draft:  # the target as its own draft: all accepted
                assert stats.spec_decode_acceptance_rate > 0.95
                # 2 KV heads over 2 ranks; the draft (not sharded) holds both
                shard = bytes_per_block(KVCacheSpec(2, 1, 16, 2), 8, torch.float32)
                whole = bytes_per_block(KVCacheSpec(2, 2, 16, 2), 8, torch.float32)
                assert llm.engine.runner.num_blocks == budget // (shard + whole)
            kv = llm.engine.kv_cache_manager
            assert kv.num_free_blocks == kv.num_blocks
