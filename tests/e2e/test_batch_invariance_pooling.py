"""``--batch-invariant`` on pooling models: a request's embedding or class scores are the same
bits alone and inside any batch.

A target prompt runs alone on a fresh engine, then among 2 and 16 random others (the encoders:
sequences of the target's length among them, which the default attention stacks into one call);
a decoder's also in chunks of 7 tokens, where its mean is folded across chunks. Every output
must equal the alone run's with ``torch.equal``. Without the mode, the decoder mean-embedder's
chunked and batched runs differ (the teeth, docs/batch_invariance.md).
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch

from pagedserve.engine import LLM
from pagedserve.models.testing import TINY_VOCAB
from pagedserve.models.testing_pooling import write_sentence_transformers_files

TARGET_LEN = 29


def mean_decoder(tiny_checkpoint, tmp_path_factory) -> str:
    """The tiny Llama with sentence-transformers files that say: mean of every row."""
    path = Path(tmp_path_factory.mktemp("mean_decoder")) / "model"
    shutil.copytree(tiny_checkpoint("llama"), path)
    write_sentence_transformers_files(path, 64, "mean")
    return str(path)


def pooled(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Each prompt's output (an embedding, or class scores) through the model's task."""
    inputs = [{"prompt_token_ids": p} for p in prompts]
    task = llm.engine.model_config.pooling_task
    run = llm.embed if task == "embed" else llm.classify
    return [o.outputs.data for o in run(inputs, use_tqdm=False)]


def differences(path: str, batch_invariant: bool, decoder: bool, **options) -> list[str]:
    """The scenarios where the target's output differs from its alone run's."""
    rng = random.Random(0)
    target = [rng.randrange(3, TINY_VOCAB) for _ in range(TARGET_LEN)]
    kw = dict(batch_invariant=batch_invariant, block_size=8, **options)
    alone = pooled(LLM(model=path, **kw), [target])[0]
    engines = {f"batch of {n}": (LLM(model=path, **kw), n) for n in (2, 16)}
    if decoder:
        chunked = LLM(model=path, max_num_batched_tokens=7, enable_prefix_caching=False, **kw)
        engines["chunks of 7"] = (chunked, 5)
    found = []
    for name, (llm, n) in engines.items():
        others = [
            [rng.randrange(3, TINY_VOCAB) for _ in range(rng.choice([TARGET_LEN, 9, 40]))]
            for _ in range(n)
        ]
        at = rng.randrange(n + 1)
        got = pooled(llm, others[:at] + [target] + others[at:])[at]
        if not torch.equal(got, alone):
            found.append(name)
    return found


@pytest.mark.parametrize("arch", ["bert", "xlm_roberta", "bert_cross_encoder"])
def test_encoders_give_the_same_bits_in_any_batch(tiny_pooling_checkpoint, arch):
    assert differences(tiny_pooling_checkpoint(arch), True, decoder=False) == []


def test_decoder_poolers_give_the_same_bits_in_any_batch(
    tiny_checkpoint, tiny_pooling_checkpoint, tmp_path_factory
):
    """Mean of every row (folded across chunks), the last row (an embedder and a classifier)."""
    mean = mean_decoder(tiny_checkpoint, tmp_path_factory)
    assert differences(mean, True, decoder=True, convert="embed") == []
    assert differences(tiny_checkpoint("qwen3"), True, decoder=True, convert="embed") == []
    assert differences(tiny_pooling_checkpoint("llama_classifier"), True, decoder=True) == []


def test_without_the_mode_a_mean_embedding_follows_its_batch(tiny_checkpoint, tmp_path_factory):
    mean = mean_decoder(tiny_checkpoint, tmp_path_factory)
    found = differences(mean, False, decoder=True, convert="embed")
    assert "chunks of 7" in found, found
