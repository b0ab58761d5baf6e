"""The engine's host cost per step, with the model forward replaced by a stand-in that costs nothing.

A GPU runs SmolLM2's decode forward for 256 sequences in well under a millisecond; whatever the
engine spends in Python around it is time the device waits. To see that cost alone, the model
runner here holds no weights and no KV cache: its "model" returns hidden states and logits of the
real shapes (``[rows, vocab]``, SmolLM2's vocabulary of 49152 by default) from buffers made once,
so every millisecond left is host work. The engine itself is unchanged: its scheduler, input
building, sampler, update, detokenizer and output making all run for real, each timed in place.

Measured at 64, 256 and 1024 running greedy decodes (prompts of ``--prompt-len`` random tokens,
``--steps`` decode steps after the prefills). The baseline measured in the same run is the
irreducible work of a decode step on the same machine: one argmax over the ``[B, vocab]`` logits;
the last row gives each step's time as a multiple of it, so figures from a busy machine still
compare.

    python tools/bench_host_overhead.py                      # SmolLM2-135M's config and tokenizer
    python tools/bench_host_overhead.py --num-seqs 256 --steps 32
    python tools/bench_host_overhead.py --num-seqs 256 --logits device-like --timers outer

``--logits device-like`` keeps the 50 MB of logits out of the host's caches, as a GPU's would
be (``StandInModel`` says what it models and what it does not); "host total" means the same in
both modes: the step minus the sampler call.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import platform
import random
import sys
import time
from collections.abc import Iterator

import torch
from bench_engine_overhead import PhaseTimer, instrument

PHASES = [  # (path from the engine, attribute, phase): top-level phases, then nested ones
    ("scheduler", "schedule", "schedule"),
    ("runner", "prepare_input", "build inputs"),
    ("runner.model", "forward", "forward (stand-in)"),
    ("runner.model", "compute_logits", "forward (stand-in)"),
    ("runner", "sample", "sampling"),
    ("scheduler", "update", "scheduler update"),
    ("output_processor", "process", "outputs + detokenize"),
    ("runner", "sampler", "  of which sampler"),
    ("", "step", "step"),
]
MAKE_OUTPUTS, DETOKENIZE = "  of which make outputs", "  of which detokenize + stops"
NESTED = {"  of which sampler", MAKE_OUTPUTS, DETOKENIZE, "step"}
# ``--timers outer``: only the step and the sampler call inside it, so that "host total" (step
# minus the sampler, whose argmax is device work on a GPU) carries no per-phase timer's cost
OUTER_PHASES = [("runner", "sampler", "  of which sampler"), ("", "step", "step")]
HOST_TOTAL = "host total (step - sampler)"


@contextlib.contextmanager
def timed_per_request(timer: PhaseTimer) -> Iterator[None]:
    """Time the per-request work inside "outputs + detokenize", wrapped on the classes for the
    measurement and put back: detokenizing and the stop checks (each sequence's
    ``process_new_tokens``, whose common decode calls its detokenizer's ``add_token``), and
    making outputs (``SequenceGroup.make_output``, and ``running_output``, which the output
    processor calls for a plain decode). A call nested in another of its phase
    counts once (``PhaseTimer.wrap``)."""
    from pagedserve.engine import detokenizer
    from pagedserve.engine.sequence_group import SequenceGroup, SequenceState

    targets = [
        (SequenceState, "process_new_tokens", DETOKENIZE),
        (detokenizer.ByteLevelDetokenizer, "add_token", DETOKENIZE),
        (detokenizer.FinalTextDetokenizer, "add_token", DETOKENIZE),
        (detokenizer.IncrementalDetokenizer, "add_token", DETOKENIZE),
        (SequenceGroup, "make_output", MAKE_OUTPUTS),
        (SequenceGroup, "running_output", MAKE_OUTPUTS),
    ]
    real = [(owner, attribute, owner.__dict__[attribute]) for owner, attribute, _ in targets]
    for owner, attribute, phase in targets:
        timer.wrap(owner, attribute, phase)
    try:
        yield
    finally:
        for owner, attribute, method in real:
            setattr(owner, attribute, method)


class StandInModel:
    """Hidden states and logits of the real shapes, computed by nobody.

    The logits are random rows made once, so greedy decoding picks varied tokens (the
    detokenizer sees real work) and a step's sampler reads real values.

    ``logits="host"`` (the default): the logits are ``[rows, vocab]`` distinct fp32 values, 50 MB
    at 256 rows of SmolLM2's vocabulary, which the sampler's argmax reads from host memory each
    step, so every cache of the core is swept between two steps' Python.

    ``logits="device-like"`` models what a GPU's host sees instead: tensors that live on the
    device, whose reading never passes through the host's caches. Row ``i`` of the logits is
    the window ``[i, i + vocab)`` of one buffer of ``vocab + rows`` values (an overlapping
    ``as_strided`` view, read only), so the argmax reads ~0.2 MB that stay in the core's L2
    and still picks a different token in each row (the buffer's maximum sits at a different
    offset of each window). The hidden states are one column wide, so the runner's gather of
    the rows to score (``hidden[logits_indices]``, a kernel on a GPU) moves 1 KB instead of
    0.6 MB of host memory. What it does not model: the argmax still runs on this CPU (its time
    is the sampler's, which "host total" excludes as before, but its code and its 0.2 MB still
    pass through the core's caches); the host work a GPU adds (kernel launches, the transfer of
    the sampled tokens and its wait) is not here; and the small ops on the stand-in's tensors
    cost what a CPU op costs, not what a launch costs.
    """

    def __init__(
        self, hidden_size: int, vocab_size: int, max_rows: int, seed: int, logits: str = "host"
    ) -> None:
        generator = torch.Generator().manual_seed(seed)
        if logits == "device-like":
            window = torch.randn(vocab_size + max_rows, generator=generator)
            self.logits = window.as_strided((max_rows, vocab_size), (1, 1))
            hidden_size = 1
        else:
            self.logits = torch.randn(max_rows, vocab_size, generator=generator)
        # contiguous, as a real model's: indexing a stride-0 expand() is a slower gather
        self.hidden = torch.zeros(max(max_rows, 4096), hidden_size)

    def __call__(self, input_ids, positions, kv_caches, meta):
        return self.forward(input_ids, positions, kv_caches, meta)

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        return self.hidden[: input_ids.shape[0]]  # a step has at most 2048 tokens

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.shape[0]
        if rows <= self.logits.shape[0]:
            return self.logits[:rows]
        return torch.zeros(rows, self.logits.shape[1])


def stand_in_runner_class(max_rows: int, seed: int, pad_decode: bool, logits: str = "host"):
    """A ModelRunner that loads no weights and allocates no KV cache; everything else is real.

    ``pad_decode``: decode steps go through the CUDA-graph path's padded buffers (run eagerly
    here), to measure what building a step's inputs costs there. ``logits``: StandInModel's.
    """
    from pagedserve.engine.cuda_graph import CUDAGraphConfig
    from pagedserve.engine.model_runner import ModelRunner

    class StandInRunner(ModelRunner):
        def __init__(
            self, model_config, cache_config, par=None, graph_config=None, **kwargs
        ) -> None:
            if pad_decode:
                graph_config = dataclasses.replace(
                    graph_config or CUDAGraphConfig(), pad_decode_on_cpu=True
                )
            super().__init__(model_config, cache_config, par, graph_config, **kwargs)

        def _load_model(self) -> StandInModel:
            mc = self.model_config
            return StandInModel(mc.hidden_size, mc.vocab_size, max_rows, seed, logits)

        def _allocate_kv_caches(self, num_blocks: int) -> list:
            empty = torch.empty(0)
            return [(empty, empty)] * self.model_config.num_layers

    return StandInRunner


@contextlib.contextmanager
def stand_in_forward(
    max_rows: int, seed: int, pad_decode: bool = False, logits: str = "host"
) -> Iterator[None]:
    """While open, every LLMEngine built gets the stand-in runner (on any device: the CPU's
    runner class too, whose fused layers need a real model)."""
    import pagedserve.engine.executor as executor  # where LLMEngine's runner is built

    real = executor.ModelRunner, executor.CPUModelRunner
    stand_in = stand_in_runner_class(max_rows, seed, pad_decode, logits)
    executor.ModelRunner = executor.CPUModelRunner = stand_in
    try:
        yield
    finally:
        executor.ModelRunner, executor.CPUModelRunner = real


def measure(
    model: str,
    num_seqs: int,
    steps: int,
    prompt_len: int,
    seed: int = 0,
    pad_decode: bool = False,
    clock=time.thread_time,
    outer: bool = False,
    output_kind: str = "cumulative",
    logits: str = "host",
) -> dict:
    """ms per decode step in each phase at ``num_seqs`` running greedy decodes (``outer``:
    the step and its sampler call only)."""
    from pagedserve.engine import LLMEngine, SamplingParams
    from pagedserve.engine.config import EngineArgs

    # The first admitted sequences decode while the last prompts are still prefilled, in what
    # the running decodes leave of the 2048-token budget: allow them three times the steps that
    # the prompts alone would take.
    max_tokens = steps + 3 * -(-num_seqs * prompt_len // 2048) + 8
    max_len = prompt_len + max_tokens + 1
    blocks_per_seq = -(-max_len // 16)
    args = EngineArgs(
        model=model,
        device="cpu",
        max_num_seqs=num_seqs,
        max_model_len=max_len,
        block_size=16,
        num_gpu_blocks_override=num_seqs * blocks_per_seq + 16,
        max_num_batched_tokens=2048,
        seed=seed,
    )
    with stand_in_forward(num_seqs, seed, pad_decode, logits):
        engine = LLMEngine(args)
    timer = PhaseTimer(clock)
    if outer:
        for path, attribute, phase in OUTER_PHASES:
            timer.wrap(getattr(engine, path) if path else engine, attribute, phase)
        phases = [phase for *_, phase in OUTER_PHASES]
    else:
        phases = instrument(engine, timer, PHASES)
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind=output_kind
    )
    for i in range(num_seqs):
        engine.add_request(f"r{i}", [rng.randrange(vocab) for _ in range(prompt_len)], params)
    while engine.scheduler.waiting or any(
        r.num_output_tokens == 0 for r in engine.scheduler.running
    ):
        engine.step()  # the prefills, until every sequence decodes
    with contextlib.nullcontext() if outer else timed_per_request(timer):
        timer.enabled = True
        for _ in range(steps):
            engine.step()
        timer.enabled = False
    if not outer:
        phases += [MAKE_OUTPUTS, DETOKENIZE]
    if len(engine.scheduler.running) != num_seqs:
        raise RuntimeError(f"only {len(engine.scheduler.running)} of {num_seqs} were decoding")
    ms = {phase: 1e3 * timer.seconds[phase] / steps for phase in dict.fromkeys(phases)}
    if not outer:
        top = sum(v for k, v in ms.items() if k not in NESTED)
        ms["other (step glue)"] = ms["step"] - top
    ms[HOST_TOTAL] = ms["step"] - ms["  of which sampler"]
    ms["floor: argmax of the logits"] = argmax_floor_ms(num_seqs, vocab, seed, clock=clock)
    return ms


def argmax_floor_ms(
    rows: int, vocab: int, seed: int, repeats: int = 20, clock=time.thread_time
) -> float:
    """The baseline: one argmax over ``[rows, vocab]`` fp32 logits (best of ``repeats``; the
    same host-memory logits in either ``--logits`` mode, so the ratio's base is one figure)."""
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        logits.argmax(dim=-1)
        best = min(best, clock() - start)
    return 1e3 * best


def print_table(results: dict[int, dict]) -> None:
    sizes = list(results)
    floor = "floor: argmax of the logits"
    order = [
        k
        for k in dict.fromkeys(k for r in results.values() for k in r)
        if k not in ("step", HOST_TOTAL, floor)
    ]
    order += ["step", HOST_TOTAL, floor]  # after the phases (and the glue) that add up to them
    print(f"\n{'ms per step':<30}" + "".join(f"{n:>10} seqs" for n in sizes))
    for phase in order:
        print(f"{phase:<30}" + "".join(f"{results[n].get(phase, 0.0):>15.3f}" for n in sizes))
    print(
        f"{'step / floor':<30}"
        + "".join(f"{results[n]['step'] / results[n][floor]:>14.1f}x" for n in sizes)
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--num-seqs", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=16, help="decode steps measured")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--wall-time",
        action="store_true",
        help="time phases in wall time (default: this thread's CPU time, for a shared machine)",
    )
    parser.add_argument(
        "--timers",
        choices=("phases", "outer"),
        default="phases",
        help="phases: every phase timed in place (the timers cost ~0.8 ms a step at 256 seqs); "
        "outer: only the step and its sampler call, for the host total without that cost",
    )
    parser.add_argument(
        "--pad-decode",
        action="store_true",
        help="build decode inputs in the CUDA-graph path's padded buffers (eager here)",
    )
    parser.add_argument(
        "--output-kind",
        choices=["cumulative", "delta", "final_only"],
        default="cumulative",
        help="the requests' RequestOutputKind (a server streams DELTA; LLM.generate: FINAL_ONLY)",
    )
    parser.add_argument(
        "--logits",
        choices=["host", "device-like"],
        default="host",
        help="host: 50 MB of distinct logits read from host memory each step (sweeps the "
        "caches); device-like: logits and hidden states whose reading stays in the core's L2, "
        "as a GPU's would not touch host memory (StandInModel says what it does not model)",
    )
    args = parser.parse_args(argv)
    if args.model is None:
        from pagedserve.models.default_model import ensure_default_model

        args.model = str(ensure_default_model())
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.wall_time else time.thread_time
    results = {
        n: measure(
            args.model,
            n,
            args.steps,
            args.prompt_len,
            args.seed,
            args.pad_decode,
            clock,
            outer=args.timers == "outer",
            output_kind=args.output_kind,
            logits=args.logits,
        )
        for n in args.num_seqs
    }
    print(
        f"model config + tokenizer: {args.model} (forward: a stand-in that returns logits of the "
        f"real shape at no cost); greedy decodes, prompts of {args.prompt_len} random tokens, "
        f"{args.steps} decode steps measured, seed {args.seed}, {args.output_kind} outputs, "
        f"{args.logits} logits, "
        f"padded decode inputs "
        f"{'on' if args.pad_decode else 'off'}; {os.cpu_count()} CPUs "
        f"({platform.machine()}), {args.threads} torch thread(s), "
        f"{'wall' if args.wall_time else 'thread CPU'} time, {args.timers} timers"
    )
    print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
