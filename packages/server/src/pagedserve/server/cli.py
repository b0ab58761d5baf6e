"""The ``pagedserve`` command line.

    pagedserve serve [MODEL_PATH] [--host H] [--port P] [--api-key KEY] ...   the OpenAI-compatible server
    pagedserve generate [--model PATH] [--chat] "prompt" ... | --file F     offline generation, timed

With no model, the default model (SmolLM2-135M-Instruct) is prepared if needed and used. Every
engine option is a --kebab-case flag with the same name as its EngineArgs field, and the server
options keep vLLM's names (--host, --port, --api-key, --served-model-name, --shutdown-timeout).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import time
from dataclasses import fields

from pagedserve.engine import LLM, EngineArgs, SamplingParams
from pagedserve.server.config import ServerConfig

ENGINE_HELP = {
    "tokenizer": "tokenizer folder (default: the model's)",
    "dtype": "weights and activations: auto, float32, float16, bfloat16",
    "device": "auto (CUDA if present, else CPU), cuda or cpu",
    "seed": "seed of the engine's random source (per-request seeds override it)",
    "max_model_len": "longest sequence, prompt plus completion (default: the model's)",
    "block_size": "tokens per KV-cache block",
    "kv_cache_memory": "bytes for the KV cache on CPU, e.g. 2GiB, 512MB or 1073741824",
    "gpu_memory_utilization": "fraction of free GPU memory for the KV cache",
    "num_gpu_blocks_override": "exact number of KV blocks (overrides the memory settings)",
    "enable_prefix_caching": "share the KV blocks of common prompt prefixes between requests",
    "max_num_seqs": "most sequences in one batch",
    "max_num_batched_tokens": "token budget of one step (prefill chunks + decodes)",
    "long_prefill_token_threshold": "most tokens of one prompt per step (0: no cap)",
    "enable_chunked_prefill": "split long prompts over several steps",
    "scheduling_policy": "fcfs, or priority (a request's 'priority' field, lower first)",
    "max_num_waiting": "most requests waiting in the queue; beyond it the server answers 503",
    "tensor_parallel_size": "number of devices to shard the model over",
    "enforce_eager": "run every step eagerly: no CUDA graphs for decode steps",
}

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str) -> int:
    """Bytes from ``1073741824``, ``2GiB``, ``512MB``, ``1.5 GiB`` (SI and binary units)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 2GiB, 512MB or a byte count)")
    size = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if size <= 0:
        raise argparse.ArgumentTypeError(f"a size must be positive, got {text!r}")
    return size


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """Expose every EngineArgs field as --kebab-case, same name as in Python."""
    group = parser.add_argument_group("engine")
    for f in fields(EngineArgs):
        if f.name == "model" or f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        help_ = ENGINE_HELP.get(f.name, "") + f" (default: {f.default})"
        if f.type in ("bool", bool):
            group.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_
            )
        else:
            kind = int if "int" in str(f.type) else float if "float" in str(f.type) else str
            if f.name == "kv_cache_memory":
                kind = parse_size
            group.add_argument(flag, type=kind, default=f.default, help=help_)


def engine_kwargs(args: argparse.Namespace, skip: tuple[str, ...] = ()) -> dict:
    return {
        f.name: getattr(args, f.name)
        for f in fields(EngineArgs)
        if f.name != "model" and f.name not in skip
    }


def resolve_model(path: str | None) -> tuple[str, str | None]:
    """(model folder, its default served name): the default model when no path is given."""
    if path:
        return path, None
    from pagedserve.models.default_model import DEFAULT_MODEL_NAME, ensure_default_model

    return str(ensure_default_model()), DEFAULT_MODEL_NAME


# ---- generate --------------------------------------------------------------------------------


def cmd_generate(args: argparse.Namespace) -> int:
    prompts = list(args.prompts)
    if args.file:
        with open(args.file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        print("pagedserve generate: give prompts as arguments or with --file", file=sys.stderr)
        return 2
    model, _ = resolve_model(args.model)
    llm = LLM(model=model, **engine_kwargs(args))
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.sampling_seed
    )
    start = time.perf_counter()
    if args.chat:
        outputs = llm.chat(
            [[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False
        )
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        completion = out.outputs[0]
        tokens += len(completion.token_ids)
        print(
            f"### {prompt}\n{completion.text.strip()}\n[{len(completion.token_ids)} tokens, {completion.finish_reason}]\n"
        )
    print(
        f"{len(prompts)} prompts, {tokens} tokens in {elapsed:.2f}s ({tokens / elapsed:.1f} tokens/s)"
    )
    return 0


def add_generate_parser(sub) -> None:
    gen = sub.add_parser(
        "generate",
        help="generate offline for prompts given on the command line or in a file",
        description="Generate offline (no server) and print each completion with timing.",
    )
    gen.add_argument("prompts", nargs="*", help="prompts to complete")
    gen.add_argument(
        "--model", default=None, help="Hugging Face model folder (default: SmolLM2-135M-Instruct)"
    )
    gen.add_argument("--file", help="a file with one prompt per line")
    gen.add_argument("--chat", action="store_true", help="apply the chat template to each prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    gen.add_argument(
        "--max-tokens", type=int, default=64, help="tokens per completion (default: 64)"
    )
    gen.add_argument("--sampling-seed", type=int, default=None, help="seed of the sampling")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)


# ---- serve -----------------------------------------------------------------------------------

_SERVER_HELP = {
    "host": "address to listen on",
    "port": "port to listen on",
    "api_key": "require 'Authorization: Bearer KEY' on every route but /health "
    "(default: $PAGEDSERVE_API_KEY, else no key)",
    "served_model_name": "the model's name in the API (default: the model path, or "
    "SmolLM2-135M-Instruct for the default model)",
    "shutdown_timeout": "on SIGTERM, seconds to let in-flight requests finish before aborting them",
    "max_body_bytes": "largest request body (413 beyond)",
    "max_header_bytes": "largest request headers (431 beyond)",
    "max_n": "most choices (n) per request",
    "max_prompts": "most prompts in one /v1/completions request",
    "max_stop": "most stop strings (and stop token ids) per request",
    "max_stop_length": "longest stop string, in characters",
    "retry_after_s": "Retry-After seconds sent with a 503",
    "log_level": "uvicorn's log level: critical, error, warning, info, debug",
}


def add_serve_parser(sub) -> None:
    serve = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description=(
            "Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
            "/v1/chat/completions, /v1/models, /tokenize, /detokenize, /health, /metrics, /version)."
        ),
    )
    serve.add_argument(
        "model_path",
        nargs="?",
        default=None,
        help="Hugging Face model folder (default: SmolLM2-135M-Instruct)",
    )
    serve.add_argument("--model", dest="model_option", default=None, help="same as MODEL_PATH")
    group = serve.add_argument_group("server")
    for f in fields(ServerConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = (
            parse_size
            if f.name.endswith("_bytes")
            else {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
        )
        default = os.environ.get("PAGEDSERVE_API_KEY") if f.name == "api_key" else f.default
        help_ = _SERVER_HELP.get(f.name, "")
        if "(default" not in help_:
            help_ += f" (default: {f.default})"
        group.add_argument(flag, type=kind, default=default, help=help_)
    add_engine_args(serve, skip=("served_model_name",))
    serve.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from pagedserve.engine import AsyncLLM
    from pagedserve.server.launcher import run_server

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.model_path and args.model_option and args.model_path != args.model_option:
        print("pagedserve serve: give the model once (MODEL_PATH or --model)", file=sys.stderr)
        return 2
    model, default_name = resolve_model(args.model_path or args.model_option)
    server_kwargs = {f.name: getattr(args, f.name) for f in fields(ServerConfig)}
    try:
        config = ServerConfig(**server_kwargs)
        name = config.served_model_name or default_name or model
        engine = AsyncLLM(
            EngineArgs(
                model=model,
                served_model_name=name,
                **engine_kwargs(args, skip=("served_model_name",)),
            )
        )
    except (ValueError, OSError) as e:
        print(f"pagedserve serve: {e}", file=sys.stderr)
        return 2
    return run_server(engine, config, name)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedserve",
        description="pagedserve: an LLM serving engine with a paged KV cache, prefix caching and "
        "continuous batching, and an OpenAI-compatible server.",
        epilog="Run 'pagedserve serve --help' or 'pagedserve generate --help' for their options.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve,generate}")
    add_serve_parser(sub)
    add_generate_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
