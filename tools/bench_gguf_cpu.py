"""GGUF linear layers on a CPU, per block type: the numba GEMM from the blocks against the old
path (dequantize the whole matrix, then one GEMM) and against the same layers in fp32.

Workload: a decode step's projections of the model's decoder layers (fused qkv, o, fused
gate_up, down; each layer its own random blocks, seed 0, every quant and scale bit drawn at
random with fp16 scales near 0.02), fp32 activations of ``--rows`` rows (1 and 16: a decode
step of one stream and of sixteen). A type covers the projections whose input width is whole
blocks of it: SmolLM2-135M's 576-wide rows are not whole 256-weight blocks, so there the
K-quants and IQ4_XS cover ``down`` only (llama.cpp's own Q4_K_M falls back to Q5_0 / Q8_0 for
those rows, as this table's Q5_0 and Q8_0 rows do). The lm_head is left out. Options:

- ``blocks``: ``gguf_linear`` on CPU as the engine runs it (cpu/gguf_linear.py);
- ``dequant+GEMM``: ``gguf_linear_ref``, each matrix decoded to fp32 then one GEMM (what a
  CPU ran before the numba GEMM);
- ``fp32``: the same shapes in fp32 through ``linear`` (the fp32 decode GEMM up to 16 rows,
  MKL above): what the unquantized model runs.

Each round times one step of every option in turn (wall time, ``--threads`` threads), so a
busy neighbour slows all of them alike; the table gives each option's min and median over
``--rounds`` rounds and the ratios of the minima (fp32 / blocks: above 1 the blocks are
faster). The layers' fp32 weights (405 MiB for SmolLM2) stream from memory as a step's do;
a quantized model's blocks may fit in the last-level cache, as they would when serving.

    .venv/bin/python tools/bench_gguf_cpu.py                         # SmolLM2-135M's shapes
    .venv/bin/python tools/bench_gguf_cpu.py --model llama-1b --layers 4 --types Q4_K Q8_0
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from pagedserve.kernels.gguf_dequant import GGUF_TYPE_IDS, gguf_dequantize_ref, gguf_type
from pagedserve.kernels.gguf_linear import gguf_linear, gguf_linear_ref
from pagedserve.kernels.linear import linear
from pagedserve.kernels.testing import random_gguf_rows

# hidden, intermediate, attention heads, kv heads, head dim, layers
MODELS = {
    "smollm2-135m": (576, 1536, 9, 3, 64, 30),
    "llama-1b": (2048, 8192, 32, 8, 64, 16),
    "tiny": (256, 512, 4, 2, 64, 2),
}
BLOCK_TYPES = [t for t in GGUF_TYPE_IDS if t not in ("F32", "F16", "BF16")]
OPTIONS = ("blocks", "dequant+GEMM", "fp32")


def projections(model: str) -> dict[str, tuple[int, int]]:
    """(out, in) features of one decoder layer's projections, fused as the engine fuses them."""
    hidden, inter, heads, kv_heads, head_dim, _ = MODELS[model]
    return {
        "qkv": ((heads + 2 * kv_heads) * head_dim, hidden),
        "o": (hidden, heads * head_dim),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
    }


def make_layers(model: str, qtype: int, layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(blocks, fp32 weight)`` of every covered projection of ``layers`` layers."""
    block = gguf_type(qtype).block_size
    shapes = [s for s in projections(model).values() if s[1] % block == 0]
    made = []
    for layer in range(layers):
        for i, (n, k) in enumerate(shapes):
            rows = random_gguf_rows(qtype, n, k, seed=100 * layer + i)
            made.append((rows, gguf_dequantize_ref(rows, qtype)))
    return made


def step_functions(made, qtype: int, rows: int) -> dict[str, Callable[[], None]]:
    """One decode step of each option over ``made``'s matrices."""
    inputs = [
        torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(1)) for _, w in made
    ]

    def blocks():
        for x, (q, _) in zip(inputs, made):
            gguf_linear(x, q, qtype)

    def reference():
        for x, (q, _) in zip(inputs, made):
            gguf_linear_ref(x, q, qtype)

    def fp32():
        for x, (_, w) in zip(inputs, made):
            linear(x, w)

    return dict(zip(OPTIONS, (blocks, reference, fp32)))


def measure(model: str, type_name: str, rows: int, layers: int, rounds: int) -> dict[str, list]:
    """Seconds per step of each option, ``rounds`` rounds taking turns."""
    qtype = GGUF_TYPE_IDS[type_name]
    made = make_layers(model, qtype, layers)
    if not made:
        return {}
    steps = step_functions(made, qtype, rows)
    for step in steps.values():
        step()  # compile, fault the pages in
    times: dict[str, list] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return times


def table(results: dict[tuple[str, int], dict[str, list]]) -> list[str]:
    lines = [
        f"{'type':<7} {'rows':>4} "
        + " ".join(f"{o + ' ms min/med':>25}" for o in OPTIONS)
        + f" {'fp32/blocks':>11} {'dequant/blocks':>14}"
    ]
    for (type_name, rows), times in results.items():
        if not times:
            lines.append(f"{type_name:<7} {rows:>4}  (no projection of this model is whole blocks)")
            continue
        best = {o: min(times[o]) for o in OPTIONS}
        cells = " ".join(
            f"{1e3 * best[o]:>12.2f} / {1e3 * statistics.median(times[o]):>10.2f}" for o in OPTIONS
        )
        lines.append(
            f"{type_name:<7} {rows:>4} {cells} {best['fp32'] / best['blocks']:>11.2f} "
            f"{best['dequant+GEMM'] / best['blocks']:>14.2f}"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2-135m")
    parser.add_argument("--types", nargs="+", choices=BLOCK_TYPES, default=BLOCK_TYPES)
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--layers", type=int, help="decoder layers (default: the model's)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    layers = args.layers or MODELS[args.model][5]
    results = {
        (t, rows): measure(args.model, t, rows, layers, args.rounds)
        for t in args.types
        for rows in args.rows
    }
    shapes = ", ".join(f"{name} {n}x{k}" for name, (n, k) in projections(args.model).items())
    print(
        f"{args.model}: {layers} layers of {shapes}; {args.threads} threads; "
        f"{args.rounds} rounds; load average {os.getloadavg()[0]:.2f}"
    )
    for line in table(results):
        print(line)


if __name__ == "__main__":
    main()
