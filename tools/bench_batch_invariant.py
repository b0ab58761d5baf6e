"""What ``--batch-invariant`` costs: offline throughput with the mode off and on, same workload.

The workload is bench_throughput's, seeded and spelled out: ``--num-requests`` prompts of
uniformly random length in [min_prompt, max_prompt] made of random token ids, each asking for
exactly a uniformly random number of output tokens in [min_output, max_output] (EOS ignored),
greedy; at most ``--max-num-seqs`` sequences run at once (16 streams by default). Both engines
are built once, in this process, and the workload runs ``--rounds`` times on each, the modes
alternating so that the machine's other work falls on both alike; the table gives each mode's
median and the ratio against the mode off.

Where the cost comes from: each mode's last round runs under cProfile, and the table below the
first splits its time between the GEMMs (the numba kernel, torch's ``linear``: MKL on a CPU,
cuBLAS on a GPU; the Triton GEMM), attention (the numba kernel, SDPA, Triton) and the rest.
The mode's outputs are checked equal to the mode off's token for token where they must be
(greedy on the same model: a difference is a near-tie, and is counted, not hidden).

    .venv/bin/python tools/bench_batch_invariant.py                # SmolLM2-135M fp32, 64 requests
    .venv/bin/python tools/bench_batch_invariant.py --rounds 3 --max-num-seqs 16
"""

from __future__ import annotations

import argparse
import cProfile
import os
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_throughput import (  # noqa: E402
    Workload,
    add_workload_args,
    make_workload,
    parse_workload_args,
)

# (what, substrings of a profiled function's file:name) the time split reports
PARTS = {
    "GEMM": ("dense_linear_compiled", "_nn.linear", "linear_triton", "_linear_kernel"),
    "attention": ("launch_attention", "scaled_dot_product", "_paged_attention_kernel"),
}


def build(args: argparse.Namespace, workload: Workload, batch_invariant: bool):
    from pagedserve.engine import LLM

    longest = max(len(p) + n for p, n in zip(workload.prompts, workload.output_lens))
    return LLM(
        model=args.model,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max(longest + 1, 512),
        kv_cache_memory=args.kv_cache_memory,
        batch_invariant=batch_invariant,
    )


def run(llm, workload: Workload, profile: cProfile.Profile | None = None):
    """(seconds, the outputs' token ids) for the whole workload on ``llm``."""
    from pagedserve.engine import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in workload.output_lens]  # fmt: skip
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    start = time.perf_counter()
    if profile:
        profile.enable()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    if profile:
        profile.disable()
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outputs]


def time_split(profile: cProfile.Profile) -> dict[str, float]:
    """Seconds of the profiled round in each of ``PARTS`` (own time of the matching
    functions), and the rest."""
    stats = pstats.Stats(profile).stats
    total = sum(entry[2] for entry in stats.values())
    split = dict.fromkeys(PARTS, 0.0)
    for (filename, _, name), entry in stats.items():
        where = f"{filename}:{name}"
        for part, needles in PARTS.items():
            if any(needle in where for needle in needles):
                split[part] += entry[2]
    split["rest"] = total - sum(split.values())
    return split


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(parser)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-memory", type=int, default=512 << 20)
    parser.add_argument("--rounds", type=int, default=2, help="runs of the workload per mode")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    return parse_workload_args(parser, argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from pagedserve.models import ModelConfig

    workload = make_workload(args, ModelConfig(model=args.model).vocab_size)
    print(
        f"workload: {args.num_requests} requests, prompts {args.min_prompt}..{args.max_prompt} "
        f"random token ids, outputs exactly {args.min_output}..{args.max_output} tokens (EOS "
        f"ignored), greedy, seed {args.seed}, {args.max_num_seqs} streams; "
        f"{workload.num_output_tokens} output tokens in all"
    )
    print(
        f"model: {args.model} ({args.dtype}); machine: {platform.processor() or platform.machine()}"
        f", {os.cpu_count()} CPUs, torch {torch.__version__}, {args.threads} threads; "
        f"load average before: {_load()}"
    )
    engines = {mode: build(args, workload, mode) for mode in (False, True)}
    seconds, outputs, profiles = {False: [], True: []}, {}, {}
    for round_ in range(args.rounds):
        for mode, llm in engines.items():
            profile = cProfile.Profile() if round_ == args.rounds - 1 else None
            elapsed, outputs[mode] = run(llm, workload, profile)
            seconds[mode].append(elapsed)
            profiles[mode] = profile
    print(f"load average after: {_load()}\n")
    report(workload, seconds, profiles)
    differ = sum(a != b for a, b in zip(outputs[False], outputs[True]))
    print(f"\nrequests whose greedy tokens differ between the modes (near-ties): {differ}")
    return 0


def report(workload: Workload, seconds: dict, profiles: dict) -> None:
    base = statistics.median(seconds[False])
    print(f"{'mode':<18}{'seconds':>10}{'tokens/s':>12}{'vs off':>9}   rounds (s)")
    for mode, runs in seconds.items():
        median = statistics.median(runs)
        rate = workload.num_output_tokens / median
        rounds = " ".join(f"{s:.1f}" for s in runs)
        name = "batch invariant" if mode else "off"
        print(f"{name:<18}{median:>10.1f}{rate:>12.1f}{base / median:>9.2f}   {rounds}")
    print(f"\n{'profiled round (s)':<18}" + "".join(f"{p:>12}" for p in (*PARTS, "rest")))
    for mode, profile in profiles.items():
        split = time_split(profile)
        name = "batch invariant" if mode else "off"
        print(f"{name:<18}" + "".join(f"{split[p]:>12.1f}" for p in (*PARTS, "rest")))


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


if __name__ == "__main__":
    sys.exit(main())
