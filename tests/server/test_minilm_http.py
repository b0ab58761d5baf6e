"""all-MiniLM-L6-v2 served over /v1/embeddings and read with the official openai client: its
embeddings of 100 varied sentences have cosine >= 0.99999 with sentence-transformers' own."""

from __future__ import annotations

import asyncio

import openai
import torch
from starlette.testclient import TestClient

from pagedserve.engine import AsyncLLM, EngineArgs
from pagedserve.models.testing_pooling import sentence_corpus
from pagedserve.server.app import build_app
from pagedserve.server.config import ServerConfig


def test_minilm_over_http_matches_sentence_transformers(minilm_path):
    from sentence_transformers import SentenceTransformer

    sentences = sentence_corpus(100, seed=2)
    expected = torch.from_numpy(SentenceTransformer(minilm_path, device="cpu").encode(sentences))
    engine = AsyncLLM(EngineArgs(model=minilm_path))
    try:
        app = build_app(engine, ServerConfig(), "all-MiniLM-L6-v2")
        client = TestClient(app, raise_server_exceptions=False)
        oai = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)
        result = oai.embeddings.create(model="all-MiniLM-L6-v2", input=sentences)
    finally:
        asyncio.run(engine.shutdown())
    ours = torch.tensor([item.embedding for item in result.data])
    assert [item.index for item in result.data] == list(range(100))
    cosine = torch.nn.functional.cosine_similarity(ours, expected, dim=1)
    assert cosine.min() >= 0.99999, cosine.min()
    assert result.usage.prompt_tokens == result.usage.total_tokens > 100
