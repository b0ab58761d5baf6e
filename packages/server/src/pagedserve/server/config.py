"""ServerConfig: the HTTP server's knobs (the engine's are in EngineArgs), same names as the CLI.

Each field carries its help text, as EngineArgs's do; the CLI builds its flags from both alike.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from pagedserve.engine.config import option
from pagedserve.server.reasoning import REASONING_PARSERS
from pagedserve.server.tool_parsers import TOOL_CALL_PARSERS

MIB = 1024 * 1024
METRICS_PREFIXES = ("pagedserve", "vllm")  # --metrics-prefix: ours, or vLLM's own names
# Batch API requests run after every interactive request of a lower priority value
BATCH_PRIORITY = 2**31 - 1


@dataclass
class ServerConfig:
    """Where to listen, who may call, and the caps that keep one request from hurting the rest.

    The caps bound the work a single request can ask for before any of it is queued: ``max_n``
    choices per prompt, ``max_prompts`` prompts per completion request (``max_pooling_inputs`` inputs per pooling
    request), ``max_stop`` stop strings
    of at most ``max_stop_length`` characters, and ``max_body_bytes``/``max_header_bytes`` of
    HTTP input. ``retry_after_s`` is what a 503 tells a client to wait.
    """

    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8000, "port to listen on")
    api_key: str | None = option(
        None,
        "require 'Authorization: Bearer KEY' on every route but /health, /metrics and the API's "
        "docs (default: $PAGEDSERVE_API_KEY, else no key)",
    )
    metrics_require_api_key: bool = option(
        False, "with --api-key, guard /metrics too (vLLM leaves it open to Prometheus)"
    )
    served_model_name: str | None = option(
        None,
        "the model's name in the API (default: the model path, or SmolLM2-135M-Instruct for "
        "the default model)",
    )
    shutdown_timeout: float = option(
        30.0, "on SIGTERM, seconds to let in-flight requests finish before aborting them"
    )
    max_body_bytes: int = option(8 * MIB, "largest request body (413 beyond)", unit="bytes")
    max_header_bytes: int = option(32 * 1024, "largest request headers (431 beyond)", unit="bytes")
    max_n: int = option(16, "most choices (n) per request")
    max_prompts: int = option(16, "most prompts in one /v1/completions request")
    max_pooling_inputs: int = option(
        2048, "most inputs in one pooling request (embeddings, scored pairs, reranked documents)"
    )
    max_stop: int = option(16, "most stop strings (and stop token ids) per request")
    max_stop_length: int = option(256, "longest stop string, in characters")
    retry_after_s: int = option(1, "Retry-After seconds sent with a 503")
    log_level: str = option(
        "info", "uvicorn's log level: critical, error, warning, info, debug, trace"
    )
    disable_uvicorn_access_log: bool = option(
        False, "log no line per HTTP request (uvicorn's access log; vLLM's flag)"
    )
    disable_fastapi_docs: bool = option(
        False, "serve no /openapi.json and no /docs (vLLM's flag, named after its FastAPI)"
    )
    enable_request_id_headers: bool = option(
        False, "echo the request's X-Request-Id (or a new id) in an X-Request-Id response header"
    )
    allowed_origins: tuple[str, ...] = option(
        ("*",), "CORS: origins allowed to call from a browser (JSON list or a,b)", unit="list"
    )
    allowed_methods: tuple[str, ...] = option(("*",), "CORS: allowed methods", unit="list")
    allowed_headers: tuple[str, ...] = option(("*",), "CORS: allowed request headers", unit="list")
    allow_credentials: bool = option(False, "CORS: allow credentials (cookies, HTTP auth)")
    enable_tokenizer_info_endpoint: bool = option(
        False, "serve GET /tokenizer_info (the tokenizer's configuration, chat template included)"
    )
    chat_template: str | None = option(
        None, "a chat template (a Jinja file, or the template itself) instead of the model's"
    )
    tool_call_parser: str = option(
        "auto",
        "how tool calls are read from a reply under tool_choice auto: auto (the format the chat "
        "template writes calls in; hermes for a template without tools), hermes, llama3_json, "
        "mistral, pythonic, llama4_pythonic, qwen3_coder, deepseek_v3, deepseek_v31, granite, "
        "internlm, glm45, openai",
    )
    reasoning_parser: str | None = option(
        None,
        "split a reasoning model's thinking from its answer (reasoning_content): deepseek_r1, "
        "qwen3, think, openai_gptoss",
    )
    responses_store: str | None = option(
        None,
        "the SQLite file that keeps /v1/responses with store (default: "
        "$PAGEDSERVE_HOME/responses.sqlite3; 'off' stores nothing)",
    )
    responses_store_max: int = option(
        10000, "most responses kept in the store; the oldest are dropped beyond it"
    )
    enable_force_include_usage: bool = option(
        False,
        "end every streamed answer with a usage chunk, as if each request had sent "
        "stream_options.include_usage (vLLM's flag)",
    )
    return_tokens_as_token_ids: bool = option(
        False,
        "name tokens in logprobs 'token_id:N' unless a request says otherwise in its own "
        "return_tokens_as_token_ids (vLLM's flag)",
    )
    enable_server_load_tracking: bool = option(
        False,
        "count the generation requests being served, for GET /load (vLLM's flag; without it "
        "/load reads 0)",
    )
    show_hidden_metrics_for_version: str | None = option(
        None,
        "vLLM's escape hatch for metrics hidden since version X.Y: pagedserve hides none, so "
        "every metric shows whatever the version (a version X.Y is still required)",
    )
    metrics_prefix: str = option(
        "pagedserve",
        "the prefix of the /metrics names: pagedserve, or vllm for vLLM's own names (the "
        "dashboards and autoscalers written for vLLM read vllm:*)",
    )
    batch_store: str | None = option(
        None,
        "the Batch API's folder: its SQLite database and the files (default: "
        "$PAGEDSERVE_HOME/batches)",
    )
    batch_max_seq_share: float = option(
        0.5,
        "the most of --max-num-seqs that Batch API requests may hold in the engine at once; the "
        "rest is kept for interactive requests",
    )
    batch_priority: int = option(
        BATCH_PRIORITY,
        "the priority Batch API requests run at under --scheduling-policy priority (lower runs "
        "first; interactive requests default to 0)",
    )
    max_file_bytes: int = option(
        200 * 1000 * 1000, "largest file uploaded to POST /v1/files (413 beyond)", unit="bytes"
    )
    otlp_traces_endpoint: str | None = option(
        None,
        "export one OpenTelemetry span per request over OTLP/HTTP to this URL (a collector's "
        "http://host:4318, /v1/traces appended when the URL has no path; vLLM's flag). "
        "Off by default: nothing of OpenTelemetry is imported",
    )
    lora_modules: tuple[str, ...] = option(
        (),
        "LoRA adapters to serve, each name=path or vLLM's JSON "
        '\'{"name": ..., "path": ...}\' (needs --enable-lora)',
        unit="lora_modules",
        nargs="+",
    )

    def __post_init__(self) -> None:
        if self.tool_call_parser != "auto" and self.tool_call_parser not in TOOL_CALL_PARSERS:
            names = ", ".join(["auto", *TOOL_CALL_PARSERS])
            raise ValueError(
                f"tool_call_parser must be one of {names}, got {self.tool_call_parser!r}"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            names = ", ".join(REASONING_PARSERS)
            raise ValueError(
                f"reasoning_parser must be one of {names}, got {self.reasoning_parser!r}"
            )
        if self.responses_store_max < 1:
            raise ValueError(f"responses_store_max must be >= 1, got {self.responses_store_max}")
        if self.metrics_prefix not in METRICS_PREFIXES:
            raise ValueError(
                f"metrics_prefix must be one of {METRICS_PREFIXES}, got {self.metrics_prefix!r}"
            )
        if self.chat_template and Path(self.chat_template).is_file():
            self.chat_template = Path(self.chat_template).read_text()
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it unset to disable auth)")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        self.lora_modules = tuple(parse_lora_module(m) for m in self.lora_modules)
        if self.otlp_traces_endpoint is not None:
            self.otlp_traces_endpoint = otlp_traces_url(self.otlp_traces_endpoint)
        version = self.show_hidden_metrics_for_version
        if version is not None and not re.fullmatch(r"v?\d+\.\d+(\.\d+)?", version):
            raise ValueError(
                f"show_hidden_metrics_for_version must be a version such as 0.10, got {version!r}"
            )
        if not 0 < self.batch_max_seq_share <= 1:
            raise ValueError(
                f"batch_max_seq_share must be in (0, 1], got {self.batch_max_seq_share}"
            )
        names = ("max_body_bytes", "max_header_bytes", "max_file_bytes", "max_n", "max_prompts")
        for name in (*names, "max_pooling_inputs", "max_stop"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def parse_lora_module(text: str) -> str:
    """``name=path``, or vLLM's JSON form ``{"name": ..., "path": ...}``, as ``name=path``."""
    text = text.strip()
    if text.startswith("{"):
        try:
            module = json.loads(text)
            text = f"{module['name']}={module['path']}"
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"a LoRA module in JSON needs name and path: {text!r} ({e})") from e
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"a LoRA module is name=path, got {text!r}")
    return f"{name.strip()}={path.strip()}"


def otlp_traces_url(endpoint: str) -> str:
    """The OTLP/HTTP URL spans are posted to: ``endpoint``, with the standard /v1/traces path
    when it has none (a collector's address, as for OTEL_EXPORTER_OTLP_ENDPOINT). The protocol
    variables of OpenTelemetry, if set, must say OTLP/HTTP too (vLLM's default is gRPC)."""
    for variable in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        protocol = os.environ.get(variable)
        if protocol and protocol != "http/protobuf":
            raise ValueError(
                f"{variable}={protocol}: pagedserve exports traces over OTLP/HTTP "
                "(http/protobuf) only; point --otlp-traces-endpoint at the collector's HTTP port"
            )
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(
            f"otlp_traces_endpoint must be an http:// or https:// URL (traces go over OTLP/HTTP, "
            f"not gRPC), got {endpoint!r}"
        )
    if parts.path in ("", "/"):
        parts = parts._replace(path="/v1/traces")
    return urlunsplit(parts)
