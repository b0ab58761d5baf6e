"""SmolLM2's greedy batch, generated once per session: test_smollm2_greedy.py holds it equal to
transformers, and the numba and preemption tests compare their runs with it instead of
generating (or running transformers) again."""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest

SMOLLM2_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):",
    "List three colours:",
    "The theory of relativity, proposed by Albert Einstein in the early twentieth century, changed how physicists think about space and time because",
    "Q: What is 12 times 12?\nA:",
    "Paged attention is",
    "In Python, a list comprehension",
]


class GreedyBatch(NamedTuple):
    outputs: dict[str, Any]  # prompt -> its RequestOutput
    tokenizer: Any


@pytest.fixture(scope="session")
def smollm2_greedy_batch(default_model_path):
    """The 8 prompts generated together, 64 greedy tokens each, on the CPU engine's numba
    attention path (block size 16)."""
    from pagedserve.engine import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PAGEDSERVE_KERNELS", "numba")
        llm = LLM(model=default_model_path, block_size=16)
        outputs = llm.generate(SMOLLM2_PROMPTS, params, use_tqdm=False)
    return GreedyBatch(dict(zip(SMOLLM2_PROMPTS, outputs, strict=True)), llm.get_tokenizer())
