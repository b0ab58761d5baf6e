"""`pagedserve serve` with no model serves SmolLM2-135M-Instruct (what `make serve` runs); the
official openai client's greedy chat reply equals transformers' on the same weights."""

from __future__ import annotations

import openai
import pytest
import torch

from pagedserve.models.testing import transformers_greedy
from pagedserve.server.testing import live_server

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.slow
def test_default_model_chat_equals_transformers(default_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    expected = tokenizer.decode(transformers_greedy(model, ids, 16), skip_special_tokens=True)
    del model

    with live_server(None, "--max-model-len", "1024") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list()] == ["SmolLM2-135M-Instruct"]
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=MESSAGES,
            max_completion_tokens=16,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    assert reply.choices[0].message.content == expected
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == 16
    assert "Paris" in expected  # the real model, converted correctly, not random weights
