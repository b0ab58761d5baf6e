"""The pooling routes over tiny pooling models: /v1/embeddings (strings, token ids, lists of
either; float and base64; through the official openai client), /pooling, /classify, /score
(1:1, 1:N, N:N), /rerank and /v1/rerank, with usage and errors in OpenAI's shape; a chat route
on a pooling model and an embedding route on a generative one are 400s naming the model."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import openai
import pytest
import torch
from starlette.testclient import TestClient

from pagedserve.engine import LLM, AsyncLLM, EngineArgs
from pagedserve.server.app import build_app
from pagedserve.server.config import ServerConfig

TEXTS = ["Paged attention reads a block table.", "Hello, world!", "What is a prefix cache?"]
FP32 = dict(atol=1e-5, rtol=1.3e-6)


def _client(path: str):
    engine = AsyncLLM(EngineArgs(model=path))
    return engine, TestClient(build_app(engine, ServerConfig(), "m"), raise_server_exceptions=False)


@pytest.fixture(scope="module")
def embedder(tiny_pooling_checkpoint):
    path = tiny_pooling_checkpoint("bert")
    engine, client = _client(path)
    yield path, client
    asyncio.run(engine.shutdown())


@pytest.fixture(scope="module")
def reranker(tiny_pooling_checkpoint):
    path = tiny_pooling_checkpoint("bert_cross_encoder")
    engine, client = _client(path)
    yield path, client
    asyncio.run(engine.shutdown())


def _vectors(response) -> torch.Tensor:
    assert response.status_code == 200, response.text
    return torch.tensor([item["embedding"] for item in response.json()["data"]])


def test_embeddings_of_every_input_shape_equal_the_offline_engine(embedder):
    path, client = embedder
    offline = LLM(model=path)
    expected = torch.stack([o.outputs.data for o in offline.embed(TEXTS, use_tqdm=False)])
    ids = [offline.tokenizer.encode(t) for t in TEXTS]
    for given in (TEXTS, ids):
        response = client.post("/v1/embeddings", json={"model": "m", "input": given})
        torch.testing.assert_close(_vectors(response), expected, **FP32)
    body = client.post("/v1/embeddings", json={"input": ids[0]}).json()
    assert body["object"] == "list" and body["data"][0]["object"] == "embedding"
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == len(ids[0])
    torch.testing.assert_close(torch.tensor(body["data"][0]["embedding"]), expected[0], **FP32)
    single = client.post("/v1/embeddings", json={"input": TEXTS[1]}).json()
    assert single["model"] == "m" and len(single["data"]) == 1


def test_base64_and_the_openai_client(embedder):
    path, client = embedder
    floats = _vectors(client.post("/v1/embeddings", json={"input": TEXTS}))
    encoded = client.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": "base64"})
    decoded = [
        np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in encoded.json()["data"]
    ]
    torch.testing.assert_close(torch.from_numpy(np.stack(decoded)), floats, **FP32)
    oai = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)
    result = oai.embeddings.create(model="m", input=TEXTS)  # the client asks for base64
    torch.testing.assert_close(torch.tensor([d.embedding for d in result.data]), floats, **FP32)
    assert result.usage.prompt_tokens > 0


def test_pooling_and_score_on_an_embedding_model(embedder):
    path, client = embedder
    floats = _vectors(client.post("/v1/embeddings", json={"input": TEXTS}))
    pooled = client.post("/pooling", json={"input": TEXTS}).json()
    torch.testing.assert_close(torch.tensor([d["data"] for d in pooled["data"]]), floats, **FP32)
    scores = client.post("/score", json={"text_1": TEXTS[0], "text_2": TEXTS}).json()
    expected = torch.nn.functional.cosine_similarity(floats[:1], floats)
    got = torch.tensor([d["score"] for d in scores["data"]])
    torch.testing.assert_close(got, expected, **FP32)


def test_errors_name_what_is_wrong(embedder, client):
    _, pooled = embedder
    response = pooled.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "model"
    assert "pooling model" in response.json()["error"]["message"]
    response = client.post("/v1/embeddings", json={"input": "hi"})  # the tiny generative model
    assert response.status_code == 400 and "--runner pooling" in response.json()["error"]["message"]
    for body, param in [
        ({"input": "hi", "dimensions": 8}, "dimensions"),  # not a Matryoshka model
        ({"input": "hi", "cache_salt": "s"}, "cache_salt"),
        ({"input": "hi", "embed_dtype": "float16"}, "embed_dtype"),
        ({"input": "hi", "padding": "max_length"}, "padding"),
        ({"input": []}, "input"),
        ({"input": " ".join(["word"] * 200)}, "prompt"),  # past max_seq_length (96)
    ]:
        response = pooled.post("/v1/embeddings", json=body)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["param"] == param, response.json()
    response = pooled.post("/classify", json={"input": "hi"})
    assert response.status_code == 400 and "embedding model" in response.json()["error"]["message"]
    truncated = pooled.post(
        "/v1/embeddings", json={"input": " ".join(["word"] * 200), "truncate_prompt_tokens": 12}
    )
    assert truncated.json()["usage"]["prompt_tokens"] == 12


def _cross_encoder_scores(path: str, query: str, docs: list[str]) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    tokens = AutoTokenizer.from_pretrained(path)(
        [query] * len(docs), docs, padding=True, return_tensors="pt"
    )
    with torch.no_grad():
        return torch.sigmoid(model(**tokens).logits[:, 0])


def test_score_one_to_one_one_to_many_and_many_to_many(reranker):
    path, client = reranker
    expected = _cross_encoder_scores(path, TEXTS[2], TEXTS)
    for body in (
        {"text_1": TEXTS[2], "text_2": TEXTS},
        {"queries": [TEXTS[2]] * 3, "documents": TEXTS},
        {"data_1": TEXTS[2], "data_2": TEXTS},
    ):
        response = client.post("/score", json=body)
        assert response.status_code == 200, response.text
        got = torch.tensor([d["score"] for d in response.json()["data"]])
        torch.testing.assert_close(got, expected, **FP32)
    one = client.post("/v1/score", json={"text_1": TEXTS[2], "text_2": TEXTS[0]}).json()
    assert one["data"][0]["score"] == pytest.approx(float(expected[0]), abs=1e-5)
    bad = client.post("/score", json={"text_1": TEXTS[:2], "text_2": TEXTS})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_2"


def test_rerank_orders_documents_by_the_cross_encoders_score(reranker):
    path, client = reranker
    expected = _cross_encoder_scores(path, TEXTS[2], TEXTS)
    order = expected.argsort(descending=True).tolist()
    for route in ("/rerank", "/v1/rerank"):
        body = client.post(route, json={"query": TEXTS[2], "documents": TEXTS}).json()
        assert [r["index"] for r in body["results"]] == order
        assert [r["document"]["text"] for r in body["results"]] == [TEXTS[i] for i in order]
        got = torch.tensor([r["relevance_score"] for r in body["results"]])
        torch.testing.assert_close(got, expected[order], **FP32)
        assert body["usage"]["total_tokens"] > 0
    top = client.post(
        "/rerank",
        json={"query": TEXTS[2], "documents": TEXTS, "top_n": 2, "return_documents": False},
    ).json()
    assert [r["index"] for r in top["results"]] == order[:2]
    assert all("document" not in r for r in top["results"])


def test_classify_on_a_cross_encoder(reranker):
    path, client = reranker
    body = client.post("/classify", json={"input": TEXTS}).json()
    assert [d["num_classes"] for d in body["data"]] == [1, 1, 1]
    assert all(0.0 < d["probs"][0] < 1.0 for d in body["data"])  # one class: the sigmoid
    response = client.post("/v1/embeddings", json={"input": "hi"})
    assert response.status_code == 400 and "classifier" in response.json()["error"]["message"]
