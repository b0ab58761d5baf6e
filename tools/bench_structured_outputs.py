"""The throughput cost of structured outputs: the same decode workload with and without a grammar.

Workload (seeded): ``--num-requests`` requests with a random-token prompt of ``--prompt-len``
tokens, each generating exactly ``--max-tokens`` tokens at temperature 1.0, all submitted at
once (continuous batching). Three runs on one engine:

- unconstrained (EOS ignored, so every request runs to ``--max-tokens``);
- constrained: every request held to the JSON schema "an array of at least ``--max-tokens``
  integers in [0, 999]", which cannot close within ``--max-tokens``: every request runs to the
  limit, every step masks every row;
- mixed: half the requests constrained, half not (they share the batch).

Printed: output tokens/s of each run and its ratio to the unconstrained run, measured in the
same process after one warm-up of each kind (the grammar compiles once and is cached).

    python tools/bench_structured_outputs.py [--model DIR] [--num-requests 64] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import platform
import random
import time

import torch


def parse_args() -> argparse.Namespace:
    from pagedserve.models.default_model import default_model_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(default_model_dir()))
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    return parser.parse_args()


def params_for(kind: str, index: int, max_tokens: int, seed: int, min_items: int):
    from pagedserve.engine import SamplingParams
    from pagedserve.engine.structured_output import StructuredOutputsParams

    schema = {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 999},
        "minItems": min_items,
    }
    constrained = kind == "constrained" or (kind == "mixed" and index % 2 == 0)
    return SamplingParams(
        temperature=1.0,
        seed=seed + index,
        max_tokens=max_tokens,
        ignore_eos=not constrained,
        structured_outputs=StructuredOutputsParams(json=schema) if constrained else None,
    )


def run(llm, prompts, kind: str, args) -> tuple[float, int]:
    params = [
        params_for(kind, i, args.max_tokens, args.seed, args.min_items) for i in range(len(prompts))
    ]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return elapsed, tokens


def main() -> None:
    from pagedserve.engine import LLM

    args = parse_args()
    args.min_items = args.max_tokens  # the array cannot close within the run: every step masks
    llm = LLM(model=args.model, max_num_seqs=args.max_num_seqs)
    rng = random.Random(args.seed)
    vocab = llm.engine.model_config.vocab_size
    prompts = [
        {"prompt_token_ids": [rng.randrange(vocab) for _ in range(args.prompt_len)]}
        for _ in range(args.num_requests)
    ]
    kinds = ("unconstrained", "constrained", "mixed")
    for kind in kinds:  # warm-up: the grammar backend, the measured schema's grammar, numba
        run(llm, prompts[:4], kind, argparse.Namespace(**{**vars(args), "max_tokens": 4}))
    print(
        f"model {args.model}, {llm.engine.model_config.torch_dtype}, device "
        f"{llm.engine.runner.device}, {torch.get_num_threads()} threads, {platform.processor()}"
    )
    print(
        f"{args.num_requests} requests, prompt {args.prompt_len} random tokens, "
        f"{args.max_tokens} output tokens each, temperature 1.0, seed {args.seed}"
    )
    print(f"{'run':15} {'seconds':>8} {'tokens':>7} {'tok/s':>8} {'vs unconstrained':>17}")
    baseline = None
    for kind in kinds:
        elapsed, tokens = run(llm, prompts, kind, args)
        rate = tokens / elapsed
        baseline = baseline or rate
        print(f"{kind:15} {elapsed:8.2f} {tokens:7d} {rate:8.1f} {rate / baseline:16.2f}x")


if __name__ == "__main__":
    main()
