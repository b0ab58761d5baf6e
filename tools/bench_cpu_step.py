"""Milliseconds per decode step of the CPU engine at small batches, variants interleaved.

Runs the engine offline (``LLMEngine``, the default SmolLM2-135M fp32 unless ``--model``) with
``B`` greedy decodes for each batch size, prefills them, then times decode steps in rounds:
each round runs ``--steps-per-round`` steps under every variant in turn, so that a machine
whose load drifts (other processes, the hypervisor's steal) weighs on all variants alike.
Variants are switches flipped in this process:

- ``numba``: the engine as shipped on CPU (the CPU runner runs each decoder layer of a small
  step as one numba call: engine/cpu_runner.py, kernels/cpu/decoder_layer.py, with the step's
  attention planned once);
- ``unfused``: the same kernels called module by module, each layer's attention planning for
  itself (what the runner's fused layers save);
- ``ref-ops``: the decoder layer's small ops (RMSNorm, rotary, store_kv, SiLU) on their PyTorch
  references, attention still numba: what cpu/layer_ops.py saves;
- ``mkl-linear``: the linear layers and the lm_head on MKL (``F.linear``) at every batch size,
  as before the numba decode GEMM (cpu/dense_linear.py): what that kernel saves.

Switches combine with ``+`` (``ref-ops+mkl-linear``); every switch but ``numba`` implies
``unfused`` (the others change what the modules call).

Then one batch-1 step's time per op (the kernels' entry points and the linear layers wrapped
in timers: numba's own functions are invisible to torch.profiler), and the load (``/proc/loadavg``) and steal (``/proc/stat``) over the run.

    .venv/bin/python tools/bench_cpu_step.py                        # batches 1 4 16, 2 threads
    .venv/bin/python tools/bench_cpu_step.py --batch-sizes 1 --threads 1 --rounds 10
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Iterator

import torch


def cpu_times() -> tuple[int, int]:
    """(steal, total) jiffies of all CPUs since boot."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return fields[7], sum(fields)


SWITCHES = ("numba", "unfused", "ref-ops", "mkl-linear")


@contextlib.contextmanager
def variant(engine, name: str) -> Iterator[None]:
    """Flip the switches of one variant (names joined by ``+``) for the steps run inside."""
    from pagedserve.kernels.cpu import dense_linear, layer_ops

    switches = set(name.split("+"))
    if not switches <= set(SWITCHES):
        raise ValueError(f"unknown variant {name!r} (switches {', '.join(SWITCHES)}, joined by +)")
    runner = engine.runner
    supports, dense_supports, fused = layer_ops.supports, dense_linear.supports, runner.fused_layers
    if switches - {"numba"}:
        runner.fused_layers = None
    if "mkl-linear" in switches:
        dense_linear.supports = lambda *tensors: False
    if "ref-ops" in switches:
        layer_ops.supports = lambda *tensors: False
    try:
        yield
    finally:
        layer_ops.supports, dense_linear.supports, runner.fused_layers = (
            supports,
            dense_supports,
            fused,
        )


def start_decodes(engine, batch: int, prompt_len: int, max_tokens: int, seed: int) -> None:
    """``batch`` requests of random token ids, stepped until every one is decoding."""
    from pagedserve.engine import SamplingParams

    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(
            f"b{batch}-{i}", [rng.randrange(vocab) for _ in range(prompt_len)], params
        )
    while engine.scheduler.waiting or any(
        r.num_output_tokens == 0 for r in engine.scheduler.running
    ):
        engine.step()


def time_variants(
    engine, variants: list[str], rounds: int, steps: int, clock
) -> dict[str, list[float]]:
    """Seconds per step, per variant, the variants taking turns every ``steps`` steps."""
    seconds = defaultdict(list)
    for _ in range(rounds):
        for name in variants:
            with variant(engine, name):
                for _ in range(steps):
                    start = clock()
                    engine.step()
                    seconds[name].append(clock() - start)
    return seconds


OPS = [  # (module, attribute, op) timed in the per-op breakdown
    ("pagedserve.kernels.cpu.decoder_layer", "decoder_layer_numba", "decoder layers, fused"),
    ("pagedserve.models.layers.norm", "rms_norm", "rms_norm (+ residual)"),
    ("pagedserve.models.layers.rotary", "rotary_embedding", "rotary"),
    ("pagedserve.models.layers.attention", "store_kv", "store_kv"),
    ("pagedserve.models.layers.attention", "paged_attention", "paged attention"),
    ("pagedserve.models.llama", "silu_and_mul", "silu_and_mul"),
    ("pagedserve.models.layers.linear_method", "UnquantizedLinearMethod.apply", "linear layers"),
    ("pagedserve.models.layers.embedding", "ParallelLMHead.compute_logits", "lm_head"),
]


def op_breakdown(engine, steps: int, clock) -> tuple[dict[str, float], float]:
    """ms per step in each op of ``OPS``, and the whole step's, over ``steps`` steps."""
    import importlib

    totals: dict[str, float] = defaultdict(float)

    def timer(fn, op):
        def timed(*args, **kwargs):
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[op] += clock() - start

        return timed

    saved = []
    for module_name, path, op in OPS:  # a module's function, or a class's method
        owner = importlib.import_module(module_name)
        *outer, attribute = path.split(".")
        for name in outer:
            owner = getattr(owner, name)
        saved.append((owner, attribute, getattr(owner, attribute)))
        setattr(owner, attribute, timer(getattr(owner, attribute), op))
    try:
        start = clock()
        for _ in range(steps):
            engine.step()
        step = clock() - start
    finally:
        for owner, attribute, original in saved:
            setattr(owner, attribute, original)
    return {op: 1e3 * s / steps for op, s in totals.items()}, 1e3 * step / steps


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--variants", nargs="+", default=["numba", "ref-ops"])
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps-per-round", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--clock",
        choices=["wall", "thread"],
        default="wall",
        help="thread: CPU time of the engine's thread, not inflated by waiting for a busy core "
        "(on a shared machine; exact with --threads 1, misses worker threads' time otherwise)",
    )
    parser.add_argument("--breakdown-steps", type=int, default=8, help="0: no per-op table")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    from pagedserve.engine import LLMEngine
    from pagedserve.engine.config import EngineArgs

    if args.model is None:
        from pagedserve.models.default_model import ensure_default_model

        args.model = str(ensure_default_model())
    decode_steps = args.rounds * args.steps_per_round * len(args.variants) + args.breakdown_steps
    engine = LLMEngine(
        EngineArgs(
            model=args.model,
            max_num_seqs=max(args.batch_sizes),
            max_model_len=args.prompt_len + decode_steps + 16,
            num_cpu_threads=args.threads,
        )
    )
    load0, (steal0, total0) = os.getloadavg()[0], cpu_times()
    print(
        f"{args.model}: {args.threads} torch threads, NUMBA_NUM_THREADS="
        f"{os.environ.get('NUMBA_NUM_THREADS', 'unset')}, prompts of {args.prompt_len} tokens, "
        f"{args.rounds} rounds x {args.steps_per_round} steps per variant, {args.clock} clock"
    )
    print(f"\n{'batch':>5} " + "".join(f"{v + ' ms/step':>22}" for v in args.variants))
    breakdown = None
    for batch in args.batch_sizes:
        start_decodes(engine, batch, args.prompt_len, decode_steps + 8, seed=batch)
        seconds = time_variants(engine, args.variants, args.rounds, args.steps_per_round, clock)
        cells = []
        for name in args.variants:
            median, best = statistics.median(seconds[name]), min(seconds[name])
            cells.append(f"{1e3 * median:>9.1f} (min {1e3 * best:5.1f})")
        print(f"{batch:>5} " + "".join(f"{c:>22}" for c in cells), flush=True)
        if batch == 1 and args.breakdown_steps:
            breakdown = op_breakdown(engine, args.breakdown_steps, clock)
        engine.abort_request(engine.unfinished_request_ids())
        while engine.has_unfinished_requests():
            engine.step()
    steal1, total1 = cpu_times()
    print(
        f"\nload average {load0:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; "
        f"steal {100 * (steal1 - steal0) / max(total1 - total0, 1):.1f} %"
    )
    if breakdown:
        per_op, step = breakdown
        print(f"\nbatch 1, {args.variants[0]}: ms per step by op (medians above are per step)")
        for op, ms in sorted(per_op.items(), key=lambda kv: -kv[1]):
            print(f"  {op:<28}{ms:>8.2f}{ms / step:>8.1%}")
        rest = step - sum(per_op.values())
        print(
            f"  {'everything else':<28}{rest:>8.2f}{rest / step:>8.1%}\n  {'step':<28}{step:>8.2f}"
        )
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(main())
