"""Every flag of ``vllm serve``, and what ``pagedserve serve`` does with it.

A command line written for vLLM either works unchanged or fails at once, naming the flag: no
flag of vLLM's is silently ignored. Each one is

- **implemented**: ``pagedserve serve`` has the flag (or takes it as another name of its own
  flag: ``--uvicorn-log-level`` is ``--log-level``, ``ALIASES``) and it does what vLLM's does;
- **accepted**: it asks for what pagedserve always does, so it is taken and changes nothing
  (``--trust-remote-code``: pagedserve never runs a model's own code, with or without it). Only
  the flag itself is taken, not its ``--no-`` form, whose meaning would not hold;
- **refused**: the parser stops with a message that names the flag and says why (and what to
  use instead, when pagedserve has it).

``add_vllm_flags`` puts the aliases, the accepted flags and the refused ones on the parser. vLLM's
list of flags, and the status of each as ``pagedserve serve --help`` shows it, are in
vllm_flag_inventory.py.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable

# vLLM's short forms of flags pagedserve implements
SHORT_FORMS = {
    "--tensor-parallel-size": "-tp",
    "--pipeline-parallel-size": "-pp",
    "--quantization": "-q",
}

# accepted: what each asks for already holds in pagedserve, whatever is given
ACCEPTED: dict[str, str] = {
    "--trust-remote-code": "pagedserve runs only its own model code, never a checkpoint's: "
    "the models it serves load the same with or without the permission",
    "--enable-auto-tool-choice": "tool_choice auto is always on, read by --tool-call-parser",
    "--exclude-tools-when-tool-choice-none": "pagedserve never shows the tools to the model "
    "under tool_choice none",
    "--disable-custom-all-reduce": "tensor parallelism always all-reduces through "
    "torch.distributed (NCCL, or gloo on CPU); there is no custom all-reduce kernel",
    "--enable-offline-docs": "/docs is always served from the package's own files (no CDN)",
    "--disable-log-requests": "pagedserve never logs requests' prompts or parameters",
    "--disable-cascade-attn": "pagedserve's attention has no cascade path: it is always off",
}


def human_readable_int(text: str) -> int:
    """vLLM's integers with a unit: ``1k`` (10**3), ``1K`` (2**10), ``25.6m``, ``2G``; a decimal
    only with a decimal (lower-case) unit."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)([kKmMgGtT]?)\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not an integer (such as 4096, 2G or 1.5g): {text!r}")
    number, unit = match.groups()
    if unit in "kmgt" and unit:
        return int(float(number) * 10 ** (3 * "kmgt".index(unit) + 3))
    if "." in number:
        raise argparse.ArgumentTypeError(f"no decimals with a binary unit ({unit}): {text!r}")
    return int(number) * (2 ** (10 * ("KMGT".index(unit) + 1)) if unit else 1)


# implemented under another name: vLLM's flag -> (pagedserve's field, how vLLM parses it)
ALIASES: dict[str, tuple[str, Callable[[str], object] | None]] = {
    "--uvicorn-log-level": ("log_level", None),
    "--kv-cache-memory-bytes": ("kv_cache_memory", human_readable_int),
}


def _refusing(reason: str, *flags: str) -> dict[str, str]:
    return dict.fromkeys(flags, reason)


NO_HUB = "pagedserve serves a model folder on this machine; it never reads the Hugging Face Hub"
IMAGES_ONLY = (
    "pagedserve takes images for LLaVA-style models (through the model's own image processor) "
    "but has no such option"
)
DATA_PARALLEL = (
    "pagedserve has no data parallelism: run one server per replica (pagedserve cluster "
    "routes between them)"
)
NO_LOGGING = "pagedserve logs no requests, outputs or statistics that this could shape"
HTTP_ONLY = "pagedserve serves plain HTTP on a TCP port: put a TLS or socket proxy in front"
VLLM_INTERNALS = "a setting of a mechanism of vLLM's that pagedserve does not have"
DEPRECATED = "deprecated in vLLM itself, and without a counterpart in pagedserve"

REFUSED: dict[str, str] = {
    **_refusing(
        "pagedserve runs one HTTP server process",
        "--headless",
        "--api-server-count",
        "--grpc",
        "--tokens-only",
    ),
    "--config": "give the options on the command line (pagedserve reads no YAML config file)",
    **_refusing(
        DATA_PARALLEL,
        "--data-parallel-supervisor-port",
        "--dp-supervisor-probe-interval-s",
        "--dp-supervisor-probe-timeout-s",
        "--dp-supervisor-probe-failure-threshold",
        "--data-parallel-size",
        "--data-parallel-rank",
        "--data-parallel-start-rank",
        "--data-parallel-size-local",
        "--data-parallel-address",
        "--data-parallel-rpc-port",
        "--data-parallel-backend",
        "--data-parallel-hybrid-lb",
        "--disable-nccl-for-dp-synchronization",
    ),
    **_refusing(
        HTTP_ONLY,
        "--uds",
        "--ssl-keyfile",
        "--ssl-certfile",
        "--ssl-ca-certs",
        "--enable-ssl-refresh",
        "--ssl-cert-reqs",
        "--ssl-ciphers",
        "--root-path",
    ),
    "--disable-access-log-for-endpoints": "use --disable-uvicorn-access-log (every route)",
    "--middleware": "pagedserve loads no code named on its command line",
    **_refusing(
        "pagedserve bounds request heads with --max-header-bytes (431 beyond)",
        "--h11-max-incomplete-event-size",
        "--h11-max-header-count",
    ),
    "--enable-flash-late-interaction": "pagedserve serves no pooling or scoring models",
    "--chat-template-content-format": "pagedserve renders message content as a string "
    "(text parts joined, after a placeholder line per image), vLLM's 'string' format",
    "--trust-request-chat-template": "pagedserve renders with the model's template or "
    "--chat-template, never one sent in a request",
    "--default-chat-template-kwargs": "send chat_template_kwargs with each request",
    "--response-role": "the reply's role is always assistant",
    "--tool-parser-plugin": "pagedserve loads no parser plugins: --tool-call-parser names one "
    "of its own (or auto, the chat template's format)",
    "--tool-server": "pagedserve runs no tools itself: tool calls go back to the client",
    **_refusing(
        NO_LOGGING,
        "--log-config-file",
        "--max-log-len",
        "--enable-log-outputs",
        "--enable-log-deltas",
        "--log-error-stack",
        "--aggregate-engine-logging",
        "--enable-log-requests",
    ),
    "--disable-log-stats": "pagedserve logs no periodic statistics, and its /metrics (which "
    "vLLM's flag would also stop) stays on",
    "--enable-prompt-tokens-details": "usage has no prompt_tokens_details in pagedserve",
    "--enable-per-request-metrics": "answers carry no per-request timings; /metrics has them",
    **_refusing(
        "pagedserve serves no Cohere API", "--cohere-is-reasoning-model", "--cohere-format"
    ),
    **_refusing(
        "system_fingerprint is always null in pagedserve's answers",
        "--fingerprint-mode",
        "--fingerprint-value",
    ),
    **_refusing(
        "a pooling model's pooling comes from its checkpoint (its sentence-transformers "
        "config, or --runner pooling / --convert)",
        "--task",
        "--pooler-config",
        "--override-pooler-config",
        "--io-processor-plugin",
    ),
    "--tokenizer-mode": "the tokenizer is always the model folder's Hugging Face tokenizer",
    **_refusing(
        NO_HUB,
        "--hf-config-path",
        "--revision",
        "--code-revision",
        "--tokenizer-revision",
        "--hf-token",
        "--download-dir",
    ),
    "--allowed-media-domains": "pagedserve never fetches a remote URL: send images in data: "
    "URLs, or as file:// URLs under --allowed-local-media-path",
    "--enable-mm-embeds": "pagedserve takes images, not precomputed image embeddings",
    "--interleave-mm-strings": "pagedserve puts a message's image placeholders before its text "
    "(vLLM's default), or where the text already holds them",
    "--video-pruning-rate": "pagedserve takes images, not video",
    **_refusing(
        IMAGES_ONLY,
        "--media-io-kwargs",
        "--mm-processor-cache-gb",
        "--disable-mm-preprocessor-cache",
        "--mm-processor-cache-type",
        "--mm-shm-cache-max-object-size-mb",
        "--mm-encoder-tp-mode",
        "--mm-encoder-attn-backend",
        "--skip-mm-profiling",
        "--disable-chunked-mm-input",
        "--default-mm-loras",
        "--enable-multimodal-encoder-data-parallel",
    ),
    **_refusing(
        "pagedserve reads the model's config.json as it is: no overrides",
        "--rope-scaling",
        "--rope-theta",
        "--hf-overrides",
        "--config-format",
        "--override-attention-dtype",
    ),
    "--logprobs-mode": "logprobs are always the raw model distribution's (vLLM's default, "
    "raw_logprobs)",
    "--disable-sliding-window": "pagedserve applies a model's sliding window as its config says",
    "--enable-prompt-embeds": "prompts are text or token ids",
    "--skip-tokenizer-init": "pagedserve needs the tokenizer (stop strings, detokenizing)",
    "--override-generation-config": "give the defaults a request leaves out in a "
    "generation_config.json folder (--generation-config FOLDER)",
    "--enable-sleep-mode": "pagedserve has no sleep mode",
    "--model-impl": "pagedserve runs its own implementation of each architecture",
    **_refusing(
        "pagedserve loads no custom logits processors",
        "--logits-processor-pattern",
        "--logits-processors",
    ),
    **_refusing(
        "pagedserve reads safetensors (or a .gguf file) from the model folder",
        "--load-format",
        "--safetensors-load-strategy",
        "--model-loader-extra-config",
        "--ignore-patterns",
        "--use-tqdm-on-load",
        "--pt-load-map-location",
    ),
    **_refusing(
        "pagedserve picks its structured-output backend itself",
        "--guided-decoding-backend",
        "--guided-decoding-disable-fallback",
        "--guided-decoding-disable-any-whitespace",
        "--guided-decoding-disable-additional-properties",
        "--structured-outputs-config",
    ),
    "--decode-context-parallel-size": VLLM_INTERNALS,
    **_refusing(
        "pagedserve runs mixture-of-experts layers without expert parallelism",
        "--enable-expert-parallel",
        "--all2all-backend",
        "--enable-eplb",
        "--eplb-config",
        "--expert-placement-strategy",
        "--num-redundant-experts",
        "--eplb-window-size",
        "--eplb-step-interval",
        "--eplb-log-balancedness",
    ),
    **_refusing(
        VLLM_INTERNALS,
        "--enable-dbo",
        "--dbo-decode-token-threshold",
        "--dbo-prefill-token-threshold",
        "--max-parallel-loading-workers",
        "--ray-workers-use-nsight",
        "--worker-cls",
        "--worker-extension-cls",
        "--prefix-caching-hash-algo",
        "--calculate-kv-scales",
        "--kv-sharing-fast-prefill",
        "--disable-hybrid-kv-cache-manager",
        "--scheduler-cls",
        "--num-lookahead-slots",
        "--compilation-config",
        "--additional-config",
        "--kv-events-config",
    ),
    "--collect-detailed-traces": "pagedserve's spans (--otlp-traces-endpoint) are one per "
    "request; it times no model or worker modules inside them",
    "--swap-space": "pagedserve preempts by recomputation (as vLLM's V1 engine) and has no "
    "CPU swap space",
    "--cpu-offload-gb": "pagedserve keeps the weights on the device",
    **_refusing(
        "pagedserve serves no state-space (Mamba) models",
        "--mamba-cache-dtype",
        "--mamba-ssm-cache-dtype",
        "--mamba-block-size",
    ),
    **_refusing(
        "LoRA adapters run in the model's dtype over the model's own vocabulary, unsharded",
        "--lora-extra-vocab-size",
        "--lora-dtype",
        "--fully-sharded-loras",
    ),
    **_refusing(
        "pagedserve's scheduler caps a prompt's tokens per step with "
        "--long-prefill-token-threshold; it has no partial-prefill counts",
        "--max-num-partial-prefills",
        "--max-long-partial-prefills",
    ),
    "--async-scheduling": "pagedserve schedules each step after the last one's outputs",
    **_refusing(
        "on a GPU, pagedserve captures a decode CUDA graph for its own batch sizes up to "
        "--max-num-seqs (--enforce-eager turns them off)",
        "--cudagraph-capture-sizes",
        "--cuda-graph-sizes",
        "--max-cudagraph-capture-size",
    ),
}


class RefusedFlag(argparse.Action):
    """A flag of vLLM's that pagedserve refuses: using it stops the parser with ``reason``."""

    def __init__(self, option_strings, dest, reason: str = "", **kwargs) -> None:
        super().__init__(
            option_strings, dest, nargs="*", default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )
        self.reason = reason

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        message = f"{option_string} is vLLM's flag, which pagedserve refuses: {self.reason}"
        parser.exit(2, f"{parser.prog}: error: {message}\n")


def add_vllm_flags(parser: argparse.ArgumentParser, defined: dict[str, argparse.Action]) -> None:
    """vLLM's names for flags the parser has (``defined``: its own, by dest), the accepted
    flags (shown, in their own group) and the refused ones (hidden until used)."""
    for flag, (dest, kind) in ALIASES.items():
        own = defined[dest]
        parser.add_argument(
            flag,
            dest=dest,
            type=kind or own.type,
            default=argparse.SUPPRESS,
            help=f"vLLM's name of {own.option_strings[0]} (as vLLM parses it)",
        )
    accepted = parser.add_argument_group(
        "vLLM's flags accepted for what pagedserve always does (each changes nothing)"
    )
    for flag, why in ACCEPTED.items():
        dest = "vllm_" + flag[2:].replace("-", "_")  # read by nothing: the flag changes nothing
        accepted.add_argument(
            flag, action="store_true", dest=dest, default=argparse.SUPPRESS, help=why
        )
    for flag, reason in REFUSED.items():
        try:
            parser.add_argument(flag, action=RefusedFlag, dest=argparse.SUPPRESS, reason=reason)
        except argparse.ArgumentError:
            continue  # the parser implements it now: the flag table's test says to drop it here
