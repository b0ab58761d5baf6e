"""vLLM's request fields through the official openai client (``extra_body``, as a vLLM user
sends them), against transformers where the values are the model's: prompt logprobs, echo with
logprobs, ``logprobs: 0``, beam search, token ids in responses, ``token_id:N`` logprob keys,
continuous usage, stream_options checks, EOS's null stop_reason, min_tokens holding back stop
strings, and vLLM's default max_tokens."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import openai
import pytest
import torch
from starlette.testclient import TestClient

from pagedserve.server.app import build_app
from pagedserve.server.config import ServerConfig
from pagedserve.server.logprobs import TokenNamer, prompt_logprobs
from pagedserve.server.testing import TINY_MODEL_NAME as MODEL
from pagedserve.server.testing import make_engine

X = 90  # the tiny tokenizer's "x"
EOS = 2
USER = [{"role": "user", "content": "Tell me about caches."}]


@pytest.fixture(scope="module")
def hf_model(tiny_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def oai(client):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)


def hf_log_softmax(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def test_prompt_logprobs_equal_transformers(oai, engine, hf_model):
    ids = engine.tokenizer.encode("Paged attention reads blocks")
    expected = hf_log_softmax(hf_model, ids)
    out = oai.completions.create(
        model=MODEL, prompt=ids, max_tokens=1, extra_body={"prompt_logprobs": 2}
    )
    prompt_logprobs = out.choices[0].model_extra["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(ids)
    for position in range(1, len(ids)):
        entry = prompt_logprobs[position]
        row = expected[position - 1]
        actual = entry[str(ids[position])]
        assert actual["logprob"] == pytest.approx(float(row[ids[position]]), abs=1e-4)
        top = row.topk(2)
        for rank, (token, value) in enumerate(zip(top.indices.tolist(), top.values.tolist())):
            assert entry[str(token)]["rank"] == rank + 1
            assert entry[str(token)]["logprob"] == pytest.approx(value, abs=1e-4)
            assert entry[str(token)]["decoded_token"] == engine.tokenizer.decode([token])
    chat = oai.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    chat_logprobs = chat.model_extra["prompt_logprobs"]
    assert chat_logprobs[0] is None and all(len(e) == 1 for e in chat_logprobs[1:])
    # streamed, the first chunk carries them (once)
    stream = oai.completions.create(
        model=MODEL, prompt=ids, max_tokens=2, stream=True, extra_body={"prompt_logprobs": 2}
    )
    carried = [c.choices[0].model_extra.get("prompt_logprobs") for c in stream if c.choices]
    assert carried[0] == prompt_logprobs and all(p is None for p in carried[1:])
    chunks = list(
        oai.chat.completions.create(
            model=MODEL,
            messages=USER,
            max_tokens=2,
            stream=True,
            extra_body={"prompt_logprobs": 0},
        )
    )
    assert chunks[0].model_extra["prompt_logprobs"] == chat_logprobs
    assert all(c.model_extra.get("prompt_logprobs") is None for c in chunks[1:])


def test_echo_with_logprobs_scores_the_prompt_then_the_completion(oai, engine, hf_model):
    prompt = "The cache holds"
    ids = engine.tokenizer.encode(prompt)
    out = oai.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1
    )
    choice = out.choices[0]
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 3
    assert lp.tokens[: len(ids)] == [engine.tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = hf_log_softmax(hf_model, ids)
    for position in range(1, len(ids)):
        want = float(expected[position - 1, ids[position]])
        assert lp.token_logprobs[position] == pytest.approx(want, abs=1e-4)
    assert lp.text_offset[0] == 0 and lp.text_offset[len(ids)] == len(prompt)
    streamed = oai.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1, stream=True
    )
    tokens = [t for c in streamed for ch in c.choices if ch.logprobs for t in ch.logprobs.tokens]
    assert tokens == lp.tokens


def test_logprobs_zero_still_shows_the_chosen_token(oai):
    out = oai.completions.create(model=MODEL, prompt="Hi", max_tokens=4, logprobs=0, seed=1)
    lp = out.choices[0].logprobs
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top == {token: value}


def test_max_logprobs_minus_one_allows_the_whole_vocabulary(tiny_path):
    engine = make_engine(tiny_path, max_logprobs=-1)
    try:
        http = TestClient(build_app(engine, ServerConfig(), MODEL))
        body = {"prompt": "Hi", "max_tokens": 1, "temperature": 0, "logprobs": 300}
        body["return_tokens_as_token_ids"] = True
        choice = http.post("/v1/completions", json=body).json()["choices"][0]
        assert len(choice["logprobs"]["top_logprobs"][0]) == 300  # the greedy token is in them
        body["logprobs"] = engine.model_config.vocab_size + 1
        assert http.post("/v1/completions", json=body).status_code == 400
    finally:
        asyncio.run(engine.shutdown())


def test_minus_one_asks_for_the_whole_vocabulary_with_every_prompt_tokens_rank(tiny_path, hf_model):
    """vLLM's test_chat_echo (prompt_logprobs: -1, top_logprobs: -1) under --max-logprobs -1:
    every prompt position lists the whole vocabulary, and the prompt's own token has its
    integer rank, which transformers' logits give independently (1 + the tokens above it)."""
    engine = make_engine(tiny_path, max_logprobs=-1)
    vocab = engine.model_config.vocab_size
    try:
        http = TestClient(build_app(engine, ServerConfig(), MODEL))
        oai = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http)
        ids = engine.tokenizer.encode("Paged attention reads blocks")
        completion = oai.completions.create(
            model=MODEL, prompt=ids, max_tokens=1, extra_body={"prompt_logprobs": -1}
        )
        positions = completion.choices[0].model_extra["prompt_logprobs"]
        expected = hf_log_softmax(hf_model, ids)
        assert positions[0] is None and len(positions) == len(ids)
        for position in range(1, len(ids)):
            entry, row, token = positions[position], expected[position - 1], ids[position]
            assert len(entry) == vocab
            assert sorted(e["rank"] for e in entry.values()) == list(range(1, vocab + 1))
            assert entry[str(token)]["rank"] == 1 + int((row > row[token] + 1e-5).sum())
        chat = oai.chat.completions.create(
            model=MODEL,
            messages=USER,
            max_tokens=1,
            logprobs=True,
            extra_body={"top_logprobs": -1, "prompt_logprobs": -1},
        )
        assert len(chat.choices[0].logprobs.content[0].top_logprobs) == vocab
        chat_positions = chat.model_extra["prompt_logprobs"]
        assert all(isinstance(e["rank"], int) for p in chat_positions[1:] for e in p.values())
    finally:
        asyncio.run(engine.shutdown())


@dataclass
class RankedLogprob:  # vLLM's Logprob: what an engine that ranks every prompt token hands over
    logprob: float
    rank: int | None = None


def test_a_prompt_token_outside_the_top_k_gets_its_integer_rank(oai, engine, hf_model):
    """vLLM's prompt_logprobs: the prompt's own token is listed with its rank (how many tokens
    are at least as likely) even where it is not among the top k."""
    ids = engine.tokenizer.encode("Paged attention reads blocks through a table")
    completion = oai.completions.create(
        model=MODEL, prompt=ids, max_tokens=1, extra_body={"prompt_logprobs": 1}
    )
    positions = completion.choices[0].model_extra["prompt_logprobs"]
    expected = hf_log_softmax(hf_model, ids)
    outside = 0
    for position in range(1, len(ids)):
        entry, row, token = positions[position], expected[position - 1], ids[position]
        rank = entry[str(token)]["rank"]
        assert isinstance(rank, int) and abs(rank - int((row >= row[token]).sum())) <= 1
        outside += rank > 1
    assert outside  # the random model ranks most prompt tokens far from the top


def test_the_engines_rank_of_a_prompt_token_outside_the_top_is_kept(engine):
    """vLLM gives a prompt token outside the top-k its integer rank; the server keeps an
    engine's rank where it gives one, and says null (unknown) only where it gives none."""
    name = TokenNamer(engine.tokenizer)
    ranked = [
        None,
        {5: RankedLogprob(-0.1, 1), 7: RankedLogprob(-0.5, 2), 9: RankedLogprob(-4.0, 23)},
    ]
    out = prompt_logprobs(name, ranked, 2)
    assert [out[1][t].rank for t in ("5", "7", "9")] == [1, 2, 23]
    unranked = [None, {5: -0.1, 7: -0.5, 9: -4.0}]
    out = prompt_logprobs(name, unranked, 2)
    assert [out[1][t].rank for t in ("5", "7", "9")] == [1, 2, None]
    assert out[1]["9"].logprob == -4.0 and out[1]["9"].decoded_token == engine.tokenizer.decode([9])


@pytest.mark.parametrize("field", ["prompt_logprobs", "top_logprobs"])
def test_minus_one_beyond_max_logprobs_and_other_negatives_are_400s(oai, field):
    args = dict(model=MODEL, messages=USER, max_tokens=1, logprobs=True)
    with pytest.raises(openai.BadRequestError) as refused:  # the engine's cap is 20
        oai.chat.completions.create(**args, extra_body={field: -1})
    assert refused.value.body["param"] == field
    assert "--max-logprobs -1" in refused.value.body["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        oai.chat.completions.create(**args, extra_body={field: -2})
    assert refused.value.body["message"] == f"`{field}` must be a positive value or -1."


def hf_beams(hf_model, ids, num_return, max_new, early_stopping=False, stops=(EOS,)):
    """transformers' beam search (3 beams), each answer cut after its first stop token."""
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([ids]),
            num_beams=3,
            num_return_sequences=num_return,
            do_sample=False,
            max_new_tokens=max_new,
            early_stopping=early_stopping,
            eos_token_id=list(stops),
            length_penalty=1.0,
            pad_token_id=0,
        )
    answers = [row[len(ids) :].tolist() for row in out]
    return [next((a[: i + 1] for i, t in enumerate(a) if t in stops), a) for a in answers]


def test_beam_search_equals_transformers(oai, engine, hf_model):
    ids = engine.tokenizer.encode("Blocks are")
    want = hf_beams(hf_model, ids, 2, 5)
    extra = {"use_beam_search": True, "best_of": 3, "return_token_ids": True}
    out = oai.completions.create(model=MODEL, prompt=ids, n=2, max_tokens=5, extra_body=extra)
    assert [c.model_extra["token_ids"] for c in out.choices] == want
    stream = oai.completions.create(
        model=MODEL, prompt=ids, n=2, max_tokens=5, stream=True, extra_body=extra
    )
    texts = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[i] for i in range(2)] == [c.text for c in out.choices]
    chat = oai.chat.completions.create(
        model=MODEL, messages=USER, n=2, max_tokens=4, extra_body={"use_beam_search": True}
    )
    assert len({c.message.content for c in chat.choices}) == 2  # two distinct beams


def test_beam_search_early_stopping_equals_transformers(oai, engine, hf_model):
    """A stop token ends hypotheses early, where the two early_stopping rules part ways."""
    ids, stops = engine.tokenizer.encode("Blocks are paged"), [449]
    answers = {}
    for early_stopping in (False, True):
        want = hf_beams(hf_model, ids, 3, 8, early_stopping, stops)
        extra = {"use_beam_search": True, "early_stopping": early_stopping, "ignore_eos": True}
        extra.update(stop_token_ids=stops, return_token_ids=True)
        out = oai.completions.create(model=MODEL, prompt=ids, n=3, max_tokens=8, extra_body=extra)
        assert [c.model_extra["token_ids"] for c in out.choices] == want
        answers[early_stopping] = want
    assert answers[False] != answers[True]  # the flag changed the search


def test_return_token_ids_and_tokens_as_ids(oai, engine):
    tok = engine.tokenizer
    extra = {"return_token_ids": True, "return_tokens_as_token_ids": True}
    out = oai.completions.create(
        model=MODEL, prompt="Hello", max_tokens=5, logprobs=1, seed=3, extra_body=extra
    )
    choice = out.choices[0]
    assert choice.model_extra["prompt_token_ids"] == tok.encode("Hello")
    token_ids = choice.model_extra["token_ids"]
    assert tok.decode(token_ids) == choice.text and len(token_ids) == 5
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in token_ids]
    stream = oai.completions.create(
        model=MODEL, prompt="Hello", max_tokens=5, seed=3, stream=True, extra_body=extra
    )
    chunks = [c.choices[0].model_extra for c in stream if c.choices]
    assert chunks[0]["prompt_token_ids"] == tok.encode("Hello")
    assert [t for c in chunks for t in c["token_ids"]] == token_ids

    chat = oai.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=4, logprobs=True, seed=2, extra_body=extra
    )
    ids = chat.choices[0].model_extra["token_ids"]
    assert chat.model_extra["prompt_token_ids"] == engine_chat_ids(engine)
    assert [e.token for e in chat.choices[0].logprobs.content] == [f"token_id:{t}" for t in ids]


def engine_chat_ids(engine) -> list[int]:
    from pagedserve.engine import apply_chat_template

    return apply_chat_template(engine.tokenizer, USER, True)


def test_continuous_usage_stats(oai):
    options = {"include_usage": True, "continuous_usage_stats": True}
    for create, kwargs in (
        (oai.completions.create, {"prompt": "Hello"}),
        (oai.chat.completions.create, {"messages": USER}),
    ):
        chunks = list(
            create(
                model=MODEL,
                max_tokens=6,
                seed=4,
                stream=True,
                stream_options=options,
                extra_body={"ignore_eos": True},
                **kwargs,
            )
        )
        assert all(c.usage is not None for c in chunks)
        counts = [c.usage.completion_tokens for c in chunks]
        assert counts == sorted(counts) and counts[-1] == 6
        assert chunks[-1].choices == [] and counts[-2] == 6


def test_stream_options_without_stream_is_a_400(oai):
    with pytest.raises(openai.BadRequestError) as error:
        oai.completions.create(
            model=MODEL, prompt="x", max_tokens=1, stream_options={"include_usage": True}
        )
    assert error.value.body["param"] == "stream_options"


def test_stop_reason_is_null_on_eos_and_the_id_of_a_stop_token(oai):
    eos = oai.completions.create(model=MODEL, prompt="x", max_tokens=4, logit_bias={str(EOS): 100})
    assert (eos.choices[0].finish_reason, eos.choices[0].model_extra["stop_reason"]) == (
        "stop",
        None,
    )
    stop = oai.completions.create(
        model=MODEL,
        prompt="x",
        max_tokens=4,
        logit_bias={str(X): 100},
        extra_body={"stop_token_ids": [X]},
    )
    assert stop.choices[0].model_extra["stop_reason"] == X


def test_min_tokens_holds_back_stop_strings(oai):
    forced = dict(model=MODEL, prompt="a", max_tokens=8, logit_bias={str(X): 100}, stop=["x"])
    early = oai.completions.create(**forced)
    assert early.usage.completion_tokens == 1 and early.choices[0].text == ""
    held = oai.completions.create(**forced, extra_body={"min_tokens": 3})
    assert held.usage.completion_tokens == 3
    assert held.choices[0].text == "xx" and held.choices[0].model_extra["stop_reason"] == "x"


def test_default_max_tokens_as_vllm(oai, engine):
    free = {"ignore_eos": True}
    completion = oai.completions.create(model=MODEL, prompt="Hello", seed=1, extra_body=free)
    assert completion.usage.completion_tokens == 16
    chat = oai.chat.completions.create(model=MODEL, messages=USER, seed=1, extra_body=free)
    room = engine.scheduler_config.max_model_len - chat.usage.prompt_tokens
    assert chat.usage.completion_tokens == room
    null = oai.completions.create(
        model=MODEL, prompt=[5] * 240, seed=1, extra_body={**free, "max_tokens": None}
    )
    assert null.usage.completion_tokens == 16  # an explicit null: all the room (256 - 240)
    long = oai.completions.create(model=MODEL, prompt=[5] * 250, seed=1, extra_body=free)
    assert long.usage.completion_tokens == 6  # the default 16, capped by the room, not refused


def test_tokenize_token_strs_tokenizer_info_and_request_ids(client, engine):
    data = client.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True})
    assert data.json()["token_strs"] == ["he", "l", "lo", "Ġworld"]
    assert client.get("/tokenizer_info").status_code == 404  # off unless enabled, as vLLM
    assert "x-request-id" not in client.get("/health").headers
    config = ServerConfig(enable_tokenizer_info_endpoint=True, enable_request_id_headers=True)
    other = TestClient(build_app(engine, config, MODEL))
    info = other.get("/tokenizer_info").json()
    assert info["tokenizer_class"] == type(engine.tokenizer).__name__
    assert info["chat_template"] == engine.tokenizer.chat_template
    assert info["added_tokens_decoder"][str(EOS)]["special"] is True
    sent = other.post("/tokenize", json={"prompt": "hi"}, headers={"X-Request-Id": "abc-123"})
    assert sent.headers["x-request-id"] == "abc-123"
    made = other.get("/v1/models").headers["x-request-id"]
    assert len(made) == 32 and made != other.get("/v1/models").headers["x-request-id"]
