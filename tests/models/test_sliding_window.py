"""Sliding-window attention against transformers: prompts longer than the window, greedy
continuations that run further past it, and a prefill in chunks across the window's edge.

Before pagedserve read ``sliding_window``, a Mistral with a 16-token window matched transformers
on none of these: every layer attended to the whole prompt.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve.engine import LLM, SamplingParams
from pagedserve.models import ModelConfig
from pagedserve.models.testing import transformers_greedy

WINDOW = 16
PROMPT = [(i * 37) % 500 + 3 for i in range(50)]  # 50 tokens: three windows long

CASES = {
    # every layer windowed
    "mistral": ("mistral", dict(sliding_window=WINDOW)),
    # Qwen2's window from max_window_layers on: layer 0 global, layer 1 windowed
    "qwen2-mixed": (
        "qwen2",
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    ),
}


def _hf(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_past_the_window_matches_transformers(tiny_checkpoint, case):
    arch, overrides = CASES[case]
    path = tiny_checkpoint(arch, **overrides)
    llm = LLM(model=path, block_size=8)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == transformers_greedy(_hf(path), PROMPT, 32)


def test_chunked_prefill_across_the_window_edge(tiny_checkpoint):
    """Prefill chunks of 12 tokens: each chunk's first rows see the previous chunk's tail,
    its last rows do not; the final logits must still be transformers'."""
    path = tiny_checkpoint("mistral", sliding_window=WINDOW)
    llm = LLM(model=path, block_size=8, max_num_batched_tokens=12, long_prefill_token_threshold=12)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == transformers_greedy(_hf(path), PROMPT, 8)


def test_layer_windows_from_each_config_spelling(tiny_checkpoint):
    mistral = ModelConfig(model=tiny_checkpoint("mistral", sliding_window=WINDOW))
    assert mistral.sliding_windows == [WINDOW, WINDOW] and mistral.kv_cache_window == WINDOW
    arch, overrides = CASES["qwen2-mixed"]
    qwen2 = ModelConfig(model=tiny_checkpoint(arch, **overrides))
    assert qwen2.sliding_windows == [None, WINDOW] and qwen2.kv_cache_window is None
    assert ModelConfig(model=tiny_checkpoint("llama")).sliding_windows == [None, None]
    wide = ModelConfig(model=tiny_checkpoint("mistral", sliding_window=4096))
    assert wide.sliding_windows == [None, None]  # wider than max_model_len: no window


def test_prefix_caching_with_released_blocks_matches_transformers(tiny_checkpoint):
    """The first request releases its prompt's head blocks as it decodes; the second, with the
    same prompt, hits them in the prefix cache (they keep their hashes) and must continue
    exactly as transformers does. While decoding, a request holds about a window of blocks."""
    path = tiny_checkpoint("mistral", sliding_window=WINDOW)
    llm = LLM(model=path, block_size=8, enable_prefix_caching=True)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = transformers_greedy(_hf(path), PROMPT, 24)
    for request_id in ("first", "second"):
        engine.add_request(request_id, PROMPT, params)
        held, final = [], None
        while engine.has_unfinished_requests():
            for out in engine.step():
                final = out
            table = engine.kv_cache_manager.block_tables.get(request_id, [])
            held.append(sum(b.ref_count > 0 for b in table))
        assert final.outputs[0].token_ids == expected, request_id
        assert max(held[1:]) <= WINDOW // 8 + 2  # not the 10 blocks of 74 tokens
    assert final.num_cached_tokens == 48  # the second request hit 6 blocks of the prompt
