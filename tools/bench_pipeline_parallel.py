"""What the pipeline bubble costs, and what steps in flight win back: the same workload on one
process and on pipeline stages.

With one step at a time in the pipeline, while one stage computes the others wait (the
"bubble"): with P stages each rank is busy about 1/P of the time. The engine keeps up to P
steps in flight (micro-batches, each about 1/P of the running requests), so every stage has
work. This measures both. The workload is bench_throughput's, seeded and spelled out
(``--num-requests`` prompts of uniformly random length in [min_prompt, max_prompt] of random
token ids, each asking for exactly a uniformly random number of output tokens in
[min_output, max_output], EOS ignored, greedy, at most ``--max-num-seqs`` at once), run on:

- one process with ``--threads`` threads (the baseline; the ratio column is against it);
- one process with ``--threads / stages`` threads: what one stage's share of the cores does;
- ``--stages`` pipeline stages, ``--threads / stages`` threads each (one process per stage),
  with up to ``--stages`` steps in flight (the default);
- the same stages with one step at a time (``LLMEngine.max_steps_in_flight = 1``): the bubble.

"Last stage idle" is the share of the run that rank 0 (the last stage) spent waiting for the
hidden states of the stage before it (``ParallelGroups.seconds_waiting_for_previous_stage``):
the bubble as the last stage sees it.

Each configuration runs ``--rounds`` times in turn (the configurations alternate, so the
machine's other work falls on all alike); the table gives each one's median. Outputs are
checked equal to the baseline's token for token. A second table gives what each rank of the
staged engine holds (its layers, its weights' and KV cache's bytes).

    .venv/bin/python tools/bench_pipeline_parallel.py        # SmolLM2-135M fp32, 2 stages
"""

from __future__ import annotations

import argparse
import platform
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


def build(args: argparse.Namespace, workload: Workload, threads: int, stages: int):
    from pagedserve.engine import LLM

    torch.set_num_threads(threads)  # the workers started now inherit their share of it
    longest = max(len(p) + n for p, n in zip(workload.prompts, workload.output_lens))
    return LLM(
        model=args.model,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_model_len=max(longest + 1, 512),
        kv_cache_memory=args.kv_cache_memory,
        pipeline_parallel_size=stages,
        pp_layer_partition=args.pp_layer_partition if stages > 1 else None,
    )


def run(llm, workload: Workload, threads: int) -> tuple[float, list[list[int]]]:
    from pagedserve.engine import SamplingParams

    torch.set_num_threads(threads)
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.output_lens
    ]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outputs]


def _seconds_waiting(engine) -> float:
    return engine.runner.group.seconds_waiting_for_previous_stage


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(parser)
    parser.set_defaults(num_requests=32, max_prompt=128, max_output=64)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--pp-layer-partition", default=None, help="e.g. 17,13 (engine's option)")
    return parse_workload_args(parser, argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from pagedserve.models import ModelConfig

    workload = make_workload(args, ModelConfig(model=args.model).vocab_size)
    share = max(1, args.threads // args.stages)
    one_share = f"1 process, {share} thread(s)"
    staged_name = f"{args.stages} stages, {share} thread(s) each, {args.stages} steps in flight"
    configs = {  # name: (threads, stages, steps in flight)
        f"1 process, {args.threads} threads": (args.threads, 1, 1),
        one_share: (share, 1, 1),
        staged_name: (share, args.stages, args.stages),
        f"{args.stages} stages, {share} thread(s) each, 1 step in flight": (share, args.stages, 1),
    }
    engines = {}  # one distributed engine per process: both staged rows share one
    for name, (threads, stages, _) in configs.items():
        engines[name] = engines.get(staged_name) if stages > 1 else None
        engines[name] = engines[name] or build(args, workload, threads, stages)
    times: dict[str, list[float]] = {name: [] for name in configs}
    idle = dict.fromkeys(configs, 0.0)  # rank 0's seconds waiting for the previous stage
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(args.rounds):
        for name, (threads, stages, in_flight) in configs.items():
            engine = engines[name].engine
            engine.max_steps_in_flight = in_flight
            waited = _seconds_waiting(engine) if stages > 1 else 0.0
            seconds, outputs[name] = run(engines[name], workload, threads)
            times[name].append(seconds)
            idle[name] += (_seconds_waiting(engine) - waited) if stages > 1 else 0.0
    staged = engines[staged_name].engine.runner
    print("| rank | stage | layers | weights MiB | KV cache MiB |\n|---|---|---|---|---|")
    for m in staged.rank_memory:  # what each rank holds, as the executor gathered it
        layers = f"{m.layers.start}-{m.layers.stop - 1}"
        print(f"| {m.rank} | {m.stage} | {layers} | {m.weight_bytes / 2**20:.1f} | "
              f"{m.kv_cache_bytes / 2**20:.1f} |")  # fmt: skip
    print()
    baseline = next(iter(configs))
    print(
        f"# {Path(args.model).name} {args.dtype}, {args.num_requests} requests, prompts "
        f"{args.min_prompt}-{args.max_prompt}, outputs {args.min_output}-{args.max_output}, "
        f"{args.max_num_seqs} streams, seed {args.seed}, {args.rounds} rounds; "
        f"{platform.processor() or platform.machine()}"
    )
    print("| configuration | median s | output tok/s | ratio | last stage idle | outputs equal |")
    print("|---|---|---|---|---|---|")
    base = statistics.median(times[baseline])
    for name, (_, stages, _) in configs.items():
        median = statistics.median(times[name])
        equal = outputs[name] == outputs[baseline]
        rate = workload.num_output_tokens / median
        use = f"{idle[name] / sum(times[name]):.0%}" if stages > 1 else ""
        print(f"| {name} | {median:.1f} | {rate:.1f} | {base / median:.2f} | {use} | {equal} |")
    staged.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
