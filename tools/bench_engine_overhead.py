"""The engine's own overhead: the fraction of a step spent outside the model forward.

At ``--num-seqs`` running decodes (64 by default), every step's time is split into its phases by
timing the engine's own methods in place (no change to the engine): scheduling, building the
flat batch, the model forward (layers + logits), sampling, the scheduler's update, and making
outputs (detokenization, stop strings). Everything but the model forward is overhead: host-side
Python that a GPU would wait on. vLLM's aim, and ours, is under 10%.

    .venv/bin/python tools/bench_engine_overhead.py                   # SmolLM2-135M fp32, 64 decodes
    .venv/bin/python tools/bench_engine_overhead.py --num-seqs 16 --steps 16
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time
from collections import defaultdict
from collections.abc import Callable

import torch


class PhaseTimer:
    """Accumulates time per phase by wrapping callables in place.

    ``clock``: ``time.perf_counter`` (wall time) by default; ``time.thread_time`` counts only
    the CPU time of the calling thread, so figures taken on a machine shared with other busy
    processes are not inflated by the time this thread waits for a core.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.enabled = False
        self.clock = clock
        self._open: set[str] = set()  # phases with a timed call under way

    def wrap(self, owner: object, attribute: str, phase: str) -> None:
        """Time every call of ``owner.attribute`` under ``phase`` (an instance attribute shadows it).

        A call made inside another timed call of the same phase (a phase may wrap both a
        method and one it calls on another path) is counted once, in the outer call."""
        inner: Callable = getattr(owner, attribute)
        open_phases = self._open

        def timed(*args, **kwargs):
            if not self.enabled or phase in open_phases:
                return inner(*args, **kwargs)
            open_phases.add(phase)
            start = self.clock()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[phase] += self.clock() - start
                open_phases.discard(phase)

        setattr(owner, attribute, timed)

    def reset(self) -> None:
        self.seconds.clear()


PHASES = [  # (path from the engine, attribute, phase)
    ("scheduler", "schedule", "schedule"),
    ("runner", "prepare_input", "prepare input"),
    ("runner.model", "forward", "model forward"),
    ("runner.model", "compute_logits", "model forward"),
    ("runner", "sample", "sample"),  # every sampled row, fork, verification, prompt logprobs
    ("scheduler", "update", "scheduler update"),
    ("output_processor", "process", "outputs + detokenize"),  # detokenized, outputs built
    ("", "step", "step"),
]


def instrument(engine, timer: PhaseTimer, phases=PHASES) -> list[str]:
    """Wrap every phase the engine has (``phases``: (path, attribute, phase) triples); returns
    the phases found, so a renamed method drops out of the table instead of failing the tool."""
    found = []
    for path, attribute, phase in phases:
        owner = engine
        for part in filter(None, path.split(".")):
            owner = getattr(owner, part)
        if hasattr(owner, attribute):
            timer.wrap(owner, attribute, phase)
            found.append(phase)
    if not any("forward" in phase for phase in found) or "step" not in found:
        raise RuntimeError("the engine has no model forward or step to time")
    return found


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--num-seqs", type=int, default=64, help="running decodes")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32, help="decode steps measured")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    if args.model is None:
        from pagedserve.models.default_model import ensure_default_model

        args.model = str(ensure_default_model())
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from pagedserve.engine import LLMEngine, SamplingParams
    from pagedserve.engine.config import EngineArgs

    engine = LLMEngine(
        EngineArgs(
            model=args.model,
            max_num_seqs=args.num_seqs,
            max_model_len=args.prompt_len + args.steps + 64,
        )
    )
    timer = PhaseTimer()
    phases = instrument(engine, timer)
    rng = random.Random(args.seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 32, ignore_eos=True)
    for i in range(args.num_seqs):
        prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
        engine.add_request(f"r{i}", prompt, params)

    prefill_steps = 0
    while engine.scheduler.waiting or any(
        r.num_output_tokens == 0 for r in engine.scheduler.running
    ):
        engine.step()  # prefill (in chunks under the token budget) until all are decoding
        prefill_steps += 1
    timer.enabled = True
    for _ in range(args.steps):
        engine.step()
    timer.enabled = False
    running = len(engine.scheduler.running)
    if running != args.num_seqs:
        raise RuntimeError(f"only {running} of {args.num_seqs} sequences were decoding")

    step = timer.seconds["step"]
    print(
        f"model: {args.model}; {args.num_seqs} running decodes, prompts of {args.prompt_len} random "
        f"tokens, {args.steps} decode steps measured after {prefill_steps} prefill steps; "
        f"{os.cpu_count()} CPUs ({platform.machine()}), {args.threads} torch threads"
    )
    print(f"\n{'phase':<24}{'ms/step':>10}{'share':>9}")
    for phase in dict.fromkeys(phases):
        if phase == "step":
            continue
        ms = 1e3 * timer.seconds[phase] / args.steps
        print(f"{phase:<24}{ms:>10.2f}{timer.seconds[phase] / step:>9.1%}")
    accounted = sum(v for k, v in timer.seconds.items() if k != "step")
    print(
        f"{'other (step glue)':<24}{1e3 * (step - accounted) / args.steps:>10.2f}{(step - accounted) / step:>9.1%}"
    )
    print(f"{'step':<24}{1e3 * step / args.steps:>10.2f}{1:>9.1%}")
    overhead = 1 - timer.seconds["model forward"] / step
    print(f"\nengine overhead (step time outside the model forward): {overhead:.1%}  (aim: < 10%)")
    print(f"decode throughput: {args.num_seqs * args.steps / step:.1f} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
