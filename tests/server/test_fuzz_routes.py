"""A bounded fuzzer over every route: ~400 mutated and malformed requests (seeded, so a failure
replays) through a real uvicorn connection. None may get a 5xx, hang, or drop the kept-alive
connection; afterwards no engine request and no KV block is held."""

from __future__ import annotations

import copy
import json
import random

import httpx
import pytest

from pagedserve.server.app import build_app
from pagedserve.server.config import ServerConfig
from pagedserve.server.testing import (
    TINY_MODEL_NAME,
    blocks_held,
    make_engine,
    uvicorn_in_thread,
    wait_engine_idle,
)

NUM_REQUESTS = 400
USER = [{"role": "user", "content": "hi"}]
SEEDS = {  # one valid body per POST route, cheap to answer
    "/v1/completions": {"prompt": "Hello", "max_tokens": 2, "logprobs": 1, "n": 2},
    "/v1/chat/completions": {"messages": USER, "max_tokens": 2, "logprobs": True},
    "/tokenize": {"prompt": "Hello", "return_token_strs": True},
    "/detokenize": {"tokens": [5, 6, 7]},
    "/v1/responses": {"input": USER, "instructions": "Be brief.", "max_output_tokens": 2},
    "/v1/chat/completions/batch": {"messages": [USER, USER], "max_tokens": 2},
    "/invocations": {"messages": USER, "max_tokens": 2, "stream": True},
}
GET_ROUTES = [
    "/v1/models",
    f"/v1/models/{TINY_MODEL_NAME}",
    "/v1/models/nope",
    "/health",
    "/ping",
    "/load",
    "/metrics",
    "/version",
    "/openapi.json",
    "/docs",
    "/static/docs.js",
    "/static/../../etc/passwd",
    "/tokenizer_info",
]
ODD_VALUES = [
    None,
    True,
    -1,
    0,
    1,
    2**63,
    10**40,
    -(10**40),
    1e308,
    -0.0,
    0.5,
    "",
    "x",
    "\ud800",
    "\x00",
    "token_id:1",
    "a" * 5000,
    [],
    [[]],
    [1, -1],
    [None],
    ["a", 1],
    {},
    {"type": "text"},
    {"include_usage": True, "continuous_usage_stats": True},
    [[[[[[[[[[[]]]]]]]]]]],
]
FIELDS = [  # request fields a mutation sets, vLLM's and OpenAI's
    "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "best_of", "temperature",
    "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "logprobs", "top_logprobs",
    "prompt_logprobs", "echo", "stream", "stream_options", "logit_bias", "min_tokens",
    "use_beam_search", "length_penalty", "early_stopping", "return_token_ids", "tokens",
    "return_tokens_as_token_ids", "ignore_eos", "model", "priority", "add_generation_prompt",
    "response_format", "tools", "suffix", "user", "input", "instructions", "max_output_tokens",
    "store", "previous_response_id", "text", "metadata",
]  # fmt: skip


def mutate(rng: random.Random, body: dict) -> dict:
    body = copy.deepcopy(body)
    for _ in range(rng.randint(1, 3)):
        choice = rng.random()
        if choice < 0.5:
            body[rng.choice(FIELDS)] = copy.deepcopy(rng.choice(ODD_VALUES))
        elif choice < 0.65 and body:
            body.pop(rng.choice(list(body)))
        elif choice < 0.8 and "messages" in body and isinstance(body["messages"], list):
            message = {"role": rng.choice(["user", "system", "assistant", "tool", "wizard", 7])}
            message["content"] = copy.deepcopy(rng.choice(ODD_VALUES + ["fine"]))
            body["messages"] = [*body["messages"], message]
        else:
            body[rng.choice(["stream", "echo"])] = True
    key = "max_output_tokens" if "input" in body else "max_tokens"
    body[key] = body.get(key, 2) if rng.random() < 0.97 else None
    return body


def raw_body(rng: random.Random, body: dict) -> tuple[bytes, str]:
    """The body as sent: mostly JSON, sometimes broken bytes or another content type."""
    text = json.dumps(body).encode()
    roll = rng.random()
    if roll < 0.75:
        return text, "application/json"
    if roll < 0.83:
        return text[: rng.randrange(len(text))], "application/json"  # truncated
    if roll < 0.88:
        cut = rng.randrange(len(text))
        return text[:cut] + bytes([rng.randrange(128, 256)]) + text[cut:], "application/json"
    if roll < 0.93:
        return rng.choice(
            [b"[]", b"null", b"42", b'"x"', b"", b"NaN", b"{" * 5000]
        ), "application/json"
    return text, rng.choice(["text/plain", "application/x-www-form-urlencoded", ""])


@pytest.fixture(scope="module")
def fuzz_engine(tiny_path):
    import asyncio

    engine = make_engine(tiny_path, max_model_len=40)
    yield engine
    asyncio.run(engine.shutdown())


def test_fuzzed_requests_get_no_5xx_no_hang_no_dropped_connection(fuzz_engine):
    config = ServerConfig(enable_tokenizer_info_endpoint=True)
    app = build_app(fuzz_engine, config, TINY_MODEL_NAME)
    rng = random.Random(1234)
    statuses: dict[int, int] = {}
    with uvicorn_in_thread(app) as url, httpx.Client(base_url=url, timeout=20) as http:
        for i in range(NUM_REQUESTS):
            if rng.random() < 0.12:
                method = rng.choice(["GET", "GET", "DELETE", "PUT"])
                path = rng.choice(GET_ROUTES + list(SEEDS))
                response = http.request(method, path, params={"q": rng.choice(["1", "%00"])})
            else:
                path = rng.choice(list(SEEDS))
                content, content_type = raw_body(rng, mutate(rng, SEEDS[path]))
                headers = {"content-type": content_type} if content_type else {}
                response = http.post(path, content=content, headers=headers)
            response.read()
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            assert response.status_code < 500, (i, path, response.text[:300])
            assert response.headers.get("connection") != "close", (i, path)
    assert statuses.get(200, 0) > 40 and sum(statuses.values()) == NUM_REQUESTS  # both kinds ran
    assert sum(n for s, n in statuses.items() if 400 <= s < 500) > 100
    wait_engine_idle(fuzz_engine)
    assert not app.state.server.in_flight
    assert not fuzz_engine.engine.has_unfinished_requests()
    assert blocks_held(fuzz_engine) == 0
