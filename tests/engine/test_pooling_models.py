"""Pooling models through the engine equal transformers / sentence-transformers at fp32
tolerance: BERT and XLM-RoBERTa embedders (mean and CLS pooling, as their sentence-transformers
files say), a BERT cross-encoder's scores, a decoder converted to an embedder (last token,
chunked over the paged cache, from a cached prefix too) and a decoder classifier."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine import LLM, InvalidRequestError, PoolingParams

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention reads keys and values through a block table.",
    "Hello, world!",
    "def add(a, b): return a + b",
    "Prefix caching hashes full blocks as a chain, so a later request with the same prefix "
    "reuses them; continuous batching admits new requests at every step.",
]
FP32 = dict(atol=1e-5, rtol=1.3e-6)


def _sentence_transformers(path: str, texts: list[str]) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(path, device="cpu")
    return torch.from_numpy(model.encode(texts, batch_size=2))


@pytest.mark.parametrize(
    "arch,pooling", [("bert", "mean"), ("bert", "cls"), ("xlm_roberta", "mean")]
)
def test_encoder_embeddings_equal_sentence_transformers(tiny_pooling_checkpoint, arch, pooling):
    path = tiny_pooling_checkpoint(arch, pooling=pooling)
    llm = LLM(model=path, max_num_seqs=3)  # several steps, several sequences per step
    ours = torch.stack([o.outputs.data for o in llm.embed(SENTENCES, use_tqdm=False)])
    torch.testing.assert_close(ours, _sentence_transformers(path, SENTENCES), **FP32)
    assert llm.engine.kv_cache_manager.num_blocks == 0  # an encoder has no KV cache
    assert llm.engine.runner.kv_caches == []


def test_cross_encoder_scores_equal_transformers(tiny_pooling_checkpoint):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = tiny_pooling_checkpoint("bert_cross_encoder")
    query, docs = "what is paged attention?", SENTENCES
    scores = [o.outputs.score for o in LLM(model=path).score(query, docs, use_tqdm=False)]
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    tokens = AutoTokenizer.from_pretrained(path)(
        [query] * len(docs), docs, padding=True, return_tensors="pt"
    )
    with torch.no_grad():
        expected = torch.sigmoid(model(**tokens).logits[:, 0])
    torch.testing.assert_close(torch.tensor(scores), expected, **FP32)


def test_decoder_classifier_equals_transformers(tiny_pooling_checkpoint):
    from transformers import AutoModelForSequenceClassification

    path = tiny_pooling_checkpoint("llama_classifier")
    llm = LLM(model=path, block_size=8, max_num_batched_tokens=16)  # long prompts chunked
    prompts = [list(range(5, 45)), [100, 200, 300], list(range(60, 79))]
    outputs = llm.classify([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    for prompt, output in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            expected = torch.softmax(model(torch.tensor([prompt])).logits[0], dim=-1)
        torch.testing.assert_close(output.outputs.data, expected, **FP32)
    assert llm.engine.model_config.pooling_task == "classify"


def test_decoder_embedder_equals_transformers_chunked_and_cached(tiny_checkpoint):
    from transformers import AutoModel

    path = tiny_checkpoint("qwen3", matryoshka_dimensions=[16, 32])
    llm = LLM(model=path, convert="embed", block_size=8, max_num_batched_tokens=16)
    shared = list(range(5, 29))
    prompts = [shared + [40, 41, 42], list(range(100, 140)), shared + [50]]  # 3rd: cached prefix
    outputs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    model = AutoModel.from_pretrained(path).eval()
    for prompt, output in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            last = model(torch.tensor([prompt])).last_hidden_state[0, -1]
        torch.testing.assert_close(
            output.outputs.data, torch.nn.functional.normalize(last, dim=0), **FP32
        )
    assert outputs[2].num_cached_tokens > 0
    assert llm.engine.kv_cache_manager.usage() == 0.0  # nothing held once they finished
    cut = llm.embed({"prompt_token_ids": prompts[0]}, PoolingParams(dimensions=16), use_tqdm=False)
    expected = torch.nn.functional.normalize(outputs[0].outputs.data[:16], dim=0)
    # Matryoshka: the first 16 values, normalised again
    torch.testing.assert_close(cut[0].outputs.data, expected, **FP32)
    with pytest.raises(InvalidRequestError, match="dimensions"):
        llm.embed("hi", PoolingParams(dimensions=20), use_tqdm=False)


def test_pooling_and_generative_requests_are_refused_by_the_other_kind(
    tiny_checkpoint, tiny_pooling_checkpoint
):
    from pagedserve.engine import SamplingParams

    with pytest.raises(InvalidRequestError, match="pooling model"):
        LLM(model=tiny_checkpoint("llama")).embed("hello", use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="generates no text"):
        LLM(model=tiny_pooling_checkpoint("bert")).generate("hello", SamplingParams(max_tokens=2))


def test_truncate_prompt_tokens_and_too_long_prompts(tiny_pooling_checkpoint):
    llm = LLM(model=tiny_pooling_checkpoint("bert"))
    long_text = " ".join(["paged attention"] * 80)  # > max_seq_length (96) tokens
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        llm.embed(long_text, use_tqdm=False)
    out = llm.embed(long_text, truncate_prompt_tokens=10, use_tqdm=False)[0]
    assert len(out.prompt_token_ids) == 10
    assert out.prompt_token_ids[0] == 2 and out.prompt_token_ids[-1] == 3  # [CLS] ... [SEP] kept


def test_an_offline_call_of_more_prompts_than_the_waiting_cap_runs_them_all(
    tiny_checkpoint, tiny_pooling_checkpoint
):
    """max_num_waiting is a server's load-shedding cap (a 503); LLM.generate and LLM.embed
    hold the prompts the queue has no room for and add them as steps make room, in order."""
    from pagedserve.engine import SamplingParams

    path = tiny_checkpoint("llama")
    prompts = [{"prompt_token_ids": [1 + i, 2 + i, 3]} for i in range(9)]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    roomy = LLM(model=path).generate(prompts, params, use_tqdm=False)
    capped = LLM(model=path, max_num_waiting=2, max_num_seqs=2)
    outputs = capped.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in roomy]
    assert not capped.engine.has_unfinished_requests()

    encoder = tiny_pooling_checkpoint("bert")
    texts = [f"sentence number {i}" for i in range(7)]
    alone = LLM(model=encoder).embed(texts, use_tqdm=False)
    capped_embed = LLM(model=encoder, max_num_waiting=2, max_num_seqs=1).embed(
        texts, use_tqdm=False
    )
    for a, b in zip(alone, capped_embed, strict=True):
        assert torch.allclose(
            torch.as_tensor(a.outputs.embedding), torch.as_tensor(b.outputs.embedding), atol=1e-5
        )
