"""The ``pagedserve`` command line.

    pagedserve serve [MODEL_PATH] [--host H] [--port P] [--api-key KEY] ...   the OpenAI-compatible server
    pagedserve generate [--model PATH] [--chat] "prompt" ... | --file F     offline generation, timed
    pagedserve run-batch -i IN.jsonl -o OUT.jsonl [MODEL_PATH] ...          OpenAI batch files, offline

With no model, the default model (SmolLM2-135M-Instruct) is prepared if needed and used. Every
engine option is a --kebab-case flag with the same name as its EngineArgs field, and the server
options keep vLLM's names (--host, --port, --api-key, --served-model-name, --shutdown-timeout).
Every other flag of ``vllm serve`` is implemented under another name, accepted, or refused with
a message that names it (vllm_flags.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import socket
import sys
import time
import types
import typing
from collections.abc import Callable
from dataclasses import fields, replace
from importlib import metadata

from pagedserve.engine import (
    DEFAULT_MODEL_NAME,
    LLM,
    EngineArgs,
    SamplingParams,
    ensure_default_model,
)
from pagedserve.server.config import ServerConfig
from pagedserve.server.run_batch import ANSWER_OPTIONS, run_batch
from pagedserve.server.vllm_flags import SHORT_FORMS, add_vllm_flags

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


def add_config_args(
    group: argparse._ActionsContainer,
    cls: type,
    skip: tuple[str, ...] = (),
    short_forms: dict[str, str] | None = None,
    **defaults,
) -> dict[str, argparse.Action]:
    """One ``--kebab-case`` flag per field of the config dataclass ``cls``, named as the field
    (and its short form, if ``short_forms`` gives one); returns the flags' actions by field.

    Everything comes from the dataclass: the value's type from its type hint (``X | None`` takes
    an X; a bool is ``--flag``/``--no-flag``; a field whose metadata says ``unit="bytes"`` takes
    sizes such as 2GiB), the help text from its metadata, the default from the field unless
    ``defaults`` overrides it.
    """
    hints = typing.get_type_hints(cls)
    actions = {}
    for f in fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        names = [flag, short_forms[flag]] if short_forms and flag in short_forms else [flag]
        default = defaults.get(f.name, f.default)
        help_ = f.metadata.get("help", "")
        if "(default" not in help_:
            help_ += f" (default: {f.default})"
        kind = _flag_type(f.name, hints[f.name], f.metadata)
        if kind is bool:
            action = argparse.BooleanOptionalAction
            added = group.add_argument(*names, action=action, default=default, help=help_)
        elif "nargs" in f.metadata:
            added = group.add_argument(
                *names, type=kind, nargs=f.metadata["nargs"], default=default, help=help_
            )
        else:
            added = group.add_argument(*names, type=kind, default=default, help=help_)
        actions[f.name] = added
    return actions


def parse_list(text: str) -> tuple[str, ...]:
    """A list of strings, as vLLM takes it (a JSON list: '["a", "b"]') or comma-separated."""
    text = text.strip()
    if text.startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {text!r} ({e})") from e
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"not a list of strings: {text!r}")
        return tuple(value)
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _flag_type(name: str, hint, metadata) -> type | Callable[[str], object]:
    if metadata.get("unit") == "bytes":
        return parse_size
    if metadata.get("unit") == "json":  # a config dict given as JSON text (vLLM's spelling)
        return json.loads
    if metadata.get("unit") == "list":
        return parse_list
    if metadata.get("unit") == "lora_modules":
        return str  # each checked by ServerConfig
    kind = hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # X | None takes an X
        members = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        kind = members[0] if len(members) == 1 else hint
    if kind not in (bool, int, float, str):
        raise TypeError(f"{name}: no command-line flag for a value of type {hint}")
    return kind


def config_kwargs(args: argparse.Namespace, cls: type, skip: tuple[str, ...] = ()) -> dict:
    """The fields of ``cls`` as parsed by the flags of ``add_config_args``."""
    return {f.name: getattr(args, f.name) for f in fields(cls) if f.name not in skip}


class UsageError(Exception):
    """A mistake of the user's (a missing folder, a busy port): one line on stderr, exit 2."""


def resolve_model(path: str | None) -> tuple[str, str | None]:
    """(model folder, its default served name): the default model when no path is given."""
    if path:
        if not os.path.exists(path):
            raise UsageError(f"the model folder {path!r} does not exist")
        return path, None
    return str(ensure_default_model()), DEFAULT_MODEL_NAME


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    """The model, as ``MODEL_PATH`` or ``--model`` (vLLM's spellings both)."""
    parser.add_argument(
        "model_path",
        nargs="?",
        default=None,
        help="Hugging Face model folder (default: SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--model", dest="model_option", default=None, help="same as MODEL_PATH")


def model_argument(args: argparse.Namespace) -> str | None:
    """The model of ``add_model_argument``'s flags (None: the default model)."""
    if args.model_path and args.model_option and args.model_path != args.model_option:
        raise UsageError("give the model once (MODEL_PATH or --model)")
    return args.model_path or args.model_option


def reported(command: str, run: Callable[[], int]) -> int:
    """Run a command; a user's error (a bad path, option or device) is one line, not a
    traceback. ``ValueError`` covers ModelLoadError and the configs' own checks."""
    try:
        return run()
    except (UsageError, ValueError, OSError) as e:
        print(f"pagedserve {command}: {e}", file=sys.stderr)
        return 2


# ---- generate --------------------------------------------------------------------------------


def cmd_generate(args: argparse.Namespace) -> int:
    return reported("generate", lambda: _generate(args))


def _generate(args: argparse.Namespace) -> int:
    prompts = list(args.prompts)
    if args.file:
        with open(args.file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        print("pagedserve generate: give prompts as arguments or with --file", file=sys.stderr)
        return 2
    model, _ = resolve_model(args.model)
    llm = LLM(model=model, **config_kwargs(args, EngineArgs, skip=("model",)))
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
    stats = llm.engine.get_stats()
    if stats.spec_decode_num_drafts:
        print(
            f"speculative decoding: {stats.spec_decode_num_accepted_tokens} of "
            f"{stats.spec_decode_num_draft_tokens} proposed tokens accepted "
            f"({stats.spec_decode_acceptance_rate:.1%}), "
            f"{stats.spec_decode_mean_acceptance_length:.2f} tokens per verify step"
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
    add_config_args(gen.add_argument_group("engine"), EngineArgs, skip=("model",))
    gen.set_defaults(func=cmd_generate)


# ---- serve -----------------------------------------------------------------------------------


def add_serve_parser(sub) -> None:
    serve = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description=(
            "Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
            "/v1/chat/completions, /v1/models, /tokenize, /detokenize, /health, /metrics, /version)."
        ),
    )
    add_model_argument(serve)
    api_key = os.environ.get("PAGEDSERVE_API_KEY")
    server = add_config_args(serve.add_argument_group("server"), ServerConfig, api_key=api_key)
    engine = add_config_args(
        serve.add_argument_group("engine"), EngineArgs, skip=("model",), short_forms=SHORT_FORMS
    )
    add_vllm_flags(serve, {**server, **engine})
    serve.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from pagedserve.engine import AsyncLLM
    from pagedserve.server.disaggregated import with_remote_prefill
    from pagedserve.server.launcher import run_server

    level = "DEBUG" if args.log_level == "trace" else args.log_level.upper()  # uvicorn's trace
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")

    def serve() -> int:
        model_path = model_argument(args)
        config = ServerConfig(**config_kwargs(args, ServerConfig))
        sock = bind_socket(config.host, config.port)  # a busy port fails now, not after loading
        try:
            model, default_name = resolve_model(model_path)
            name = config.served_model_name or default_name or model
            engine_args = with_batch_background(
                EngineArgs(model=model, **config_kwargs(args, EngineArgs, skip=("model",))), config
            )
            # a decode engine with a prefill server sends each prompt there first (the
            # concrete AsyncLLM built here knows its block size; EngineClient does not say it)
            async_llm = AsyncLLM(engine_args)
            engine = with_remote_prefill(
                async_llm, engine_args.kv_transfer_config, async_llm.cache_config.block_size
            )
        except BaseException:
            sock.close()
            raise
        return run_server(engine, config, name, sock=sock)

    return reported("serve", serve)


def with_batch_background(engine_args: EngineArgs, config: ServerConfig) -> EngineArgs:
    """Under the priority policy, the Batch API's lines (``--batch-priority``) are the engine's
    background work unless ``--background-priority`` says otherwise: they yield every step in
    which an interactive request reads its prompt (docs/offline_jobs.md)."""
    if engine_args.scheduling_policy != "priority" or engine_args.background_priority is not None:
        return engine_args
    return replace(engine_args, background_priority=config.batch_priority)


# ---- run-batch -------------------------------------------------------------------------------


def add_run_batch_parser(sub) -> None:
    parser = sub.add_parser(
        "run-batch",
        help="answer a file of OpenAI batch requests offline (resumable)",
        description="Answer a file of OpenAI batch requests offline: one output line per input "
        "line, in OpenAI's batch output format; run again on the same output to resume "
        "(docs/offline_jobs.md).",
    )
    parser.add_argument("-i", "--input-file", required=True, help="batch requests (JSONL), or -")
    parser.add_argument("-o", "--output-file", required=True, help="the answers (JSONL), or -")
    add_model_argument(parser)
    # only the server options that shape answers: the others are about listening
    skip = tuple(f.name for f in fields(ServerConfig) if f.name not in ANSWER_OPTIONS)
    add_config_args(parser.add_argument_group("server"), ServerConfig, skip=skip)
    add_config_args(parser.add_argument_group("engine"), EngineArgs, skip=("model",))
    parser.set_defaults(func=cmd_run_batch)


def cmd_run_batch(args: argparse.Namespace) -> int:
    logging.basicConfig(level="WARNING", format="%(levelname)s %(name)s: %(message)s")

    def run() -> int:
        model, default_name = resolve_model(model_argument(args))
        config = ServerConfig(**{name: getattr(args, name) for name in ANSWER_OPTIONS})
        engine_args = EngineArgs(model=model, **config_kwargs(args, EngineArgs, skip=("model",)))
        name = config.served_model_name or default_name or model
        return asyncio.run(run_batch(engine_args, config, name, args.input_file, args.output_file))

    return reported("run-batch", run)


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads, so that a port in use is reported
    at once (uvicorn would bind it only once the engine is ready, minutes later)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    sock.set_inheritable(True)
    return sock


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedserve",
        description="pagedserve: an LLM serving engine with a paged KV cache, prefix caching and "
        "continuous batching, and an OpenAI-compatible server.",
        epilog="Run 'pagedserve serve --help', 'pagedserve generate --help' or 'pagedserve "
        "run-batch --help' for their options.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve,generate,run-batch}")
    add_serve_parser(sub)
    add_generate_parser(sub)
    add_run_batch_parser(sub)
    add_plugin_parsers(sub)
    return parser


def add_plugin_parsers(sub) -> None:
    """Subcommands of installed members that the server must not import (the cluster member's
    ``pagedserve cluster``): each names a ``pagedserve.cli`` entry point that adds its parser,
    so the dependency points from that member to the server, never back."""
    for entry_point in metadata.entry_points(group="pagedserve.cli"):
        entry_point.load()(sub)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
