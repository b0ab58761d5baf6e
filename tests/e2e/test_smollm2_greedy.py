"""The real default model: a batch of 8 prompts of different lengths generated together gives,
token for token, transformers' 64 greedy tokens for each prompt alone (fp32)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve.engine import LLM, SamplingParams
from pagedserve.models.testing import transformers_greedy

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):",
    "List three colours:",
    "The theory of relativity, proposed by Albert Einstein in the early twentieth century, changed how physicists think about space and time because",
    "Q: What is 12 times 12?\nA:",
    "Paged attention is",
    "In Python, a list comprehension",
]


@pytest.mark.slow
def test_batch_of_eight_equals_transformers_greedy(default_model_path):
    llm = LLM(model=default_model_path, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    tokenizer = llm.get_tokenizer()
    for prompt, out in zip(PROMPTS, outputs, strict=True):
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
