"""A draft model's KV cache stores ``kv_cache_dtype`` as the target's does.

With ``kv_cache_dtype="float16"`` under an fp32 model, the draft's caches are 16-bit too, the
memory budget is split over both caches' 16-bit block bytes, and greedy speculative decoding
still emits the target's own greedy tokens over the same 16-bit cache. With the target as its
own draft the two caches hold the same keys and values after every step, within fp16's
tolerance: the draft computes a token's key in another batch shape than the target's verify
forward, and fp32 keys a rounding error apart can round to neighbouring fp16 values (one ulp,
2.4e-4 near 0.3, measured); a draft cache that held other tokens' keys would differ by ~0.1.
"""

from __future__ import annotations

import functools

import pytest
import torch
from test_spec_decode import GREEDY, repetitive_prompts, run, token_ids
from test_spec_draft import assert_draft_cache_is_the_targets, draft_config

FP16 = 2  # bytes per cached element
KV_CACHE_MEMORY = 1 << 20
ENGINE = dict(
    kv_cache_dtype="float16",
    kv_cache_memory=KV_CACHE_MEMORY,
    num_gpu_blocks_override=None,  # sized from the memory budget, both caches counted
    max_num_batched_tokens=32,
    long_prefill_token_threshold=16,
)


def fp16_block_bytes(model_config, block_size: int) -> int:
    mc = model_config
    return 2 * mc.num_layers * block_size * mc.num_kv_heads * mc.head_dim * FP16


@pytest.fixture(scope="module")
def target(tiny_checkpoint) -> str:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def fp16_greedy_base(target):
    """The target's greedy outputs over its fp16 cache, without speculation."""
    prompts = repetitive_prompts(3, seed=2)
    return prompts, run(target, prompts, GREEDY, speculative=False, **ENGINE)[0]


@pytest.mark.parametrize("draft", ["target", "small_llama"])
def test_the_drafts_cache_is_16_bit_and_greedy_is_the_targets(
    draft, target, fp16_greedy_base, tiny_checkpoint
):
    path = target
    if draft == "small_llama":  # other layers and head layout: other block bytes
        path = tiny_checkpoint(
            "llama", seed=3, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1,
        )  # fmt: skip
    check_mirror = None
    if draft == "target":  # fp16's tolerance (the house tolerance table)
        check_mirror = functools.partial(assert_draft_cache_is_the_targets, atol=1e-3, rtol=1e-3)
    prompts, base = fp16_greedy_base
    spec, _, engine = run(target, prompts, GREEDY, draft_config(path), check_mirror, **ENGINE)
    assert token_ids(spec) == token_ids(base)
    assert engine.get_stats().spec_decode_num_draft_tokens > 30

    runner, proposer = engine.runner, engine.speculator.draft
    assert runner.model_config.torch_dtype == torch.float32
    assert {c.dtype for pair in proposer.kv_caches for c in pair} == {torch.float16}
    assert {c.dtype for pair in runner.kv_caches for c in pair} == {torch.float16}
    block_size = engine.cache_config.block_size
    draft_bytes = fp16_block_bytes(proposer.model_config, block_size)
    assert engine.speculator.kv_block_bytes(block_size) == draft_bytes
    target_bytes = fp16_block_bytes(runner.model_config, block_size)
    assert runner.num_blocks == KV_CACHE_MEMORY // (target_bytes + draft_bytes)
    assert all(k.shape[0] == runner.num_blocks for k, _ in proposer.kv_caches)
