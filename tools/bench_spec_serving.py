"""Speculative decoding served: ``pagedserve serve`` with and without ``--speculative-config``,
streamed over HTTP at fixed concurrency (16 streams by default).

One server per configuration is started on 127.0.0.1 (plain, then speculative), each sent the
same seeded workload by bench_serving's client (a closed loop of streaming /v1/completions,
``ignore_eos``, greedy): the ``repeat`` prompts of bench_spec_decode (a passage to copy out
again, tokenized here so the client sends token ids) or ``--workload random`` (random ids).
Output tokens/s, p50 TPOT and p50 ITL per run, and the ratio speculative / plain, measured in
the same invocation. Streaming under speculation sends several tokens per chunk, so ITL is per
chunk and TPOT is the fairer latency figure.

    .venv/bin/python tools/bench_spec_serving.py                       # SmolLM2, n-gram k=4
    .venv/bin/python tools/bench_spec_serving.py --speculative-config \\
        '{"method": "draft_model", "model": "DRAFT", "num_speculative_tokens": 4}'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_serving  # noqa: E402
import bench_spec_decode  # noqa: E402

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'  # noqa: E501


def workload(args: argparse.Namespace, model: str) -> list[bench_serving.RequestSpec]:
    """``args.num_requests`` requests of exactly ``args.max_tokens`` output tokens each."""
    from pagedserve.models import load_tokenizer

    tokenizer = load_tokenizer(model)
    n = args.num_requests
    if args.workload == "repeat":
        texts = bench_spec_decode.repeat_prompts(n, args.passage_words, args.seed)
        prompts = [tokenizer.encode(t) for t in texts]
    else:
        vocab = len(tokenizer)
        prompts = [
            p["prompt_token_ids"]
            for p in bench_spec_decode.random_prompts(n, args.random_prompt_len, vocab, args.seed)
        ]
    return [bench_serving.RequestSpec(p, args.max_tokens) for p in prompts]


async def one_server(url: str, args, specs, concurrency: int) -> bench_serving.RunSummary:
    """Warm up, then the closed loop at ``concurrency``; the run's summary."""
    import time

    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout, limits=limits) as client:
        args.model = await bench_serving.discover_model(client)
        await bench_serving.send_one(client, args, bench_serving.RequestSpec(specs[0].prompt, 4))
        start = time.perf_counter()
        results = await bench_serving.run_concurrency(client, args, specs, concurrency)
        return bench_serving.summarize(f"c={concurrency}", results, time.perf_counter() - start)


def measure(model: str, server_args: list[str], args, specs):
    """Each concurrency level's summary, and the server's acceptance rate over all of them
    (/metrics; None without speculation)."""
    from pagedserve.server.testing import live_server

    with live_server(model, *server_args) as server:
        summaries = [asyncio.run(one_server(server.url, args, specs, c)) for c in args.concurrency]
        drafts = server.metric("spec_decode_num_draft_tokens_total")
        accepted = server.metric("spec_decode_num_accepted_tokens_total")
    return summaries, (accepted / drafts if drafts else None)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M)")
    parser.add_argument("--speculative-config", default=NGRAM, help="vLLM's JSON")
    parser.add_argument("--workload", default="repeat", choices=["repeat", "random"])
    parser.add_argument("--concurrency", type=int, nargs="*", default=[16])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--passage-words", type=int, default=60)
    parser.add_argument("--random-prompt-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request seconds")
    parser.add_argument(
        "--server-arg", action="append", default=[], help="passed to both servers (repeat)"
    )
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from pagedserve.engine import ensure_default_model

    model = args.model or str(ensure_default_model())
    specs = workload(args, model)
    base_args = [a for arg in args.server_arg for a in arg.split(" ", 1)]
    plain, _ = measure(model, base_args, args, specs)
    spec_args = [*base_args, "--speculative-config", args.speculative_config]
    spec, acceptance = measure(model, spec_args, args, specs)
    print(
        f"model {model}, {args.workload} workload, {args.num_requests} streamed requests x "
        f"{args.max_tokens} greedy tokens, seed {args.seed}; speculative {args.speculative_config}"
        f"; acceptance over the speculative server's runs {acceptance or 0:.1%}"
    )
    print("conc  plain tok/s  spec tok/s  ratio  plain TPOT p50  spec TPOT p50  failed")
    rows = []
    for p, s in zip(plain, spec, strict=True):
        ratio = s.output_throughput / p.output_throughput
        tpot_p, tpot_s = p.percentiles["tpot"]["p50"], s.percentiles["tpot"]["p50"]
        print(
            f"{p.mode[2:]:>4}  {p.output_throughput:11.1f}  {s.output_throughput:10.1f}  "
            f"{ratio:5.2f}  {tpot_p:11.1f} ms  {tpot_s:10.1f} ms  {p.failed + s.failed:6}"
            + ("  (speculation loses)" if ratio < 1 else "")
        )
        rows.append(
            dict(concurrency=p.mode, plain=p.__dict__, spec=s.__dict__, ratio=ratio,
                 acceptance=acceptance)
        )  # fmt: skip
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)
    return 0 if all(p.failed == 0 and s.failed == 0 for p, s in zip(plain, spec)) else 1


if __name__ == "__main__":
    sys.exit(main())
