"""The ``pagedserve`` command line.

    pagedserve generate [--model PATH] "prompt" ...   offline generation, printed with timing

With no --model, the default model (SmolLM2-135M-Instruct) is prepared if needed and used.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import fields

from pagedserve.engine import LLM, EngineArgs, SamplingParams


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Expose every EngineArgs field as --kebab-case, same name as in Python."""
    for f in fields(EngineArgs):
        if f.name == "model":
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            kind = int if "int" in str(f.type) else float if "float" in str(f.type) else str
            parser.add_argument(flag, type=kind, default=f.default)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {f.name: getattr(args, f.name) for f in fields(EngineArgs) if f.name != "model"}


def resolve_model(path: str | None) -> str:
    if path:
        return path
    from pagedserve.models.default_model import ensure_default_model

    return str(ensure_default_model())


def cmd_generate(args: argparse.Namespace) -> int:
    prompts = list(args.prompts)
    if args.file:
        with open(args.file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        print("pagedserve generate: give prompts as arguments or with --file", file=sys.stderr)
        return 2
    llm = LLM(model=resolve_model(args.model), **engine_kwargs(args))
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedserve", description="pagedserve: a paged-KV-cache LLM serving engine"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser(
        "generate", help="generate offline for prompts given on the command line or in a file"
    )
    gen.add_argument("prompts", nargs="*", help="prompts to complete")
    gen.add_argument(
        "--model", default=None, help="Hugging Face model folder (default: SmolLM2-135M-Instruct)"
    )
    gen.add_argument("--file", help="a file with one prompt per line")
    gen.add_argument("--chat", action="store_true", help="apply the chat template to each prompt")
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--sampling-seed", type=int, default=None)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
