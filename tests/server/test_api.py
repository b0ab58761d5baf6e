"""The API surface in-process: greedy output equals transformers, streamed equals non-streamed,
n / several prompts / echo / stop / max_tokens-that-fits, tokenize, models, health, metrics."""

from __future__ import annotations

import json

import pytest
import torch

from pagedserve.models.testing import transformers_greedy
from pagedserve.server.testing import TINY_MODEL_NAME as MODEL_NAME

COMP = "/v1/completions"
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def hf_model(tiny_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(engine):
    return engine.tokenizer


def sse_events(text: str) -> list:
    """The JSON payloads of an SSE body, with the final [DONE] checked and dropped."""
    lines = [line[len("data: ") :] for line in text.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def streamed_texts(events: list, key) -> dict[int, str]:
    texts: dict[int, str] = {}
    for event in events:
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + (key(choice) or "")
    return texts


def test_completion_greedy_equals_transformers(client, hf_model, tokenizer):
    prompt = "Paged attention reads keys and values"
    ids = tokenizer.encode(prompt)
    expected = tokenizer.decode(transformers_greedy(hf_model, ids, 12), skip_special_tokens=True)
    for body_prompt in (prompt, ids):
        body = {"prompt": body_prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        response = client.post(COMP, json=body)
        assert response.status_code == 200, response.text
        data = response.json()
        assert data["object"] == "text_completion" and data["model"] == MODEL_NAME
        assert data["id"].startswith("cmpl-") and isinstance(data["created"], int)
        assert data["choices"][0]["text"] == expected
        assert data["choices"][0]["finish_reason"] == "length"
        assert data["usage"] == {
            "prompt_tokens": len(ids),
            "completion_tokens": 12,
            "total_tokens": len(ids) + 12,
        }


def test_chat_greedy_equals_transformers(client, hf_model, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    expected = tokenizer.decode(transformers_greedy(hf_model, ids, 10), skip_special_tokens=True)
    body = {"messages": messages, "max_completion_tokens": 10, "temperature": 0, "ignore_eos": True}
    data = client.post(CHAT, json=body).json()
    assert data["object"] == "chat.completion"
    assert data["choices"][0]["message"] == {"role": "assistant", "content": expected}
    assert data["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize("stop", [None, ["e"], ["o w", "the"]])
def test_completion_streamed_equals_non_streamed(client, stop):
    body = {"prompt": ["The quick brown", "Hello"], "n": 2, "max_tokens": 24, "temperature": 1.0}
    body.update(seed=7, stop=stop, ignore_eos=True)
    whole = client.post(COMP, json=body).json()
    streamed = client.post(
        COMP, json={**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = sse_events(streamed.text)
    texts = streamed_texts(events, lambda c: c["text"])
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    finishes = {
        c["index"]: c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]
    }
    assert finishes == {c["index"]: c["finish_reason"] for c in whole["choices"]}
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]
    if stop:
        assert all(s not in c["text"] for c in whole["choices"] for s in stop)


def test_chat_streamed_equals_non_streamed(client):
    body = {"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 20}
    body.update(temperature=0.8, seed=3, n=2, stop=["a"])
    whole = client.post(CHAT, json=body).json()
    events = sse_events(client.post(CHAT, json={**body, "stream": True}).text)
    assert all(
        e["object"] == "chat.completion.chunk" and e["id"] == events[0]["id"] for e in events
    )
    assert [e["choices"][0]["delta"] for e in events[:2]] == [
        {"role": "assistant", "content": ""}
    ] * 2
    texts = streamed_texts(events, lambda c: c["delta"].get("content"))
    assert texts == {c["index"]: c["message"]["content"] for c in whole["choices"]}
    assert all(e.get("usage") is None for e in events)  # no include_usage, no usage chunk


def test_n_choices(client):
    """Greedy choices all equal the single greedy completion; seeded sampled choices repeat
    from call to call, and differ from each other."""
    body = {"prompt": "Once", "max_tokens": 8, "ignore_eos": True}
    single = client.post(COMP, json={**body, "temperature": 0}).json()["choices"][0]["text"]
    greedy = client.post(COMP, json={**body, "temperature": 0, "n": 3}).json()
    assert [c["index"] for c in greedy["choices"]] == [0, 1, 2]
    assert [c["text"] for c in greedy["choices"]] == [single] * 3
    assert greedy["usage"]["completion_tokens"] == 3 * 8
    sampled = {**body, "temperature": 1.5, "n": 3, "seed": 100}
    first = client.post(COMP, json=sampled).json()["choices"]
    again = client.post(COMP, json=sampled).json()["choices"]
    assert first == again
    assert len({c["text"] for c in first}) > 1


def hf_logprobs(hf_model, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax over the vocabulary at each generated position."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt_ids + output_ids])).logits[0].float()
    start = len(prompt_ids) - 1
    return torch.log_softmax(logits[start : start + len(output_ids)], dim=-1)


def test_completion_logprobs_equal_transformers(client, hf_model, tokenizer):
    ids = tokenizer.encode("Continuous batching admits")
    output = transformers_greedy(hf_model, ids, 6)
    expected = hf_logprobs(hf_model, ids, output)
    body = {"prompt": ids, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 3}
    logprobs = client.post(COMP, json=body).json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [tokenizer.decode([t]) for t in output]
    for step, token in enumerate(output):
        assert logprobs["token_logprobs"][step] == pytest.approx(
            float(expected[step, token]), abs=1e-4
        )
        top = expected[step].topk(3)
        reference: dict[str, float] = {}  # keyed by text: the likelier of two alike ids wins
        for token_id, value in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            reference.setdefault(tokenizer.decode([token_id]), value)
        assert logprobs["top_logprobs"][step] == pytest.approx(reference, abs=1e-4)
    offsets = [sum(len(t) for t in logprobs["tokens"][:i]) for i in range(6)]
    assert logprobs["text_offset"] == offsets
    streamed = sse_events(client.post(COMP, json={**body, "stream": True}).text)
    tokens = [
        t for e in streamed for c in e["choices"] if c["logprobs"] for t in c["logprobs"]["tokens"]
    ]
    assert tokens == logprobs["tokens"]


def test_chat_logprobs_equal_transformers(client, hf_model, tokenizer):
    messages = [{"role": "user", "content": "Hi"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    output = transformers_greedy(hf_model, ids, 5)
    expected = hf_logprobs(hf_model, ids, output)
    body = {"messages": messages, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    body.update(logprobs=True, top_logprobs=2)
    content = client.post(CHAT, json=body).json()["choices"][0]["logprobs"]["content"]
    assert [entry["token"] for entry in content] == [tokenizer.decode([t]) for t in output]
    for step, (entry, token) in enumerate(zip(content, output, strict=True)):
        assert entry["logprob"] == pytest.approx(float(expected[step, token]), abs=1e-4)
        assert entry["bytes"] == list(entry["token"].encode())
        top = [t["logprob"] for t in entry["top_logprobs"]]
        assert top == pytest.approx(expected[step].topk(2).values.tolist(), abs=1e-4)


def test_several_prompts_echo_and_index_order(client):
    prompts = ["Hello", "The quick brown fox"]
    body = {"prompt": prompts, "max_tokens": 5, "temperature": 0, "echo": True, "n": 2}
    choices = client.post(COMP, json=body).json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for p, prompt in enumerate(prompts):
        alone = client.post(COMP, json={"prompt": prompt, "max_tokens": 5, "temperature": 0}).json()
        for j in range(2):
            assert choices[p * 2 + j]["text"] == prompt + alone["choices"][0]["text"]


def test_max_tokens_defaults_to_what_fits(client):
    body = {"prompt": [5] * 250, "temperature": 0, "ignore_eos": True}
    data = client.post(COMP, json=body).json()
    assert data["usage"]["completion_tokens"] == 256 - 250
    assert data["choices"][0]["finish_reason"] == "length"


def test_tokenize_and_detokenize(client, tokenizer):
    text = "Hello, world! 你好"
    data = client.post("/tokenize", json={"prompt": text}).json()
    assert data["tokens"] == tokenizer.encode(text) and data["count"] == len(data["tokens"])
    assert data["max_model_len"] == 256
    assert client.post("/detokenize", json={"tokens": data["tokens"]}).json() == {
        "prompt": tokenizer.decode(data["tokens"])
    }
    messages = [{"role": "user", "content": "Hi"}]
    chat = client.post("/tokenize", json={"messages": messages}).json()
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert chat["tokens"] == list(expected["input_ids"] if hasattr(expected, "keys") else expected)


def test_models_version_health(client, tiny_path):
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    card = models["data"][0]
    assert card["id"] == MODEL_NAME and card["object"] == "model" and card["max_model_len"] == 256
    assert card["root"] == tiny_path
    assert client.get(f"/v1/models/{MODEL_NAME}").json() == card
    assert client.get("/version").json()["version"]
    assert client.get("/health").json() == {"status": "ok"}


def test_metrics(client):
    before = client.get("/metrics").text
    client.post(COMP, json={"prompt": [7] * 20, "max_tokens": 3, "ignore_eos": True})
    after = client.get("/metrics")
    assert after.headers["content-type"].startswith("text/plain")

    def value(text, name):
        line = next(x for x in text.splitlines() if x.startswith(name + "{"))
        return float(line.rsplit(" ", 1)[1])

    label = f'{{model_name="{MODEL_NAME}"}}'
    assert f"pagedserve:num_requests_running{label}" in after.text
    for name in ("kv_cache_usage_perc", "num_requests_waiting"):
        assert f"pagedserve:{name}{label}" in after.text
    assert (
        value(after.text, "pagedserve:prompt_tokens_total")
        >= value(before, "pagedserve:prompt_tokens_total") + 20
    )
    assert (
        value(after.text, "pagedserve:generation_tokens_total")
        >= value(before, "pagedserve:generation_tokens_total") + 3
    )
    assert value(after.text, "pagedserve:prefix_cache_queries_total") > 0
    assert value(after.text, "pagedserve:time_to_first_token_seconds_count") > value(
        before, "pagedserve:time_to_first_token_seconds_count"
    )
    for name in (
        "time_per_output_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
    ):
        assert value(after.text, f"pagedserve:{name}_count") >= 1
    assert value(after.text, "pagedserve:request_success_total") >= 1
