"""KV cache memory: the paged cache against two contiguous caches, same budget, same workload.

Three ways to give sequences KV memory, each run through the real ``Scheduler`` and
``KVCacheManager`` (no model: the "model" is a stand-in that emits each request's planned
output and then EOS, so only memory decides who runs):

- paged: blocks of ``--block-size`` tokens, taken as the sequence grows (pagedserve, vLLM),
  with the default admission watermark; when the cache runs dry the scheduler preempts;
- contiguous, max_model_len: every sequence reserves ``max_model_len`` slots on admission
  (the layout of a static KV cache: one row of ``max_model_len`` per sequence);
- contiguous, prompt + max_tokens: every sequence reserves exactly what it may ever need,
  the best a cache can do without paging (it cannot know where EOS will fall).

The contiguous caches are exact (block size 1, so no rounding); they reserve on admission and
never grow. Measured after every step:

- waste at peak: at the step where the cache holds the most memory, the share of it that holds
  no token (``held - stored``) / ``held``;
- concurrency: how many sequences run at once (peak and mean over the steps), i.e. how many
  sequences each layout fits in the same budget; and the steps to finish the workload.

Workload (seeded): ``--num-requests`` requests, prompt lengths uniform in [min_prompt,
max_prompt]; each asks for ``--max-tokens`` and stops (EOS) after a uniform number of tokens in
[min_output, max_tokens]. Memory in bytes uses ``--model``'s KV geometry (SmolLM2-135M: 30
layers, 3 KV heads of 64, fp32 = 46,080 bytes per token).

    .venv/bin/python tools/bench_memory.py
    .venv/bin/python tools/bench_memory.py --kv-cache-memory 512MiB --plot docs/img/kv_memory.png
"""

from __future__ import annotations

import argparse
import platform
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedserve.blockmgr import CacheConfig, KVCacheManager
from pagedserve.scheduler import Request, Scheduler, SchedulerConfig

EOS = 0
SMOLLM2_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4


class ReservingKVCacheManager(KVCacheManager):
    """A contiguous KV cache: a sequence gets all its slots at admission, in one piece.

    Block size 1 makes it exact; ``reservation(seq_id)`` says how many slots a sequence
    reserves. After admission it never allocates again (its reservation covers every token).
    """

    def __init__(self, num_slots: int, reservation: dict[str, int]) -> None:
        super().__init__(num_slots, 1, enable_prefix_caching=False, watermark=0)
        self.reservation = reservation

    def allocate_slots(
        self,
        seq_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        computed_blocks=(),
        cache_salt: str | None = None,
        lora_int_id: int = 0,
        delay_caching: bool = False,
        images=(),
    ) -> bool:
        if seq_id not in self.block_tables:
            num_new_tokens = self.reservation[seq_id] - num_computed_tokens
        return super().allocate_slots(
            seq_id,
            token_ids,
            num_computed_tokens,
            num_new_tokens,
            computed_blocks,
            cache_salt,
            lora_int_id,
            delay_caching,
        )


@dataclass
class Planned:
    prompt: list[int]
    max_tokens: int
    output_len: int


@dataclass
class Trace:
    held: list[int] = field(default_factory=list)  # slots held after each step
    stored: list[int] = field(default_factory=list)  # slots holding a token's K/V
    running: list[int] = field(default_factory=list)
    preemptions: int = 0

    def peak_waste(self) -> tuple[int, int]:
        """(held, stored) at the step where the cache held the most slots."""
        step = max(range(len(self.held)), key=lambda i: (self.held[i], -self.stored[i]))
        return self.held[step], self.stored[step]


def make_workload(args: argparse.Namespace) -> list[Planned]:
    rng = random.Random(args.seed)
    workload = []
    for _ in range(args.num_requests):
        prompt = [
            rng.randrange(1, 30000) for _ in range(rng.randint(args.min_prompt, args.max_prompt))
        ]
        workload.append(
            Planned(prompt, args.max_tokens, rng.randint(args.min_output, args.max_tokens))
        )
    return workload


def simulate(kv: KVCacheManager, workload: list[Planned], args: argparse.Namespace) -> Trace:
    """Serve the workload to the end; the stand-in model emits the planned tokens, then EOS."""
    config = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        max_num_waiting=len(workload),
    )
    scheduler = Scheduler(config, kv)
    plan = {}
    for i, item in enumerate(workload):
        request_id = f"r{i}"
        plan[request_id] = item.output_len
        scheduler.add_request(
            Request(
                request_id, item.prompt, max_tokens=item.max_tokens, stop_token_ids=frozenset({EOS})
            )
        )
    trace = Trace()
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        sampled = {}
        for item in out.scheduled:
            request = item.request
            if item.needs_sample:
                done = request.num_output_tokens + 1 >= plan[request.request_id]
                sampled[request.request_id] = [EOS if done else 1]
        scheduler.update(out, sampled)
        trace.held.append((kv.num_blocks - kv.num_free_blocks) * kv.block_size)
        trace.stored.append(sum(r.num_computed_tokens for r in scheduler.running))
        trace.running.append(len(scheduler.running))
    trace.preemptions = scheduler.stats.num_preemptions
    return trace


def parse_bytes(text: str) -> int:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?", text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 1GiB, 512MiB, 1000000)")
    units = {None: 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9}
    units |= {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    return int(float(match.group(1)) * units[match.group(2)])


def run(args: argparse.Namespace) -> dict[str, Trace]:
    workload = make_workload(args)
    num_slots = args.kv_cache_memory // args.bytes_per_token
    num_blocks = num_slots // args.block_size
    traces = {
        "paged": simulate(
            KVCacheManager(num_blocks, args.block_size, False, CacheConfig().watermark),
            workload,
            args,
        )
    }
    for name, reserve in [
        ("contiguous, max_model_len", lambda p: args.max_model_len),
        ("contiguous, prompt + max_tokens", lambda p: len(p.prompt) + p.max_tokens),
    ]:
        reservation = {f"r{i}": reserve(p) for i, p in enumerate(workload)}
        traces[name] = simulate(ReservingKVCacheManager(num_slots, reservation), workload, args)
    return traces


def report(args: argparse.Namespace, traces: dict[str, Trace]) -> None:
    num_slots = args.kv_cache_memory // args.bytes_per_token
    print(
        f"workload: {args.num_requests} requests, prompt {args.min_prompt}-{args.max_prompt} tokens, "
        f"output {args.min_output}-{args.max_tokens} (max_tokens {args.max_tokens}), seed {args.seed}; "
        f"max_model_len {args.max_model_len}, max_num_seqs {args.max_num_seqs}, "
        f"budget {args.max_num_batched_tokens} tokens/step"
    )
    print(
        f"KV budget: {args.kv_cache_memory / 2**20:.0f} MiB = {num_slots} token slots "
        f"({args.bytes_per_token} B/token); paged block size {args.block_size}; "
        f"{platform.python_implementation()} {platform.python_version()}"
    )
    header = f"{'layout':34}{'waste at peak':>15}{'peak seqs':>11}{'mean seqs':>11}{'steps':>8}{'preempt':>9}"
    print(header)
    print("-" * len(header))
    paged_mean = sum(traces["paged"].running) / len(traces["paged"].running)
    for name, trace in traces.items():
        held, stored = trace.peak_waste()
        mean = sum(trace.running) / len(trace.running)
        print(
            f"{name:34}{(held - stored) / held:>14.2%} {max(trace.running):>10}{mean:>11.1f}"
            f"{len(trace.held):>8}{trace.preemptions:>9}"
        )
    for name, trace in list(traces.items())[1:]:
        mean = sum(trace.running) / len(trace.running)
        print(f"paged runs {paged_mean / mean:.2f}x the mean concurrency of {name}")


def plot(traces: dict[str, Trace], path: str, bytes_per_token: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, trace in traces.items():
        mib = [h * bytes_per_token / 2**20 for h in trace.held]
        used = [s * bytes_per_token / 2**20 for s in trace.stored]
        (line,) = axes[0].plot(mib, label=f"{name}: held")
        axes[0].plot(used, color=line.get_color(), linestyle=":", label=f"{name}: holding tokens")
        axes[1].plot(trace.running, color=line.get_color(), label=name)
    axes[0].set(xlabel="step", ylabel="KV memory (MiB)", title="KV memory held vs holding tokens")
    axes[1].set(xlabel="step", ylabel="sequences running", title="Concurrency, same budget")
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main(argv: list[str] | None = None) -> dict[str, Trace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=300)
    parser.add_argument("--min-prompt", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=512)
    parser.add_argument("--min-output", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory", type=parse_bytes, default=parse_bytes("1GiB"))
    parser.add_argument("--bytes-per-token", type=int, default=SMOLLM2_BYTES_PER_TOKEN)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", help="write a PNG of memory and concurrency over the steps")
    args = parser.parse_args(argv)
    traces = run(args)
    report(args, traces)
    if args.plot:
        plot(traces, args.plot, args.bytes_per_token)
    return traces


if __name__ == "__main__":
    main()
