"""Interactive TTFT while a Batch API batch runs, against the same server idle.

The claim it measures (issue 40): batch requests run at the lowest priority with a cap on their
share of the running sequences, so that while a large batch runs, interactive requests' TTFT p50
stays within 1.5x of the idle server's, and the batch still progresses.

Two phases on one server, the same seeded interactive workload in each (streaming
``/v1/completions`` of random token ids, exact output lengths, ``c`` in flight: bench_serving's):

1. idle: the interactive workload alone (the baseline);
2. under batch: a batch of ``--batch-size`` completion requests is uploaded and started through
   /v1/files and /v1/batches, and once it runs (``--batch-warmup-s``), the interactive workload
   again; the batch's completed lines before and after say how fast it progressed meanwhile.

Then the batch is cancelled (unless ``--keep-batch``) and one table printed: TTFT p50/p90/p99
per phase, the ratio of the p50s against the 1.5x bound, and the batch's lines/s.

    .venv/bin/pagedserve serve --scheduling-policy priority --batch-store /tmp/bench-batches &
    .venv/bin/python tools/bench_batch_interference.py --url http://127.0.0.1:8000 \\
        --batch-size 2000 --num-requests 64 --concurrency 4 --json-out batch_interference.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict

import bench_serving
import httpx

BOUND = 1.5  # the issue's: TTFT p50 under a batch within 1.5x of the idle server's


def batch_file(args: argparse.Namespace) -> bytes:
    """``--batch-size`` completion requests of random token ids, exact output lengths."""
    rng = random.Random(args.seed + 2)
    lines = []
    for i in range(args.batch_size):
        length = rng.randint(args.batch_min_prompt, args.batch_max_prompt)
        prompt = [rng.randrange(args.min_token_id, args.vocab_size) for _ in range(length)]
        body = {
            "model": args.model,
            "prompt": prompt,
            "max_tokens": args.batch_output,
            "ignore_eos": True,
            "temperature": 0.0,
        }
        line = {"custom_id": f"b{i}", "method": "POST", "url": "/v1/completions", "body": body}
        lines.append(json.dumps(line))
    return ("\n".join(lines) + "\n").encode()


async def start_batch(client: httpx.AsyncClient, args: argparse.Namespace) -> str:
    files = {"file": ("bench.jsonl", batch_file(args), "application/jsonl")}
    upload = await client.post("/v1/files", files=files, data={"purpose": "batch"})
    upload.raise_for_status()
    body = {
        "input_file_id": upload.json()["id"],
        "endpoint": "/v1/completions",
        "completion_window": "24h",
    }
    batch = await client.post("/v1/batches", json=body)
    batch.raise_for_status()
    return batch.json()["id"]


async def batch_state(client: httpx.AsyncClient, batch_id: str) -> dict:
    response = await client.get(f"/v1/batches/{batch_id}")
    response.raise_for_status()
    return response.json()


async def interactive(client, args, workload, mode: str) -> bench_serving.RunSummary:
    start = time.perf_counter()
    results = await bench_serving.run_concurrency(client, args, workload, args.concurrency)
    summary = bench_serving.summarize(mode, results, time.perf_counter() - start)
    errors = {r.error for r in results if not r.ok}
    if errors:
        print(f"{mode}: {len(errors)} kinds of failure, e.g. {sorted(errors)[0]}", file=sys.stderr)
    return summary


async def main_async(args: argparse.Namespace) -> dict:
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(
        base_url=args.url, headers=headers, timeout=args.timeout
    ) as client:
        args.model = args.model or await bench_serving.discover_model(client)
        workload = bench_serving.make_workload(args, args.vocab_size)
        await bench_serving.send_one(
            client, args, bench_serving.RequestSpec(workload[0].prompt[:8], 2)
        )
        idle = await interactive(client, args, workload, "idle")
        batch_id = await start_batch(client, args)
        deadline = time.monotonic() + args.batch_warmup_s
        while (
            time.monotonic() < deadline
            or (await batch_state(client, batch_id))["status"] == "validating"
        ):
            await asyncio.sleep(0.2)
        before = await batch_state(client, batch_id)
        started = time.perf_counter()
        loaded = await interactive(client, args, workload, "under batch")
        after = await batch_state(client, batch_id)
        elapsed = time.perf_counter() - started
        if not args.keep_batch and after["status"] in ("validating", "in_progress"):
            await client.post(f"/v1/batches/{batch_id}/cancel")
    done = after["request_counts"]["completed"] - before["request_counts"]["completed"]
    return {
        "idle": idle,
        "under_batch": loaded,
        "batch": {
            "id": batch_id,
            "status_after": after["status"],
            "lines_done_meanwhile": done,
            "lines_per_s": done / elapsed,
            "still_running": after["status"] == "in_progress",
        },
    }


def report(args: argparse.Namespace, result: dict) -> float:
    """Print the table; the ratio of the TTFT p50s (under batch / idle)."""
    print(
        f"server {args.url}, model {args.model}; interactive: {args.num_requests} streaming "
        f"completions, c={args.concurrency}, prompts {args.min_prompt}..{args.max_prompt} random "
        f"token ids, outputs {args.min_output}..{args.max_output} tokens; batch: {args.batch_size} "
        f"completions, prompts {args.batch_min_prompt}..{args.batch_max_prompt}, "
        f"{args.batch_output} output tokens; seed {args.seed}\n"
    )
    print(f"{'phase':<12} {'ok':>4} {'fail':>4} {'TTFT p50 ms':>12} {'p90':>9} {'p99':>9}")
    for summary in (result["idle"], result["under_batch"]):
        ttft = summary.percentiles["ttft"]
        print(
            f"{summary.mode:<12} {summary.completed:>4} {summary.failed:>4} "
            f"{ttft['p50']:>12.1f} {ttft['p90']:>9.1f} {ttft['p99']:>9.1f}"
        )
    ratio = (
        result["under_batch"].percentiles["ttft"]["p50"] / result["idle"].percentiles["ttft"]["p50"]
    )
    batch = result["batch"]
    verdict = "within" if ratio <= BOUND else "OVER"
    print(f"\nTTFT p50 under batch / idle: {ratio:.2f}x ({verdict} the {BOUND}x bound)")
    print(
        f"batch: {batch['lines_done_meanwhile']} lines done during the phase "
        f"({batch['lines_per_s']:.1f} lines/s), status {batch['status_after']}"
    )
    if not batch["still_running"]:
        print("warning: the batch was not running to the end of the phase: enlarge --batch-size")
    return ratio


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="base URL of the server")
    parser.add_argument("--model", default=None, help="default: the first of /v1/models")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-requests", type=int, default=64, help="interactive, per phase")
    parser.add_argument("--concurrency", type=int, default=4, help="interactive in flight")
    parser.add_argument("--min-prompt", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--min-output", type=int, default=16)
    parser.add_argument("--max-output", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=2000)
    parser.add_argument("--batch-min-prompt", type=int, default=64)
    parser.add_argument("--batch-max-prompt", type=int, default=512)
    parser.add_argument("--batch-output", type=int, default=128)
    parser.add_argument("--batch-warmup-s", type=float, default=5.0, help="let the batch fill up")
    parser.add_argument("--keep-batch", action="store_true", help="do not cancel it at the end")
    parser.add_argument(
        "--vocab-size", type=int, default=49152, help="prompt ids are drawn below it"
    )
    parser.add_argument("--min-token-id", type=int, default=100, help="skip the special tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request seconds")
    parser.add_argument("--json-out", default=None, help="write the figures here")
    args = parser.parse_args(argv)
    if min(args.num_requests, args.concurrency, args.batch_size, args.batch_output) < 1:
        parser.error("request counts, concurrency and --batch-output must be >= 1")
    if not 1 <= args.min_prompt <= args.max_prompt or not 1 <= args.min_output <= args.max_output:
        parser.error("need 1 <= --min-prompt <= --max-prompt and 1 <= --min-output <= --max-output")
    if not 1 <= args.batch_min_prompt <= args.batch_max_prompt:
        parser.error("need 1 <= --batch-min-prompt <= --batch-max-prompt")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = asyncio.run(main_async(args))
    ratio = report(args, result)
    if args.json_out:
        figures = {
            "args": vars(args),
            "ttft_p50_ratio": ratio,
            "idle": asdict(result["idle"]),
            "under_batch": asdict(result["under_batch"]),
            "batch": result["batch"],
        }
        with open(args.json_out, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
