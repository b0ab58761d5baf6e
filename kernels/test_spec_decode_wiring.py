"""Speculative decoding on the Triton path equals the reference path, token for token, and
reaches the rejection-sampling kernel (greedy and seeded sampling rows in one batch)."""

from __future__ import annotations

import importlib

import pytest

from pagedserve.engine import LLM, SamplingParams
from pagedserve.models.testing import make_tiny_checkpoint

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 2,
}
PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8] * 4}, {"prompt_token_ids": [40, 41, 42] * 5}]


def _generate(path: str, monkeypatch, kernels: str) -> tuple[list[list[int]], int]:
    monkeypatch.setenv("PAGEDSERVE_KERNELS", kernels)
    llm = LLM(model=path, block_size=8, num_gpu_blocks_override=32, speculative_config=NGRAM)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    seeded = SamplingParams(temperature=0.2, seed=3, max_tokens=10, ignore_eos=True)
    outputs = llm.generate(PROMPTS, [greedy, seeded], use_tqdm=False)
    stats = llm.engine.get_stats()
    return [o.outputs[0].token_ids for o in outputs], stats.spec_decode_num_accepted_tokens


@pytest.mark.slow
def test_triton_path_verifies_like_the_reference(tmp_path, monkeypatch):
    path = str(make_tiny_checkpoint("llama", tmp_path / "llama"))
    module = importlib.import_module("pagedserve.kernels.rejection_sample")
    calls = []
    original = module.rejection_sample_triton

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, "rejection_sample_triton", spy)
    reference, accepted = _generate(path, monkeypatch, "ref")
    assert not calls and accepted > 0
    triton, _ = _generate(path, monkeypatch, "triton")
    assert calls
    assert triton == reference
