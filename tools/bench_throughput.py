"""Offline throughput: pagedserve against transformers' static batching, same model, same workload.

The workload is seeded and spelled out: ``--num-requests`` prompts of uniformly random length in
[min_prompt, max_prompt] made of random token ids, each asking for exactly a uniformly random
number of output tokens in [min_output, max_output] (EOS ignored, so every run generates the same
number of tokens). Throughput is *useful* generated tokens per second: the tokens the requests
asked for, over the wall time of the whole workload.

- pagedserve: ``LLM.generate`` over every request at once (continuous batching).
- transformers: ``model.generate`` in static batches of ``--hf-batch-sizes`` requests, in
  arrival order, left-padded. A static batch runs until its longest request is done, so its
  short requests' slots idle: that waste is what continuous batching removes, and it is counted
  against transformers exactly as it costs in practice.

    .venv/bin/python tools/bench_throughput.py                 # SmolLM2-135M fp32, 64 requests
    .venv/bin/python tools/bench_throughput.py --num-requests 16 --hf-batch-sizes 8 --profile /tmp/p.prof

``--profile`` runs pagedserve under cProfile and prints where its time goes.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import platform
import pstats
import random
import sys
import time
from dataclasses import dataclass

import torch


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    rng = random.Random(args.seed)
    prompts, output_lens = [], []
    for _ in range(args.num_requests):
        length = rng.randint(args.min_prompt, args.max_prompt)
        prompts.append([rng.randrange(vocab_size) for _ in range(length)])
        output_lens.append(rng.randint(args.min_output, args.max_output))
    return Workload(prompts, output_lens)


def model_token_passes(workload: Workload, batch_size: int | None) -> int:
    """Token positions pushed through the model: the compute each engine must do.

    pagedserve computes every prompt token once and every output token but the last once (no
    padding; no preemption at this cache size). A static batch computes ``batch x (longest prompt
    + longest output)``: padding and the idle slots of requests that finished early included.
    On a compute-bound CPU the throughput ratio cannot exceed the ratio of these counts.
    """
    if batch_size is None:
        return (
            sum(len(p) for p in workload.prompts)
            + workload.num_output_tokens
            - len(workload.prompts)
        )
    passes = 0
    for first in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[first : first + batch_size]
        outputs = workload.output_lens[first : first + batch_size]
        passes += len(prompts) * (max(len(p) for p in prompts) + max(outputs) - 1)
    return passes


def run_pagedserve(args: argparse.Namespace, workload: Workload) -> float:
    """Seconds to generate the whole workload with pagedserve (engine construction excluded)."""
    from pagedserve.engine import LLM, SamplingParams

    longest = max(len(p) + n for p, n in zip(workload.prompts, workload.output_lens))
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max(longest + 1, 512),
    )
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.output_lens
    ]
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    llm.generate(prompts[:2], [SamplingParams(max_tokens=4, ignore_eos=True)] * 2, use_tqdm=False)
    profiler = cProfile.Profile() if args.profile else None
    start = time.perf_counter()
    if profiler:
        profiler.enable()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    if profiler:
        profiler.disable()
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    if produced != workload.num_output_tokens:
        raise RuntimeError(
            f"pagedserve produced {produced} tokens, expected {workload.num_output_tokens}"
        )
    if profiler:
        profiler.dump_stats(args.profile)
        print_profile(args.profile)
    return elapsed


def run_transformers(args: argparse.Namespace, workload: Workload, batch_size: int) -> float:
    """Seconds for transformers' generate in static, left-padded batches of ``batch_size``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=_torch_dtype(args.dtype))
    model.eval()
    config = model.generation_config
    config.eos_token_id = None  # ignore EOS: every request generates exactly what it asked for
    pad_id = 0
    config.pad_token_id = pad_id
    _hf_generate(model, [workload.prompts[0]], 4, pad_id)  # warm-up
    start = time.perf_counter()
    for first in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[first : first + batch_size]
        longest_output = max(workload.output_lens[first : first + batch_size])
        out = _hf_generate(model, prompts, longest_output, pad_id)
        if out.shape[1] != longest_output:
            raise RuntimeError(
                f"transformers generated {out.shape[1]} tokens, not {longest_output}"
            )
    return time.perf_counter() - start


def _hf_generate(model, prompts: list[list[int]], max_new_tokens: int, pad_id: int) -> torch.Tensor:
    """Generated token ids ``[batch, max_new_tokens]`` of one left-padded static batch."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return out[:, width:]


def _torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def print_profile(path: str, limit: int = 25) -> None:
    print(f"\n--- pagedserve profile (cProfile, cumulative; {path}) ---")
    pstats.Stats(path).sort_stats("cumulative").print_stats(limit)


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The model and the seeded workload's options (``make_workload`` reads them); the tools
    that run this workload share them."""
    parser.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--min-prompt", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--min-output", type=int, default=16)
    parser.add_argument("--max-output", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)


def parse_workload_args(parser: argparse.ArgumentParser, argv: list[str] | None):
    """``parser``'s arguments, the workload's lengths checked and the model resolved (the
    default one fetched when none is named)."""
    args = parser.parse_args(argv)
    if not 1 <= args.min_prompt <= args.max_prompt or not 1 <= args.min_output <= args.max_output:
        parser.error("need 1 <= min <= max for prompt and output lengths")
    if args.model is None:
        from pagedserve.models.default_model import ensure_default_model

        args.model = str(ensure_default_model())
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(parser)
    parser.add_argument("--hf-batch-sizes", type=int, nargs="*", default=[8, 16])
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--profile", default=None, help="write a cProfile of pagedserve's run here")
    parser.add_argument("--plot", default=None, help="write a PNG bar chart of tokens/s here")
    return parse_workload_args(parser, argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from pagedserve.models import ModelConfig

    vocab = ModelConfig(model=args.model).vocab_size
    workload = make_workload(args, vocab)
    print(
        f"workload: {args.num_requests} requests, prompts {args.min_prompt}..{args.max_prompt} random "
        f"token ids, outputs exactly {args.min_output}..{args.max_output} tokens (EOS ignored), "
        f"seed {args.seed}; {workload.num_output_tokens} output tokens in all"
    )
    print(
        f"model: {args.model} ({args.dtype}); machine: {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}, {args.threads} threads"
    )
    print(f"load average before: {_load()}")
    results = [("pagedserve", None, run_pagedserve(args, workload))]
    for batch_size in args.hf_batch_sizes:
        name = f"transformers static batch {batch_size}"
        results.append((name, batch_size, run_transformers(args, workload, batch_size)))
    print(f"load average after: {_load()}")
    header = (
        f"{'engine':<34}{'seconds':>10}{'tokens/s':>12}{'pagedserve x':>14}{'token passes':>14}"
    )
    print("\n" + header)
    ours = workload.num_output_tokens / results[0][2]
    for name, batch_size, seconds in results:
        rate = workload.num_output_tokens / seconds
        passes = model_token_passes(workload, batch_size)
        print(f"{name:<34}{seconds:>10.1f}{rate:>12.1f}{ours / rate:>14.2f}{passes:>14d}")
    if args.plot:
        rows = [(name, workload.num_output_tokens / seconds) for name, _, seconds in results]
        plot_results(rows, args.plot, f"{args.num_requests} requests, {args.dtype}, CPU")
    return 0


def plot_results(rows: list[tuple[str, float]], path: str, title: str) -> None:
    """A bar chart of generated tokens/s per engine (rows: (name, tokens/s))."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    names, rates = [n for n, _ in rows], [r for _, r in rows]
    bars = ax.barh(names[::-1], rates[::-1], color=["#888"] * (len(rows) - 1) + ["#3f51b5"])
    ax.bar_label(bars, fmt="%.1f")
    ax.set(xlabel="generated tokens/s (useful tokens only)", title=title)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


if __name__ == "__main__":
    sys.exit(main())
