"""vLLM's `vllm serve` flags: the inventory (docs/configuration.md's table, held to
`pagedserve serve --help`; refused flags stop the command line naming themselves; accepted ones
change nothing), and the flags that change answers as vLLM's do: --enable-force-include-usage,
--return-tokens-as-token-ids, --show-hidden-metrics-for-version, --disable-fastapi-docs (and, in
test_vllm_routes.py, --enable-server-load-tracking)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from starlette.testclient import TestClient

from pagedserve.engine import EngineArgs
from pagedserve.server.app import build_app
from pagedserve.server.cli import build_parser, config_kwargs, main
from pagedserve.server.config import ServerConfig
from pagedserve.server.testing import TINY_MODEL_NAME as MODEL
from pagedserve.server.vllm_flag_inventory import (
    VLLM_SERVE_FLAGS,
    flag_statuses,
    flag_table,
    help_flags,
)
from pagedserve.server.vllm_flags import ACCEPTED, REFUSED

ROOT = Path(__file__).resolve().parents[2]

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


def serve_help() -> str:
    """What `pagedserve serve --help` prints (the command line itself, in a subprocess)."""
    command = [sys.executable, "-m", "pagedserve.server.cli", "serve", "--help"]
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout


def docs_table_rows() -> dict[str, str]:
    """vLLM flag -> status, as the table in docs/configuration.md says."""
    page = (ROOT / "docs" / "configuration.md").read_text()
    table = page.split("<!-- vllm-flags:begin -->")[1].split("<!-- vllm-flags:end -->")[0]
    rows = re.findall(r"^\| [^|]+ \| `(--[^`]+)`[^|]* \| (\w+) \|", table, re.MULTILINE)
    return dict(rows)


def test_the_flag_table_in_the_docs_is_what_serve_help_shows():
    """Each vLLM flag the table calls implemented or accepted is in `pagedserve serve --help`,
    each refused one is not; and the table is the one generated from that help (regenerate
    with `python tools/vllm_flag_table.py`)."""
    help_text = serve_help()
    shown = help_flags(help_text)
    rows = docs_table_rows()
    assert set(rows) == {f for flags in VLLM_SERVE_FLAGS.values() for f in flags}
    for flag, status in rows.items():
        assert (flag in shown) == (status in ("implemented", "accepted")), (flag, status)
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert flag_table(help_text) in page, "stale: run python tools/vllm_flag_table.py"


def test_every_refused_flag_has_its_reason_and_none_is_implemented():
    statuses = flag_statuses(serve_help())
    refused = {flag for flag, (status, _) in statuses.items() if status == "refused"}
    assert refused == set(REFUSED), "REFUSED must list exactly the flags pagedserve lacks"
    assert not set(ACCEPTED) & set(REFUSED)


def test_a_refused_flag_stops_the_command_line_naming_it(capsys):
    for flag in REFUSED:
        with pytest.raises(SystemExit) as stopped:
            main(["serve", flag, "1", "model-folder"])
        assert stopped.value.code == 2
        error = capsys.readouterr().err
        assert f"{flag} is vLLM's flag, which pagedserve refuses: {REFUSED[flag]}" in error


def test_accepted_flags_change_nothing(tiny_path):
    def configs(*extra: str) -> tuple[ServerConfig, EngineArgs]:
        args = build_parser().parse_args(["serve", tiny_path, *extra])
        engine_kwargs = config_kwargs(args, EngineArgs, skip=("model",))
        return ServerConfig(**config_kwargs(args, ServerConfig)), EngineArgs(
            model=tiny_path, **engine_kwargs
        )

    assert configs(*ACCEPTED) == configs()
    with pytest.raises(SystemExit):  # the flag only: its --no- form would mean the opposite
        build_parser().parse_args(["serve", tiny_path, "--no-enable-auto-tool-choice"])


def test_vllms_names_and_short_forms_of_pagedserves_flags(tiny_path):
    args = build_parser().parse_args(
        ["serve", tiny_path, "--uvicorn-log-level", "warning", "-tp", "2", "-q", "int8"]
        + ["--kv-cache-memory-bytes", "1K"]
    )
    assert args.log_level == "warning" and args.tensor_parallel_size == 2
    assert args.quantization == "int8" and args.kv_cache_memory == 1024  # vLLM's K is 2**10
    for text, size in (("1k", 1000), ("25.6k", 25600), ("2G", 2 * 2**30), ("4096", 4096)):
        parsed = build_parser().parse_args(["serve", "--kv-cache-memory-bytes", text])
        assert parsed.kv_cache_memory == size, text


def test_disable_fastapi_docs_takes_the_schema_and_its_page_away(engine):
    http = TestClient(build_app(engine, ServerConfig(disable_fastapi_docs=True), MODEL))
    for path in ("/openapi.json", "/docs"):
        response = http.get(path)
        assert response.status_code == 404 and "--disable-fastapi-docs" in response.text
    assert http.get("/health").status_code == 200
