"""The hostile-input suite: every request below gets a 4xx in OpenAI's error shape, naming the
parameter at fault where there is one; the server keeps serving, and no KV block stays held."""

from __future__ import annotations

import json

import pytest

from pagedserve.server.testing import TINY_MODEL_NAME as MODEL_NAME
from pagedserve.server.testing import blocks_held, wait_engine_idle

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
LONG_TEXT = "The quick brown fox jumps over the lazy dog. " * 200  # far over max_model_len=256

# (name, path, body, expected status, expected param prefix or None)
JSON_CASES = [
    ("negative max_tokens", COMP, {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("zero max_tokens", COMP, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("huge max_tokens", COMP, {"prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
    ("astronomic max_tokens", COMP, {"prompt": "x", "max_tokens": 10**400}, 400, "max_tokens"),
    ("string max_tokens", COMP, {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("n = 10**6", COMP, {"prompt": "x", "n": 10**6}, 400, "n"),
    ("n = 0", COMP, {"prompt": "x", "n": 0}, 400, "n"),
    ("logprobs = 1000", COMP, {"prompt": "x", "logprobs": 1000}, 400, "logprobs"),
    ("negative logprobs", COMP, {"prompt": "x", "logprobs": -1}, 400, "logprobs"),
    ("negative temperature", COMP, {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("top_p > 1", COMP, {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("top_p = 0", COMP, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("negative top_k", COMP, {"prompt": "x", "top_k": -5}, 400, "top_k"),
    ("min_p > 1", COMP, {"prompt": "x", "min_p": 2}, 400, "min_p"),
    ("presence_penalty 5", COMP, {"prompt": "x", "presence_penalty": 5}, 400, "presence_penalty"),
    (
        "frequency_penalty -3",
        COMP,
        {"prompt": "x", "frequency_penalty": -3},
        400,
        "frequency_penalty",
    ),
    (
        "repetition_penalty 0",
        COMP,
        {"prompt": "x", "repetition_penalty": 0},
        400,
        "repetition_penalty",
    ),
    ("empty prompt", COMP, {"prompt": ""}, 400, "prompt"),
    ("empty prompt list", COMP, {"prompt": []}, 400, "prompt"),
    ("empty token list in list", COMP, {"prompt": [[]]}, 400, "prompt"),
    ("token id = vocab size", COMP, {"prompt": [1, 2, 512]}, 400, "prompt"),
    ("negative token id", COMP, {"prompt": [1, -1]}, 400, "prompt"),
    ("float token id", COMP, {"prompt": [1.5]}, 400, "prompt"),
    ("prompt is an object", COMP, {"prompt": {"a": 1}}, 400, "prompt"),
    ("missing prompt", COMP, {"max_tokens": 3}, 400, "prompt"),
    ("prompt longer than max_model_len", COMP, {"prompt": LONG_TEXT}, 400, "prompt"),
    ("token prompt at max_model_len", COMP, {"prompt": [5] * 256}, 400, "prompt"),
    (
        "prompt + max_tokens too long",
        COMP,
        {"prompt": [5] * 200, "max_tokens": 100},
        400,
        "max_tokens",
    ),
    (
        "min_tokens > max_tokens",
        COMP,
        {"prompt": "x", "max_tokens": 5, "min_tokens": 10},
        400,
        "min_tokens",
    ),
    ("too many prompts", COMP, {"prompt": ["x"] * 1000}, 400, "prompt"),
    ("huge stop list", COMP, {"prompt": "x", "stop": ["a"] * 10_000}, 400, "stop"),
    ("huge stop string", COMP, {"prompt": "x", "stop": "a" * 100_000}, 400, "stop"),
    ("empty stop string", COMP, {"prompt": "x", "stop": [""]}, 400, "stop"),
    (
        "stop token outside vocab",
        COMP,
        {"prompt": "x", "stop_token_ids": [99999]},
        400,
        "stop_token_ids",
    ),
    (
        "logit_bias key outside vocab",
        COMP,
        {"prompt": "x", "logit_bias": {"99999": 1}},
        400,
        "logit_bias",
    ),
    (
        "logit_bias key not a number",
        COMP,
        {"prompt": "x", "logit_bias": {"abc": 1}},
        400,
        "logit_bias",
    ),
    ("logit_bias value 1000", COMP, {"prompt": "x", "logit_bias": {"5": 1000}}, 400, "logit_bias"),
    ("unknown model", COMP, {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("string seed", COMP, {"prompt": "x", "seed": "abc"}, 400, "seed"),
    ("suffix", COMP, {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("best_of > n", COMP, {"prompt": "x", "best_of": 5}, 400, "best_of"),
    (
        "stream_options without stream",
        COMP,
        {"prompt": "x", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    ("logprobs over --max-logprobs", COMP, {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("prompt_logprobs = 21", COMP, {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    (
        "beam search with temperature",
        COMP,
        {"prompt": "x", "use_beam_search": True, "n": 2, "temperature": 0.5},
        400,
        "temperature",
    ),
    (
        "bad stream_options",
        COMP,
        {"prompt": "x", "stream_options": {"include_usage": "maybe"}},
        400,
        "stream_options",
    ),
    (
        "streaming with bad temperature",
        COMP,
        {"prompt": "x", "stream": True, "temperature": -1},
        400,
        "temperature",
    ),
    ("empty messages", CHAT, {"messages": []}, 400, "messages"),
    ("missing messages", CHAT, {"max_tokens": 3}, 400, "messages"),
    ("messages is a string", CHAT, {"messages": "hello"}, 400, "messages"),
    (
        "numeric role",
        CHAT,
        {"messages": [{"role": 7, "content": "hi"}]},
        400,
        "messages.0.role",
    ),
    ("missing role", CHAT, {"messages": [{"content": "hi"}]}, 400, "messages.0.role"),
    (
        "numeric content",
        CHAT,
        {"messages": [{"role": "user", "content": 123}]},
        400,
        "messages.0.content",
    ),
    (
        "image content",
        CHAT,
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        },
        400,
        "messages.0.content",
    ),
    (
        "conversation too long",
        CHAT,
        {"messages": [{"role": "user", "content": LONG_TEXT}]},
        400,
        "messages",
    ),
    (
        "top_logprobs = 50",
        CHAT,
        {"messages": USER, "logprobs": True, "top_logprobs": 50},
        400,
        "top_logprobs",
    ),
    (
        "top_logprobs without logprobs",
        CHAT,
        {"messages": USER, "top_logprobs": 3},
        400,
        "top_logprobs",
    ),
    (
        "negative max_completion_tokens",
        CHAT,
        {"messages": USER, "max_completion_tokens": -3},
        400,
        "max_completion_tokens",
    ),
    (
        "max_tokens and max_completion_tokens disagree",
        CHAT,
        {"messages": USER, "max_tokens": 5, "max_completion_tokens": 6},
        400,
        "max_completion_tokens",
    ),
    (
        "tool without a name",
        CHAT,
        {"messages": USER, "tools": [{"type": "function", "function": {"description": "f"}}]},
        400,
        "tools",
    ),
    (
        "json_schema response_format",
        CHAT,
        {"messages": USER, "response_format": {"type": "json_schema"}},
        400,
        "response_format",
    ),
    ("chat n = 17", CHAT, {"messages": USER, "n": 17}, 400, "n"),
    ("chat unknown model", CHAT, {"messages": USER, "model": "nope"}, 404, "model"),
    ("detokenize outside vocab", "/detokenize", {"tokens": [99999]}, 400, "tokens"),
    ("tokenize without prompt", "/tokenize", {"text": "x"}, 400, "prompt"),
]

# (name, method, path, raw body, headers, expected status)
RAW_CASES = [
    ("20 MB body", "POST", COMP, b'{"prompt": "' + b"a" * (20 * 2**20) + b'"}', {}, 413),
    ("invalid JSON", "POST", COMP, b'{"prompt": "x",', {}, 400),
    ("JSON array body", "POST", COMP, b"[1, 2]", {}, 400),
    ("JSON NaN temperature", "POST", COMP, b'{"prompt": "x", "temperature": NaN}', {}, 400),
    ("JSON Infinity top_p", "POST", COMP, b'{"prompt": "x", "top_p": Infinity}', {}, 400),
    ("deeply nested JSON", "POST", COMP, b"[" * 100_000 + b"]" * 100_000, {}, 400),
    ("invalid UTF-8", "POST", COMP, b'{"prompt": "\xff\xfe\xfd"}', {}, 400),
    ("wrong content type", "POST", COMP, b'{"prompt": "x"}', {"content-type": "text/plain"}, 415),
    (
        "form content type",
        "POST",
        CHAT,
        b"messages=hi",
        {"content-type": "application/x-www-form-urlencoded"},
        415,
    ),
    ("unknown route", "POST", "/v1/audio/speech", b"{}", {}, 404),
    ("wrong method", "GET", COMP, b"", {}, 405),
    ("unknown model card", "GET", "/v1/models/gpt-4", b"", {}, 404),
    ("64 KB of headers", "GET", "/v1/models", b"", {"x-junk": "a" * 65536}, 431),
]


def check_error(response, status: int, param: str | None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param), error


def test_the_suite_is_large_enough():
    assert len(JSON_CASES) + len(RAW_CASES) >= 40


@pytest.mark.parametrize("name,path,body,status,param", JSON_CASES, ids=[c[0] for c in JSON_CASES])
def test_invalid_json_request(client, name, path, body, status, param):
    check_error(client.post(path, json=body), status, param)


@pytest.mark.parametrize(
    "name,method,path,raw,headers,status", RAW_CASES, ids=[c[0] for c in RAW_CASES]
)
def test_invalid_http_request(client, name, method, path, raw, headers, status):
    headers = {"content-type": "application/json", **headers}
    response = client.request(method, path, content=raw or None, headers=headers)
    check_error(response, status, None)


def test_chunked_oversized_body_is_413(client):
    """No Content-Length to trust: the body is counted as it streams in."""

    def chunks():
        for _ in range(20):
            yield b"a" * 2**20

    response = client.post(COMP, content=chunks(), headers={"content-type": "application/json"})
    check_error(response, 413, None)


def test_server_still_serves_and_holds_no_block(client, engine):
    """Runs after the hostile requests (same module, same engine)."""
    response = client.post(COMP, json={"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    wait_engine_idle(engine)
    assert not engine.engine.has_unfinished_requests()
    assert blocks_held(engine) == 0
    assert json.loads(client.get("/health").text) == {"status": "ok"}
