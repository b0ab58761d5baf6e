"""Peer benchmark: pagedserve's server against llama.cpp's llama-server, same model, same workload.

One run builds (once, cached) llama.cpp's ``llama-server`` from PyPI's ``llama-cpp-python``
source package and converts the HF folder to an f32 GGUF with llama.cpp's own converter
(tools/llamacpp_build.py), then serves the model with each engine in turn, each alone on the
machine with the same thread count, and drives each with tools/bench_serving.py's client:

- the same seeded workload for every engine: prompts of random token ids (identical ids sent
  to both, no tokenizer involved), each asking for exactly N output tokens (``ignore_eos``);
- closed loops at each ``--concurrency`` level, with ``--num-requests`` requests per level
  (each level its own seed, so no level's prompts are in a prefix cache from the one before);
- one long prompt (``--long-prompt`` tokens, one output token) a few times: its TTFT, and
  (before any server starts) one transformers forward over each of the same prompts, the floor
  a prefill is held to;
- llama-server with its default f16 KV cache and with an f32 one; pagedserve with its fp32 KV
  cache (and, with ``--pagedserve-kv-cache-dtype``, others: llama.cpp's f16 is a 16-bit cache).

It prints each engine's table and the ratios pagedserve / llama.cpp: output tokens/s (higher
is better for pagedserve), TPOT p50 and TTFT p50 (lower is better for pagedserve).

The machine's speed drifts (a 2-core VM's memory bandwidth moved by 25 % and more between
runs minutes apart), and one engine runs after the other, so one run's ratio carries that
drift. ``--rounds N`` runs the whole sequence N times, in turns (A B, then B A, ...; each
server started afresh, so no prefix cache carries over), prints each round's ratios and then
the median, lowest and highest ratio over the rounds.

    .venv/bin/python tools/bench_llamacpp.py                 # SmolLM2-135M f32, 2 threads
    .venv/bin/python tools/bench_llamacpp.py --concurrency 1 16 --num-requests 8 32
    .venv/bin/python tools/bench_llamacpp.py --concurrency 1 16 --num-requests 8 48 \
        --long-prompt 0 --llamacpp-cache-type f16 --rounds 2        # A B B A

Quantized files, the same file on both sides: ``--gguf FILE`` serves FILE with each engine;
``--quantize TYPE`` makes that file from ``--model`` with llama.cpp's converter and its own
``llama-quantize`` (Q4_K_M, Q5_K_M, Q8_0, ...: llama.cpp's per-tensor choices, the files its
users have), cached beside the f32 conversion. The transformers floor then runs only when
``--model`` names the unquantized folder (its fp32 forward is not the quantized file's).

    .venv/bin/python tools/bench_llamacpp.py --quantize Q4_K_M --concurrency 1 16 \
        --num-requests 8 48 --llamacpp-cache-type f16
    .venv/bin/python tools/make_llama_1b.py --out /tmp/llama-1b
    .venv/bin/python tools/bench_llamacpp.py --model /tmp/llama-1b --quantize Q8_0 ...
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import bench_serving
import httpx
import llamacpp_build


@dataclass
class Server:
    """One engine as the benchmark launches it."""

    name: str
    command: list[str]
    env: dict[str, str]


def thread_env(threads: int) -> dict[str, str]:
    """Every thread pool an engine may size from the environment, set to ``threads``."""
    return {name: str(threads) for name in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS")}


def llama_server_command(
    binary: Path, gguf: Path, port: int, threads: int, cache_type: str, parallel: int, ctx: int
) -> list[str]:
    """llama-server with ``parallel`` slots over one unified KV cache of ``ctx`` tokens (so one
    slot may take a long prompt), continuous batching, no prompt cache kept beyond the slots."""
    return [
        str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
        "-t", str(threads), "-tb", str(threads), "-np", str(parallel), "-c", str(ctx),
        "--kv-unified", "-ctk", cache_type, "-ctv", cache_type, "--cont-batching",
        "--cache-ram", "0", "--no-webui",
    ]  # fmt: skip


def pagedserve_command(model: str, port: int, threads: int, kv_cache_dtype: str) -> list[str]:
    return [
        sys.executable, "-m", "pagedserve.server.cli", "serve", model, "--port", str(port),
        "--num-cpu-threads", str(threads), "--kv-cache-dtype", kv_cache_dtype,
        "--max-num-seqs", "64",
    ]  # fmt: skip


def servers(args: argparse.Namespace, binary: Path, gguf: Path) -> list[Server]:
    """pagedserve on the HF folder (or, with ``--gguf`` / ``--quantize``, on llama.cpp's very
    file), then llama-server on ``gguf``."""
    ctx = max(args.concurrency) * 1024 + args.long_prompt + 16
    parallel = max(args.concurrency)
    env = thread_env(args.threads)
    ours = str(gguf) if args.gguf or args.quantize else args.model
    listed = [
        Server(
            f"pagedserve kv {dtype}",
            pagedserve_command(ours, args.port, args.threads, dtype),
            env,
        )
        for dtype in args.pagedserve_kv_cache_dtype
    ]
    listed += [
        Server(
            f"llama.cpp kv {kv}",
            llama_server_command(binary, gguf, args.port, args.threads, kv, parallel, ctx),
            env,
        )
        for kv in args.llamacpp_cache_type
    ]
    return listed


@contextlib.contextmanager
def running(server: Server, url: str, log_dir: Path, timeout: float = 600.0) -> Iterator[None]:
    """Start the server, wait until /health answers 200, stop it (SIGTERM, then SIGKILL)."""
    log = open(log_dir / f"{server.name.replace(' ', '_')}.log", "w")
    proc = subprocess.Popen(
        server.command, env={**os.environ, **server.env}, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{server.name} exited with {proc.returncode}; see {log.name}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{server.name} not healthy after {timeout:.0f} s")
            time.sleep(1)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def level_args(args: argparse.Namespace, url: str, concurrency: int, num_requests: int):
    """bench_serving's own arguments for one concurrency level (its seed: base + level)."""
    return bench_serving.parse_args(
        [
            "--url", url, "--num-requests", str(num_requests), "--concurrency", str(concurrency),
            "--min-prompt", str(args.min_prompt), "--max-prompt", str(args.max_prompt),
            "--min-output", str(args.min_output), "--max-output", str(args.max_output),
            "--vocab-size", str(args.vocab_size), "--seed", str(args.seed + concurrency),
            "--no-keepalive",
        ]
    )  # fmt: skip


def long_prompts(args: argparse.Namespace) -> list[list[int]]:
    """``--long-prompt-repeats`` distinct prompts of ``--long-prompt`` ids, the same for every
    engine (and for the transformers baseline)."""
    rng = random.Random(args.seed - 1)
    return [
        [rng.randrange(100, args.vocab_size) for _ in range(args.long_prompt)]
        for _ in range(args.long_prompt_repeats)
    ]


def transformers_forward_ms(args: argparse.Namespace) -> list[float]:
    """The long prompt's floor: one transformers forward over each long prompt (fp32, the
    server's thread count, only the last position's logits), in ms. Run before any server
    starts, so it has the machine to itself."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    times = []
    with torch.inference_mode():
        model(torch.tensor([long_prompts(args)[0][:64]]), logits_to_keep=1)  # warm-up
        for prompt in long_prompts(args):
            start = time.perf_counter()
            model(torch.tensor([prompt]), logits_to_keep=1)
            times.append(1e3 * (time.perf_counter() - start))
    return times


async def long_prompt_ttfts(url: str, args: argparse.Namespace) -> list[float]:
    """TTFT in ms of ``--long-prompt-repeats`` distinct prompts of ``--long-prompt`` ids."""
    spec_args = level_args(args, url, 1, 1)
    ttfts = []
    async with httpx.AsyncClient(base_url=url, timeout=600.0) as client:
        spec_args.model = await bench_serving.discover_model(client)
        for prompt in long_prompts(args):
            result = await bench_serving.send_one(
                client, spec_args, bench_serving.RequestSpec(prompt, 2)
            )
            if not result.ok:
                raise RuntimeError(f"long prompt failed: {result.error}")
            ttfts.append(1e3 * result.ttft)
    return ttfts


def measure(server: Server, args: argparse.Namespace, log_dir: Path) -> dict:
    url = f"http://127.0.0.1:{args.port}"
    with running(server, url, log_dir):
        runs = []
        for concurrency, num_requests in zip(args.concurrency, args.num_requests):
            summaries = asyncio.run(
                bench_serving.main_async(level_args(args, url, concurrency, num_requests))
            )
            runs += summaries
            if any(summary.failed for summary in summaries):
                raise RuntimeError(f"{server.name}: requests failed at concurrency {concurrency}")
        ttfts = asyncio.run(long_prompt_ttfts(url, args)) if args.long_prompt else []
    return {"runs": runs, "long_ttft_ms": ttfts}


def ratio_rows(results: dict[str, dict], ours: str) -> list[tuple[str, str, float, float, float]]:
    """(peer, run, tokens/s ratio, TPOT p50 ratio, TTFT p50 ratio), ours over each peer's; the
    long prompt's row compares median TTFTs only (NaN in the other columns)."""
    mine = {s.mode: s for s in results[ours]["runs"]}
    rows = []
    for name, result in results.items():
        if name == ours:
            continue
        for peer in result["runs"]:
            s = mine.get(peer.mode)
            if s is None:
                continue
            rows.append(
                (
                    name,
                    peer.mode,
                    s.output_throughput / peer.output_throughput,
                    s.percentiles["tpot"]["p50"] / peer.percentiles["tpot"]["p50"],
                    s.percentiles["ttft"]["p50"] / peer.percentiles["ttft"]["p50"],
                )
            )
        if results[ours]["long_ttft_ms"] and result["long_ttft_ms"]:
            long = statistics.median(results[ours]["long_ttft_ms"])
            peer_long = statistics.median(result["long_ttft_ms"])
            rows.append((name, "long prompt", float("nan"), float("nan"), long / peer_long))
    return rows


def print_ratios(rows: list[tuple[str, str, float, float, float]], ours: str) -> None:
    print(f"\n{ours} / peer   (tok/s: > 1 is faster; TPOT, TTFT: < 1 is faster)")
    print(f"{'peer':<22}{'run':<14}{'tok/s x':>9}{'TPOT p50 x':>12}{'TTFT p50 x':>12}")
    for peer, mode, tokens, tpot, ttft in rows:
        print(f"{peer:<22}{mode:<14}{tokens:>9.2f}{tpot:>12.2f}{ttft:>12.2f}")


def print_ratio_summary(
    rounds: list[list[tuple[str, str, float, float, float]]], ours: str
) -> None:
    """Median (lowest..highest) of each ratio over the rounds."""
    by_run: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for rows in rounds:
        for peer, mode, *ratios in rows:
            by_run.setdefault((peer, mode), []).append(tuple(ratios))
    print(f"\n{ours} / peer over {len(rounds)} rounds: median (lowest..highest)")
    print(f"{'peer':<22}{'run':<14}{'tok/s x':>20}{'TPOT p50 x':>20}{'TTFT p50 x':>20}")
    for (peer, mode), ratios in by_run.items():
        cells = []
        for column in zip(*ratios):
            cells.append(f"{statistics.median(column):.2f} ({min(column):.2f}..{max(column):.2f})")
        print(f"{peer:<22}{mode:<14}" + "".join(f"{c:>20}" for c in cells))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--gguf", default=None, help="serve this GGUF file on both sides")
    parser.add_argument(
        "--quantize", default=None, help="serve llama-quantize's file of --model at this type"
    )
    parser.add_argument("--threads", type=int, default=2, help="threads of each server")
    parser.add_argument("--port", type=int, default=18450)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument(
        "--num-requests", type=int, nargs="+", default=[16, 32, 64], help="one per level"
    )
    parser.add_argument("--min-prompt", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--min-output", type=int, default=16)
    parser.add_argument("--max-output", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, default=49152)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--long-prompt", type=int, default=2000, help="0: skip the long prompt")
    parser.add_argument("--long-prompt-repeats", type=int, default=3)
    parser.add_argument(
        "--llamacpp-cache-type", nargs="*", default=["f16", "f32"], help="none: pagedserve only"
    )
    parser.add_argument(
        "--pagedserve-kv-cache-dtype", nargs="*", default=["auto"], help="none: llama.cpp only"
    )
    parser.add_argument(
        "--no-transformers-baseline",
        dest="transformers_baseline",
        action="store_false",
        help="skip timing one transformers forward over each long prompt",
    )
    parser.add_argument("--jobs", type=int, default=2, help="compile jobs for llama.cpp's build")
    parser.add_argument("--log-dir", default="/tmp/bench_llamacpp", help="servers' logs")
    parser.add_argument(
        "--rounds", type=int, default=1, help="run every server this many times, in turns"
    )
    args = parser.parse_args(argv)
    if len(args.num_requests) != len(args.concurrency):
        parser.error("give one --num-requests per --concurrency level")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.gguf and args.quantize:
        parser.error("--gguf serves a given file, --quantize makes one: give one of them")
    if args.gguf and args.model is None:  # no unquantized folder: no fp32 floor to time
        args.transformers_baseline = False
    if args.model is None:
        from pagedserve.models.default_model import ensure_default_model

        args.model = str(ensure_default_model())
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    binary = gguf = Path("-")
    if args.llamacpp_cache_type or args.quantize:
        binary = llamacpp_build.build_llama_server(jobs=args.jobs)
    if args.gguf:
        gguf = Path(args.gguf)
    elif args.quantize:
        gguf = llamacpp_build.quantize_gguf(Path(args.model), args.quantize, threads=args.threads)
    elif args.llamacpp_cache_type:
        gguf = llamacpp_build.convert_to_gguf(Path(args.model))
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"model {args.model} (GGUF {gguf.name}, served by "
        f"{'both' if args.gguf or args.quantize else 'llama.cpp'}); "
        f"{args.threads} threads per server; "
        f"prompts {args.min_prompt}..{args.max_prompt} random token ids, outputs exactly "
        f"{args.min_output}..{args.max_output} tokens (ignore_eos); levels "
        f"{dict(zip(args.concurrency, args.num_requests))} (concurrency: requests), seed "
        f"{args.seed} + level; long prompt {args.long_prompt} tokens x {args.long_prompt_repeats}"
    )
    results = {}
    if args.long_prompt and args.transformers_baseline:
        forward_ms = transformers_forward_ms(args)
        results["transformers forward"] = {"runs": [], "long_ttft_ms": forward_ms}
        times = ", ".join(f"{t:.0f}" for t in forward_ms)
        print(
            f"\n== transformers: one forward over each {args.long_prompt}-token prompt (ms): {times}"
        )
    listed = servers(args, binary, gguf)
    round_ratios: dict[str, list] = {}
    for round_index in range(args.rounds):
        this_round = dict(results)  # the transformers baseline, then this round's servers
        for server in listed if round_index % 2 == 0 else listed[::-1]:
            load = " ".join(f"{x:.1f}" for x in os.getloadavg())
            print(f"\n== round {round_index + 1}: {server.name} (load average before: {load})")
            this_round[server.name] = measure(server, args, log_dir)
            bench_serving.print_table(this_round[server.name]["runs"])
            if this_round[server.name]["long_ttft_ms"]:
                ttfts = ", ".join(f"{t:.0f}" for t in this_round[server.name]["long_ttft_ms"])
                print(f"{args.long_prompt}-token prompt TTFT (ms): {ttfts}")
        for ours in (name for name in this_round if name.startswith("pagedserve")):
            rows = ratio_rows(this_round, ours)
            print_ratios(rows, ours)
            round_ratios.setdefault(ours, []).append(rows)
    if args.rounds > 1:
        for ours, rounds in round_ratios.items():
            print_ratio_summary(rounds, ours)
    return 0


if __name__ == "__main__":
    sys.exit(main())
