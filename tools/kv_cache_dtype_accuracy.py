"""What a narrower KV cache (``--kv-cache-dtype``) costs in accuracy and gives in tokens.

For each cache dtype, the default model (SmolLM2-135M-Instruct, fp32 weights) decodes four
prompts greedily, and the result is compared with the same engine over an fp32 cache:

- greedy tokens equal to the fp32 cache's (position by position, over all prompts), and the
  first position where a prompt's tokens part;
- teacher-forced: each token of the fp32 cache's completions scored under this cache (prompt
  logprobs), mean and largest |Δ logprob| against the fp32 cache's own scores: the error the
  cache's rounding puts into every step, free of where greedy paths part;
- blocks and tokens the default 1 GiB CPU cache holds, and one stream's time per output token
  (each dtype in its own engine, one after another in this process: a comparison within one
  run, on whatever machine runs it; say which).

    .venv/bin/python tools/kv_cache_dtype_accuracy.py [--tokens 64] [--dtypes float16 fp8]
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedserve.engine import LLM, SamplingParams
from pagedserve.models.default_model import ensure_default_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
]


def _engine(model: str, kv_cache_dtype: str) -> LLM:
    return LLM(model=model, kv_cache_dtype=kv_cache_dtype, num_cpu_threads=2)


def _greedy(llm: LLM, tokens: int) -> tuple[list[list[int]], float]:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(PROMPTS[:1], params, use_tqdm=False)  # one stream, timed
    tpot = (time.perf_counter() - start) / tokens
    outs += llm.generate(PROMPTS[1:], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], tpot


def _forced(llm: LLM, sequences: list[list[int]]) -> torch.Tensor:
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    return torch.tensor(
        [lp[t] for o, s in zip(outs, sequences) for lp, t in zip(o.prompt_logprobs[1:], s[1:])]
    )


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16", "fp8"])
    args = parser.parse_args()
    model = str(ensure_default_model())
    tokenizer_llm = _engine(model, "auto")
    baseline, base_tpot = _greedy(tokenizer_llm, args.tokens)
    prompt_ids = [tokenizer_llm.get_tokenizer().encode(p) for p in PROMPTS]
    sequences = [p + c for p, c in zip(prompt_ids, baseline)]
    base_scores = _forced(tokenizer_llm, sequences)
    base_blocks = tokenizer_llm.engine.runner.num_blocks
    del tokenizer_llm
    print(f"fp32 cache: {base_blocks} blocks, one stream {base_tpot * 1e3:.1f} ms/token")
    print("| KV cache | blocks in 1 GiB | greedy tokens equal | first difference per prompt "
          "| teacher-forced mean / max abs dlogprob | one-stream ms/token |")  # fmt: skip
    print("|---|---:|---:|---|---|---:|")
    for name in args.dtypes:
        llm = _engine(model, name)
        greedy, tpot = _greedy(llm, args.tokens)
        error = (_forced(llm, sequences) - base_scores).abs()
        equal = sum(x == y for a, b in zip(greedy, baseline) for x, y in zip(a, b))
        firsts = [_first_difference(a, b) for a, b in zip(greedy, baseline)]
        print(
            f"| {name} | {llm.engine.runner.num_blocks} | {equal} of {len(PROMPTS) * args.tokens} "
            f"| {firsts} | {error.mean():.4f} / {error.max():.4f} | {tpot * 1e3:.1f} |"
        )
        del llm


if __name__ == "__main__":
    main()
