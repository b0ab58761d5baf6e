"""Speculative decoding (n-gram or draft-model proposals) against plain decoding: same model,
same workloads.

Two seeded workloads, each at concurrency 1 and 16 (``max_num_seqs``; the requests of a run all
arrive at once):

- ``repeat``: the answer repeats the prompt's context. Each prompt gives a passage of
  ``--passage-words`` words drawn at random from a fixed word list and asks for it copied out
  again (as editing or quoting a given text does), so prompt lookup finds what comes next.
- ``random``: prompts of random token ids (``--random-prompt-len`` tokens): the answers owe
  nothing to the prompt, and proposals are rare and mostly rejected.

Every request generates exactly ``--max-tokens`` tokens greedily (EOS ignored). Throughput is
generated tokens per second over the wall time of the whole run (engine construction excluded);
the ratio is speculation over plain decoding, measured in the same run. Greedy outputs must be
identical with and without speculation, and the tool checks it. On a compute-bound CPU, the
verify step's 1 + k tokens per sequence cost nearly k + 1 decodes' compute when the batch is
already large, so speculation can lose at high concurrency: the table says so when it does.

    .venv/bin/python tools/bench_spec_decode.py                    # SmolLM2-135M fp32
    .venv/bin/python tools/bench_spec_decode.py --requests-per-run 4 --max-tokens 32
    .venv/bin/python tools/bench_spec_decode.py --method draft_model --draft-layers 2
    .venv/bin/python tools/bench_spec_decode.py --method draft_model --draft PATH

``--method draft_model`` proposes with ``--draft`` (a folder), or by default with the model cut
to its first ``--draft-layers`` layers (tools/make_draft_model.py, written to a temporary
folder). The served variant, over HTTP with concurrent streams: tools/bench_spec_serving.py.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # make_draft_model

WORDS = (
    "the cache holds keys and values for every token of every sequence in fixed size blocks "
    "so that memory is shared between requests and nothing is reserved in advance while a "
    "scheduler decides each step which sequences run and how many tokens each may take"
).split()


def repeat_prompts(num: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        passage = " ".join(rng.choice(WORDS) for _ in range(words))
        prompts.append(f"Copy the passage exactly.\nPassage: {passage}\nCopy: {passage[:40]}")
    return prompts


def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(vocab_size) for _ in range(length)]} for _ in range(num)
    ]


def run(model: str, prompts, concurrency: int, args, speculative: bool):
    """(tokens/s, outputs' token ids, acceptance rate, mean acceptance length)."""
    from pagedserve.engine import LLM, SamplingParams

    spec = speculative_config(args) if speculative else None
    llm = LLM(
        model=model,
        dtype=args.dtype,
        max_num_seqs=concurrency,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        speculative_config=spec,
    )
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    stats = llm.engine.get_stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return (
        tokens / elapsed,
        [o.outputs[0].token_ids for o in outputs],
        stats.spec_decode_acceptance_rate,
        stats.spec_decode_mean_acceptance_length,
    )


def speculative_config(args: argparse.Namespace) -> dict:
    """vLLM's dict for ``--method`` (``args.draft`` set for draft_model: ``resolve_draft``)."""
    if args.method == "draft_model":
        return {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k}
    return {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_min": args.lookup_min,
        "prompt_lookup_max": args.lookup_max,
    }


def resolve_draft(args: argparse.Namespace, model: str, scratch: str) -> str:
    """The draft folder: ``--draft``, else ``model`` cut to ``--draft-layers`` in ``scratch``;
    describes it for the header."""
    if args.method != "draft_model":
        return f"ngram k={args.k} lookup {args.lookup_min}..{args.lookup_max}"
    if args.draft is None:
        from make_draft_model import truncate_layers

        args.draft = str(truncate_layers(model, args.draft_layers, f"{scratch}/draft"))
        return f"draft_model k={args.k}: the model's first {args.draft_layers} layers"
    return f"draft_model k={args.k}: {args.draft}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--concurrency", default="1,16", help="comma list of max_num_seqs")
    parser.add_argument("--requests-per-run", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--passage-words", type=int, default=60)
    parser.add_argument("--random-prompt-len", type=int, default=64)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--method", default="ngram", choices=["ngram", "draft_model"])
    parser.add_argument("--draft", default=None, help="draft_model: the draft's folder")
    parser.add_argument(
        "--draft-layers", type=int, default=2, help="draft_model without --draft: layers kept"
    )
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None, help="KV blocks")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from pagedserve.engine import ensure_default_model
    from pagedserve.models import ModelConfig

    model = args.model or str(ensure_default_model())
    vocab = ModelConfig(model=model).vocab_size
    n = args.requests_per_run
    workloads = {
        "repeat": repeat_prompts(n, args.passage_words, args.seed),
        "random": random_prompts(n, args.random_prompt_len, vocab, args.seed),
    }
    with tempfile.TemporaryDirectory() as scratch:
        proposer = resolve_draft(args, model, scratch)
        print(
            f"model {model} ({args.dtype}), {n} requests per run, {args.max_tokens} greedy "
            f"tokens each, {proposer}, seed {args.seed}; "
            f"{platform.processor() or platform.machine()}"
        )
        rows, identical = measure(model, workloads, args)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)
    print("greedy outputs identical with and without speculation:", identical)
    return 0 if identical else 1


def measure(model: str, workloads: dict, args: argparse.Namespace) -> tuple[list[dict], bool]:
    """The table's rows, printed as they come, and whether every greedy output matched."""
    header = "workload  conc  plain tok/s  spec tok/s  ratio  acceptance  mean accepted len"
    print(header)
    rows, identical = [], True
    for name, prompts in workloads.items():
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            plain, plain_ids, _, _ = run(model, prompts, concurrency, args, speculative=False)
            spec, spec_ids, rate, length = run(model, prompts, concurrency, args, speculative=True)
            identical &= plain_ids == spec_ids
            row = dict(workload=name, concurrency=concurrency, plain=plain, spec=spec)
            row.update(ratio=spec / plain, acceptance=rate, mean_accepted_length=length)
            rows.append(row)
            verdict = "  (speculation loses)" if spec < plain else ""
            print(
                f"{name:8}  {concurrency:4}  {plain:11.1f}  {spec:10.1f}  {spec / plain:5.2f}"
                f"  {rate:10.1%}  {length:17.2f}{verdict}"
            )
    return rows, identical


if __name__ == "__main__":
    sys.exit(main())
