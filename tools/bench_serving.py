"""Online serving benchmark against any OpenAI-compatible server (pagedserve, vLLM, ...).

A seeded workload of streaming ``/v1/completions`` requests — prompts of random token ids (exact
lengths, no tokenizer needed on the client), each asking for exactly N output tokens
(``ignore_eos``, as vLLM's benchmark does) — is sent at fixed concurrency levels (a closed loop:
``c`` requests in flight, a new one as soon as one finishes) and/or at a Poisson arrival rate (an
open loop: seeded exponential gaps). Per request it measures, from the streamed chunks:

- TTFT, time to first token: from sending the request to the first token arriving;
- TPOT, time per output token: (end-to-end - TTFT) / (output tokens - 1);
- ITL, inter-token latency: every gap between two consecutive streamed chunks;
- E2E: from sending to the last byte;

and reports p50/p90/p99 of each, with request and output-token throughput per run.

    .venv/bin/pagedserve serve --port 8000 &           # or any other engine on 127.0.0.1
    .venv/bin/python tools/bench_serving.py --url http://127.0.0.1:8000 --concurrency 1 4 16 \\
        --request-rate 2 --num-requests 32 --json-out serving.json --plot-dir docs/img
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx


@dataclass
class RequestSpec:
    prompt: list[int]
    output_len: int


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


@dataclass
class RunSummary:
    mode: str
    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    percentiles: dict[str, dict[str, float]]  # metric -> {"p50": ms, ...}


def make_workload(args: argparse.Namespace, vocab_size: int) -> list[RequestSpec]:
    rng = random.Random(args.seed)
    return [
        RequestSpec(
            [
                rng.randrange(args.min_token_id, vocab_size)
                for _ in range(rng.randint(args.min_prompt, args.max_prompt))
            ],
            rng.randint(args.min_output, args.max_output),
        )
        for _ in range(args.num_requests)
    ]


async def send_one(client: httpx.AsyncClient, args, spec: RequestSpec) -> RequestResult:
    """One streaming completion; timestamps every chunk that carries text."""
    body = {
        "model": args.model,
        "prompt": spec.prompt,
        "max_tokens": spec.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult(ok=False)
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if data.get("usage"):
                    result.output_tokens = data["usage"]["completion_tokens"]
                if not any(c.get("text") for c in data.get("choices", [])):
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last, chunks = now, chunks + 1
        result.e2e = time.perf_counter() - start
        result.output_tokens = result.output_tokens or chunks
        result.ok = chunks > 0
        result.error = "" if result.ok else "no tokens streamed"
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        result.error = f"{type(error).__name__}: {error}"
    return result


async def run_concurrency(client, args, workload: list[RequestSpec], concurrency: int):
    """Closed loop: ``concurrency`` requests in flight until the workload is done."""
    gate = asyncio.Semaphore(concurrency)

    async def gated(spec: RequestSpec) -> RequestResult:
        async with gate:
            return await send_one(client, args, spec)

    return await asyncio.gather(*(gated(spec) for spec in workload))


async def run_poisson(client, args, workload: list[RequestSpec], rate: float):
    """Open loop: requests arrive with seeded exponential gaps of mean 1/rate seconds."""
    rng = random.Random(args.seed + 1)
    tasks = []
    for spec in workload:
        tasks.append(asyncio.create_task(send_one(client, args, spec)))
        await asyncio.sleep(rng.expovariate(rate))
    return await asyncio.gather(*tasks)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), without numpy."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(mode: str, results: list[RequestResult], duration: float) -> RunSummary:
    done = [r for r in results if r.ok]
    metrics = {
        "ttft": [r.ttft for r in done],
        "tpot": [r.tpot for r in done if r.tpot is not None],
        "itl": [gap for r in done for gap in r.itl],
        "e2e": [r.e2e for r in done],
    }
    return RunSummary(
        mode=mode,
        completed=len(done),
        failed=len(results) - len(done),
        duration_s=duration,
        request_throughput=len(done) / duration,
        output_throughput=sum(r.output_tokens for r in done) / duration,
        percentiles={
            name: {f"p{q}": 1e3 * percentile(values, q) for q in (50, 90, 99)}
            for name, values in metrics.items()
        },
    )


def print_table(summaries: list[RunSummary]) -> None:
    head = f"{'run':<14}{'ok':>5}{'fail':>5}{'s':>8}{'req/s':>8}{'tok/s':>9}"
    for name in ("ttft", "tpot", "itl", "e2e"):
        head += f"{name + ' p50/p90/p99 (ms)':>28}"
    print(head)
    for s in summaries:
        row = f"{s.mode:<14}{s.completed:>5}{s.failed:>5}{s.duration_s:>8.1f}"
        row += f"{s.request_throughput:>8.2f}{s.output_throughput:>9.1f}"
        for name in ("ttft", "tpot", "itl", "e2e"):
            p = s.percentiles[name]
            row += f"{p['p50']:>10.0f}{p['p90']:>9.0f}{p['p99']:>9.0f}"
        print(row)


def plot(summaries: list[RunSummary], out_dir: str, title: str) -> list[str]:
    """PNGs: throughput against concurrency, and latency percentiles per run."""
    import matplotlib

    matplotlib.use("Agg")
    from pathlib import Path

    import matplotlib.pyplot as plt

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    written = []
    closed = [s for s in summaries if s.mode.startswith("c=")]
    if closed:
        fig, ax = plt.subplots(figsize=(6, 4))
        levels = [int(s.mode[2:]) for s in closed]
        ax.plot(levels, [s.output_throughput for s in closed], marker="o")
        ax.set(xlabel="concurrent requests", ylabel="output tokens/s", title=title)
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        written.append(_save(fig, Path(out_dir) / "serving_throughput.png"))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, name in zip(axes, ("ttft", "tpot", "e2e")):
        for q, offset in (("p50", -0.27), ("p90", 0), ("p99", 0.27)):
            xs = [i + offset for i in range(len(summaries))]
            ax.bar(xs, [s.percentiles[name][q] for s in summaries], width=0.27, label=q)
        ax.set_xticks(range(len(summaries)), [s.mode for s in summaries], rotation=30)
        ax.set(title=name.upper(), ylabel="ms")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    written.append(_save(fig, Path(out_dir) / "serving_latency.png"))
    return written


def _save(fig, path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return str(path)


async def discover_model(client: httpx.AsyncClient) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def main_async(args: argparse.Namespace) -> list[RunSummary]:
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # --no-keepalive: a fresh connection per request. llama-server closes a kept-alive
    # connection after a few requests, and a request sent on it as it closes fails with
    # "Server disconnected without sending a response"; the peer benchmark runs every engine so.
    keepalive = 0 if args.no_keepalive else None
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=keepalive)
    async with httpx.AsyncClient(
        base_url=args.url, headers=headers, timeout=args.timeout, limits=limits
    ) as client:
        args.model = args.model or await discover_model(client)
        workload = make_workload(args, args.vocab_size)
        await send_one(client, args, RequestSpec(workload[0].prompt[:8], 2))  # warm-up
        runs = [(f"c={c}", run_concurrency, c) for c in args.concurrency]
        runs += [(f"rate={r:g}/s", run_poisson, r) for r in args.request_rate]
        summaries = []
        for mode, runner, level in runs:
            start = time.perf_counter()
            results = await runner(client, args, workload, level)
            summaries.append(summarize(mode, results, time.perf_counter() - start))
            errors = {r.error for r in results if not r.ok}
            if errors:
                print(
                    f"{mode}: {len(errors)} kinds of failure, e.g. {sorted(errors)[0]}",
                    file=sys.stderr,
                )
        return summaries


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="base URL of the server")
    parser.add_argument(
        "--model", default=None, help="model name (default: the first of /v1/models)"
    )
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--min-prompt", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--min-output", type=int, default=16)
    parser.add_argument("--max-output", type=int, default=128)
    parser.add_argument(
        "--vocab-size", type=int, default=49152, help="prompt ids are drawn below it"
    )
    parser.add_argument("--min-token-id", type=int, default=100, help="skip the special tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 4, 16])
    parser.add_argument("--request-rate", type=float, nargs="*", default=[], help="Poisson req/s")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request seconds")
    parser.add_argument("--no-keepalive", action="store_true", help="one connection per request")
    parser.add_argument("--json-out", default=None, help="write every summary here")
    parser.add_argument("--plot-dir", default=None, help="write PNG plots here")
    args = parser.parse_args(argv)
    if args.num_requests < 1 or not 1 <= args.min_prompt <= args.max_prompt:
        parser.error("need --num-requests >= 1 and 1 <= --min-prompt <= --max-prompt")
    if not 1 <= args.min_output <= args.max_output:
        parser.error("need 1 <= --min-output <= --max-output")
    if not 0 <= args.min_token_id < args.vocab_size:
        parser.error("need 0 <= --min-token-id < --vocab-size")
    if any(c < 1 for c in args.concurrency) or any(r <= 0 for r in args.request_rate):
        parser.error("concurrency levels must be >= 1 and request rates > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    summaries = asyncio.run(main_async(args))
    print(
        f"server {args.url}, model {args.model}; {args.num_requests} requests per run, prompts "
        f"{args.min_prompt}..{args.max_prompt} random token ids, outputs exactly "
        f"{args.min_output}..{args.max_output} tokens (ignore_eos), seed {args.seed}\n"
    )
    print_table(summaries)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "runs": [asdict(s) for s in summaries]}, f, indent=2)
    if args.plot_dir:
        title = f"{args.model.rsplit('/', 1)[-1]} @ {args.url}"
        for path in plot(summaries, args.plot_dir, title):
            print(f"wrote {path}")
    return 0 if all(s.failed == 0 for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
