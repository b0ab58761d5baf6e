"""vLLM's flags, and the status of each in ``pagedserve serve`` (vllm_flags.py says what the
three statuses mean and puts them on the parser).

"Implemented" is read from the parser itself (the flags ``pagedserve serve --help`` shows), so
the table in docs/configuration.md, generated from this module by tools/vllm_flag_table.py, is
held to the parser by a test: a flag that gains an implementation must leave ``REFUSED``.

The list is vLLM's as its stored source defines it: ``FrontendArgs`` and ``make_arg_parser``
(vllm/entrypoints/openai/cli_args.py, commit 0052233), ``EngineArgs.add_cli_args`` and
``AsyncEngineArgs.add_cli_args`` (vllm/engine/arg_utils.py, commit 99d7eb5; its
``--external_parameters``, a fork's addition spelled with underscores, is left out).
"""

from __future__ import annotations

import re

from pagedserve.server.vllm_flags import ACCEPTED, ALIASES, REFUSED, SHORT_FORMS

# vLLM's flags in the groups its --help prints them in
VLLM_SERVE_FLAGS: dict[str, tuple[str, ...]] = {
    "serve": ("--headless", "--api-server-count", "--config", "--grpc"),
    "Frontend": (
        "--host",
        "--port",
        "--data-parallel-supervisor-port",
        "--dp-supervisor-probe-interval-s",
        "--dp-supervisor-probe-timeout-s",
        "--dp-supervisor-probe-failure-threshold",
        "--uds",
        "--uvicorn-log-level",
        "--disable-uvicorn-access-log",
        "--disable-access-log-for-endpoints",
        "--allow-credentials",
        "--allowed-origins",
        "--allowed-methods",
        "--allowed-headers",
        "--api-key",
        "--ssl-keyfile",
        "--ssl-certfile",
        "--ssl-ca-certs",
        "--enable-ssl-refresh",
        "--ssl-cert-reqs",
        "--ssl-ciphers",
        "--root-path",
        "--middleware",
        "--enable-request-id-headers",
        "--disable-fastapi-docs",
        "--h11-max-incomplete-event-size",
        "--h11-max-header-count",
        "--enable-offline-docs",
        "--enable-flash-late-interaction",
        "--lora-modules",
        "--chat-template",
        "--chat-template-content-format",
        "--trust-request-chat-template",
        "--default-chat-template-kwargs",
        "--response-role",
        "--return-tokens-as-token-ids",
        "--enable-auto-tool-choice",
        "--exclude-tools-when-tool-choice-none",
        "--tool-call-parser",
        "--tool-parser-plugin",
        "--tool-server",
        "--log-config-file",
        "--max-log-len",
        "--enable-prompt-tokens-details",
        "--enable-per-request-metrics",
        "--enable-server-load-tracking",
        "--enable-force-include-usage",
        "--enable-tokenizer-info-endpoint",
        "--enable-log-outputs",
        "--enable-log-deltas",
        "--cohere-is-reasoning-model",
        "--cohere-format",
        "--log-error-stack",
        "--tokens-only",
        "--fingerprint-mode",
        "--fingerprint-value",
    ),
    "ModelConfig": (
        "--model",
        "--runner",
        "--convert",
        "--task",
        "--tokenizer",
        "--tokenizer-mode",
        "--trust-remote-code",
        "--dtype",
        "--seed",
        "--hf-config-path",
        "--allowed-local-media-path",
        "--allowed-media-domains",
        "--revision",
        "--code-revision",
        "--rope-scaling",
        "--rope-theta",
        "--tokenizer-revision",
        "--max-model-len",
        "--quantization",
        "--enforce-eager",
        "--max-logprobs",
        "--logprobs-mode",
        "--disable-sliding-window",
        "--disable-cascade-attn",
        "--skip-tokenizer-init",
        "--enable-prompt-embeds",
        "--served-model-name",
        "--config-format",
        "--hf-token",
        "--hf-overrides",
        "--pooler-config",
        "--override-pooler-config",
        "--logits-processor-pattern",
        "--generation-config",
        "--override-generation-config",
        "--enable-sleep-mode",
        "--model-impl",
        "--override-attention-dtype",
        "--logits-processors",
        "--io-processor-plugin",
    ),
    "LoadConfig": (
        "--load-format",
        "--download-dir",
        "--safetensors-load-strategy",
        "--model-loader-extra-config",
        "--ignore-patterns",
        "--use-tqdm-on-load",
        "--pt-load-map-location",
    ),
    "StructuredOutputsConfig": (
        "--reasoning-parser",
        "--guided-decoding-backend",
        "--guided-decoding-disable-fallback",
        "--guided-decoding-disable-any-whitespace",
        "--guided-decoding-disable-additional-properties",
    ),
    "ParallelConfig": (
        "--distributed-executor-backend",
        "--pipeline-parallel-size",
        "--tensor-parallel-size",
        "--decode-context-parallel-size",
        "--data-parallel-size",
        "--data-parallel-rank",
        "--data-parallel-start-rank",
        "--data-parallel-size-local",
        "--data-parallel-address",
        "--data-parallel-rpc-port",
        "--data-parallel-backend",
        "--data-parallel-hybrid-lb",
        "--enable-expert-parallel",
        "--all2all-backend",
        "--enable-dbo",
        "--dbo-decode-token-threshold",
        "--dbo-prefill-token-threshold",
        "--disable-nccl-for-dp-synchronization",
        "--enable-eplb",
        "--eplb-config",
        "--expert-placement-strategy",
        "--num-redundant-experts",
        "--eplb-window-size",
        "--eplb-step-interval",
        "--eplb-log-balancedness",
        "--max-parallel-loading-workers",
        "--ray-workers-use-nsight",
        "--disable-custom-all-reduce",
        "--worker-cls",
        "--worker-extension-cls",
        "--enable-multimodal-encoder-data-parallel",
    ),
    "CacheConfig": (
        "--block-size",
        "--gpu-memory-utilization",
        "--kv-cache-memory-bytes",
        "--swap-space",
        "--kv-cache-dtype",
        "--num-gpu-blocks-override",
        "--enable-prefix-caching",
        "--prefix-caching-hash-algo",
        "--cpu-offload-gb",
        "--calculate-kv-scales",
        "--kv-sharing-fast-prefill",
        "--mamba-cache-dtype",
        "--mamba-ssm-cache-dtype",
        "--mamba-block-size",
    ),
    "MultiModalConfig": (
        "--limit-mm-per-prompt",
        "--enable-mm-embeds",
        "--media-io-kwargs",
        "--mm-processor-kwargs",
        "--mm-processor-cache-gb",
        "--disable-mm-preprocessor-cache",
        "--mm-processor-cache-type",
        "--mm-shm-cache-max-object-size-mb",
        "--mm-encoder-tp-mode",
        "--mm-encoder-attn-backend",
        "--interleave-mm-strings",
        "--skip-mm-profiling",
        "--video-pruning-rate",
    ),
    "LoRAConfig": (
        "--enable-lora",
        "--max-loras",
        "--max-lora-rank",
        "--lora-extra-vocab-size",
        "--lora-dtype",
        "--max-cpu-loras",
        "--fully-sharded-loras",
        "--default-mm-loras",
    ),
    "ObservabilityConfig": (
        "--show-hidden-metrics-for-version",
        "--otlp-traces-endpoint",
        "--collect-detailed-traces",
    ),
    "SchedulerConfig": (
        "--max-num-batched-tokens",
        "--max-num-seqs",
        "--max-num-partial-prefills",
        "--max-long-partial-prefills",
        "--long-prefill-token-threshold",
        "--num-lookahead-slots",
        "--scheduling-policy",
        "--enable-chunked-prefill",
        "--disable-chunked-mm-input",
        "--scheduler-cls",
        "--disable-hybrid-kv-cache-manager",
        "--async-scheduling",
    ),
    "CompilationConfig": (
        "--cudagraph-capture-sizes",
        "--cuda-graph-sizes",
        "--max-cudagraph-capture-size",
    ),
    "VllmConfig": (
        "--speculative-config",
        "--kv-transfer-config",
        "--kv-events-config",
        "--compilation-config",
        "--additional-config",
        "--structured-outputs-config",
    ),
    "engine logging": (
        "--disable-log-stats",
        "--aggregate-engine-logging",
        "--enable-log-requests",
        "--disable-log-requests",
    ),
}


def help_flags(help_text: str) -> set[str]:
    """The flags a ``--help`` text shows, read from its usage block (which argparse never
    breaks inside a flag, as it may the prose below)."""
    usage = help_text.split("\n\n", 1)[0]
    return set(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*[a-z0-9])", usage))


def flag_statuses(help_text: str) -> dict[str, tuple[str, str]]:
    """Each vLLM flag's (status, why) as ``pagedserve serve --help`` (``help_text``) shows it."""
    shown = help_flags(help_text)
    statuses = {}
    for flag in (f for flags in VLLM_SERVE_FLAGS.values() for f in flags):
        if flag in ACCEPTED:
            statuses[flag] = ("accepted", ACCEPTED[flag])
        elif flag in shown:
            alias = ALIASES.get(flag)
            why = f"another name of `--{alias[0].replace('_', '-')}`" if alias else "the same flag"
            statuses[flag] = ("implemented", why)
        else:
            statuses[flag] = ("refused", REFUSED.get(flag, "not implemented"))
    return statuses


def flag_table(help_text: str) -> str:
    """The Markdown table of vLLM's flags and their status, for docs/configuration.md."""
    statuses = flag_statuses(help_text)
    lines = ["| vLLM group | vLLM flag | pagedserve | Why, or what instead |", "|---|---|---|---|"]
    for group, flags in VLLM_SERVE_FLAGS.items():
        for flag in flags:
            status, why = statuses[flag]
            short = f" (`{SHORT_FORMS[flag]}`)" if flag in SHORT_FORMS else ""
            lines.append(f"| {group} | `{flag}`{short} | {status} | {why} |")
    kinds = [status for status, _ in statuses.values()]
    summary = ", ".join(f"{kinds.count(s)} {s}" for s in ("implemented", "accepted", "refused"))
    own = sorted(help_flags(help_text) - set(statuses) - {"--help"})
    own = [f for f in own if not f.startswith("--no-")]
    return "\n".join(
        [
            f"{len(statuses)} flags of `vllm serve`: {summary}.",
            "",
            *lines,
            "",
            "`pagedserve serve`'s own flags, which vLLM has not: "
            + ", ".join(f"`{f}`" for f in own)
            + ".",
        ]
    )
