"""GGUF served in its blocks on a CPU: weight bytes, one projection's cost, end-to-end decode.

Four ways a CPU can multiply by a GGUF projection, timed on the default model's shapes
(SmolLM2-135M: fused gate_up 3072 x 576 and down 576 x 1536, Q4_1 as shipped), for a decode
step's few rows and a prefill chunk's many:

- blocks, numba: ``gguf_linear`` as the engine runs it on a CPU (cpu/gguf_linear.py: decoded
  weight rows for up to 16 rows, decoded tiles and MKL above); memory: the blocks only;
- blocks, decoded per call: ``gguf_linear_ref`` (the reference, which the engine ran before:
  the layer's blocks decoded to a fresh fp32 matrix, one GEMM);
- the same into a reusable fp32 buffer (one per shape, filled in place by ``copy_``);
- fp32, decoded once at load (``F.linear`` on the dequantized matrix): what the converted
  folder runs; memory: 4 bytes a weight.

Then the whole model: weight bytes of ``LLM(model=<the .gguf>)`` against the converted fp32
folder, and greedy decoding (``--num-prompts`` prompts of ``--prompt-len`` tokens, ``--max-tokens``
each, seed 0) through each, ``--repeats`` rounds taking turns: tokens/s, and the time of a
decode step (the run less a one-token run, per further token: TPOT at one prompt). One table
each; the machine is printed with them.

    python tools/bench_gguf.py                 # all three parts
    python tools/bench_gguf.py --skip-e2e      # the projection table only
    python tools/bench_gguf.py --num-prompts 1 --prompt-len 16 --max-tokens 65   # TPOT
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch
import torch.nn.functional as F

from pagedserve.kernels.gguf_dequant import GGUF_TYPE_IDS, gguf_dequantize_ref
from pagedserve.kernels.gguf_linear import gguf_linear, gguf_linear_ref
from pagedserve.kernels.testing import random_gguf_rows

SHAPES = {"gate_up": (3072, 576), "down": (576, 1536)}


def best_of(fn, repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def projection_table(qtype_name: str, rows: list[int], repeats: int) -> list[str]:
    qtype = GGUF_TYPE_IDS[qtype_name]
    lines = [
        f"one projection, {qtype_name}, fp32 activations, best of {repeats} (ms):",
        f"{'layer':<8} {'rows':>5} {'numba':>9} {'per call':>9} {'buffer':>9} {'fp32':>9} "
        f"{'numba / fp32':>13} {'per call / fp32':>16}",
    ]
    for name, (n, k) in SHAPES.items():
        blocks = random_gguf_rows(qtype, n, k)
        dense = gguf_dequantize_ref(blocks, qtype)
        buffer = torch.empty_like(dense)
        for m in rows:
            x = torch.randn(m, k)
            ways = (
                lambda x=x, b=blocks: gguf_linear(x, b, qtype),
                lambda x=x, b=blocks: gguf_linear_ref(x, b, qtype),
                lambda x=x, b=blocks, buf=buffer: F.linear(
                    x, buf.copy_(gguf_dequantize_ref(b, qtype))
                ),
                lambda x=x, w=dense: F.linear(x, w),
            )
            numba, per_call, buffered, once = (best_of(way, repeats) for way in ways)
            lines.append(
                f"{name:<8} {m:>5} {numba * 1e3:>9.2f} {per_call * 1e3:>9.2f} "
                f"{buffered * 1e3:>9.2f} {once * 1e3:>9.2f} {numba / once:>12.2f}x "
                f"{per_call / once:>15.1f}x"
            )
    return lines


def weight_bytes(llm) -> int:
    model = llm.engine.runner.model
    return sum(p.numel() * p.element_size() for p in model.parameters())


def e2e_table(num_prompts: int, prompt_len: int, max_tokens: int, repeats: int) -> list[str]:
    from pagedserve.engine import LLM, SamplingParams
    from pagedserve.models.default_model import ensure_default_model, find_default_gguf

    gen = torch.Generator().manual_seed(0)
    prompts = [
        {"prompt_token_ids": torch.randint(100, 40000, (prompt_len,), generator=gen).tolist()}
        for _ in range(num_prompts)
    ]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    models = {"GGUF Q4_1, in blocks": find_default_gguf(), "fp32 folder": ensure_default_model()}
    llms = {label: LLM(model=str(path)) for label, path in models.items()}
    runs = {label: [] for label in llms}
    results = {}
    for _ in range(repeats):
        for label, llm in llms.items():
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            middle = time.perf_counter()
            llm.generate(prompts, first, use_tqdm=False)
            runs[label].append((middle - start, middle - start - (time.perf_counter() - middle)))
            results[label] = [o.outputs[0].token_ids for o in outs]
    lines = [
        f"SmolLM2-135M-Instruct, {num_prompts} prompts x {prompt_len} tokens, {max_tokens} greedy "
        f"tokens each, fp32 activations, best of {repeats}:",
        f"{'model':<24} {'weight MiB':>10} {'seconds':>8} {'tok/s':>7} {'step ms':>8}",
    ]
    for label, llm in llms.items():
        seconds, decoding = min(r[0] for r in runs[label]), min(r[1] for r in runs[label])
        tokens = num_prompts * max_tokens
        lines.append(
            f"{label:<24} {weight_bytes(llm) / 2**20:>10.1f} {seconds:>8.2f} "
            f"{tokens / seconds:>7.1f} {1e3 * decoding / (max_tokens - 1):>8.2f}"
        )
    same = sum(a == b for a, b in zip(*results.values()))
    lines.append(f"greedy tokens identical for {same} of {num_prompts} prompts")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--qtype", default="Q4_1", choices=list(GGUF_TYPE_IDS))
    parser.add_argument("--rows", default="1,64", help="activation rows per call, comma list")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--skip-e2e", action="store_true")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch threads {threads}"
    )
    print(
        "\n".join(
            projection_table(args.qtype, [int(r) for r in args.rows.split(",")], args.repeats)
        )
    )
    if not args.skip_e2e:
        print()
        print(
            "\n".join(e2e_table(args.num_prompts, args.prompt_len, args.max_tokens, args.repeats))
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
