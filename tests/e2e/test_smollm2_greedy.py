"""The real default model: a batch of 8 prompts of different lengths generated together gives,
token for token, transformers' 64 greedy tokens for each prompt alone (fp32). The batch is
generated once per session (tests/e2e/conftest.py): the numba and preemption tests reuse it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve.engine import LLM, SamplingParams
from pagedserve.models.testing import transformers_greedy


@pytest.mark.slow
def test_batch_of_eight_equals_transformers_greedy(default_model_path, smollm2_greedy_batch):
    outputs, tokenizer = smollm2_greedy_batch  # generated together, 64 tokens each
    hf = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    for prompt, out in outputs.items():
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        assert out.prompt_token_ids == ids[0].tolist()
        ref = transformers_greedy(hf, ids[0].tolist(), 64)
        assert out.outputs[0].token_ids == ref, prompt
        assert out.outputs[0].text == tokenizer.decode(ref, skip_special_tokens=True)


@pytest.mark.slow
def test_chat_answers_coherently(default_model_path):
    llm = LLM(model=default_model_path)
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=24),
        use_tqdm=False,
    )[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # <|im_end|> ends the answer
