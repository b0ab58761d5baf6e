"""vLLM's server flags that change answers, as vLLM's do: --enable-force-include-usage,
--return-tokens-as-token-ids, --show-hidden-metrics-for-version (and, in test_vllm_routes.py,
--enable-server-load-tracking)."""

from __future__ import annotations

import re

import openai
import pytest
from starlette.testclient import TestClient

from pagedserve.server.app import build_app
from pagedserve.server.cli import build_parser, config_kwargs, main
from pagedserve.server.config import ServerConfig
from pagedserve.server.testing import TINY_MODEL_NAME as MODEL

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def client_for(engine, **config) -> openai.OpenAI:
    http = TestClient(build_app(engine, ServerConfig(**config), MODEL))
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http)


def test_the_flags_parse_into_the_server_config(tiny_path):
    args = build_parser().parse_args(
        ["serve", tiny_path, "--enable-force-include-usage", "--return-tokens-as-token-ids"]
        + ["--enable-server-load-tracking", "--show-hidden-metrics-for-version", "0.10"]
    )
    config = ServerConfig(**config_kwargs(args, ServerConfig))
    assert config.enable_force_include_usage and config.return_tokens_as_token_ids
    assert config.enable_server_load_tracking and config.show_hidden_metrics_for_version == "0.10"


def test_a_malformed_hidden_metrics_version_is_refused(tiny_path, capsys):
    assert main(["serve", tiny_path, "--show-hidden-metrics-for-version", "latest"]) == 2
    assert "show_hidden_metrics_for_version must be a version" in capsys.readouterr().err


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_force_include_usage_ends_every_stream_with_its_usage(engine, route):
    """vLLM's test_enable_force_include_usage: no stream_options, yet the last chunk has the
    usage (and no choices); every other chunk has none."""
    oai = client_for(engine, enable_force_include_usage=True)
    args = dict(model=MODEL, max_tokens=6, temperature=0, extra_body={"min_tokens": 6})
    if route == "chat":
        create, args["messages"] = oai.chat.completions.create, MESSAGES
    else:
        create, args["prompt"] = oai.completions.create, "The capital of France is"
    whole = create(**args)
    chunks = list(create(**args, stream=True))
    *body, last = chunks
    assert last.choices == [] and last.usage.model_dump() == whole.usage.model_dump()
    assert body and all(c.usage is None and c.choices for c in body)
    plain = list(client_for(engine).completions.create(model=MODEL, prompt="Hi", stream=True))
    assert all(c.usage is None for c in plain)  # without the flag: as before


def test_return_tokens_as_token_ids_is_the_servers_default_for_logprobs(engine):
    oai = client_for(engine, return_tokens_as_token_ids=True)
    args = dict(model=MODEL, messages=MESSAGES, max_tokens=4, logprobs=True, top_logprobs=2)
    chat = oai.chat.completions.create(**args, extra_body={"return_token_ids": True})
    named = [t.token for t in chat.choices[0].logprobs.content]
    assert named == [f"token_id:{t}" for t in chat.choices[0].token_ids]
    assert all(
        re.fullmatch(r"token_id:\d+", t.token)
        for t in chat.choices[0].logprobs.content[0].top_logprobs
    )
    own = oai.chat.completions.create(**args, extra_body={"return_tokens_as_token_ids": False})
    assert not any(t.token.startswith("token_id:") for t in own.choices[0].logprobs.content)
    completion = oai.completions.create(model=MODEL, prompt="Hi", max_tokens=3, logprobs=1)
    assert all(t.startswith("token_id:") for t in completion.choices[0].logprobs.tokens)


def test_no_metric_is_hidden_whatever_the_version(engine):
    """pagedserve hides no metric, so --show-hidden-metrics-for-version changes nothing."""

    def families(config: ServerConfig) -> set[str]:
        text = TestClient(build_app(engine, config, MODEL)).get("/metrics").text
        return set(re.findall(r"^# TYPE (\S+)", text, re.MULTILINE))

    assert families(ServerConfig(show_hidden_metrics_for_version="0.7")) == families(ServerConfig())
