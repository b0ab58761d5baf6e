"""A draft model on the real default model: SmolLM2's greedy tokens are those it gives alone,
with SmolLM2 cut to its first 2 layers as the draft (tools/make_draft_model.py). That is a poor
draft (greedy acceptance under 1%; this test prints it): the draft's cache is checked on the
tiny models instead, where the target is its own draft (tests/engine/test_spec_draft.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pagedserve.engine import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from make_draft_model import truncate_layers  # noqa: E402

PROMPTS = [
    "Copy the list exactly.\nList: apple, banana, cherry, date, elderberry, fig, grape.\n"
    "Copy: apple, banana,",
    "The capital of France is",
]


@pytest.mark.slow
def test_smollm2_greedy_is_unchanged_by_a_truncated_draft(default_model_path, tmp_path):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kwargs = dict(block_size=16, num_gpu_blocks_override=32, max_model_len=256)
    base = LLM(model=default_model_path, **kwargs).generate(PROMPTS, params, use_tqdm=False)
    draft = truncate_layers(default_model_path, 2, tmp_path / "draft")
    spec_config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4}
    llm = LLM(model=default_model_path, speculative_config=spec_config, **kwargs)
    spec = llm.generate(PROMPTS, params, use_tqdm=False)
    for want, got in zip(base, spec, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids, want.prompt
        assert got.outputs[0].text == want.outputs[0].text
    stats = llm.engine.get_stats()
    assert stats.spec_decode_num_draft_tokens >= 4 * 2 * 3  # proposals at every verify step
    print(f"greedy acceptance of SmolLM2's first 2 layers: {stats.spec_decode_acceptance_rate}")
    kv = llm.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
