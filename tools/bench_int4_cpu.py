"""How a CPU should run 4-bit group-quantized linear layers (AWQ / GPTQ checkpoints).

Workload: one SmolLM2-135M decoder layer's four projections (qkv 960x576, o 576x576,
gate_up 3072x576, down 576x1536; group size 64), fp32 activations of 1 row (a decode step)
and 64 rows (a prefill chunk), best thread CPU time of ``--repeat`` runs after a warm-up, seed 0. Options:

- ``fp32 weight``: the unquantized layer, ``F.linear`` (the baseline; 4 bytes a weight);
- ``int4, workspace``: the reference (what a CPU runs for act-order layers whose groups are
  not contiguous), dequantize each layer into one reused fp32 buffer and one fp32 GEMM (half a byte a weight, plus one layer's fp32 buffer for the model);
- ``int4 rows``: pagedserve's CPU path, the weight rewritten once into rows of 4-bit groups
  (one output feature a row) and multiplied by the GGUF GEMM, which decodes four rows at a
  time into an L1 buffer (decode) or tiles for MKL (prefill); no fp32 weight held;
- ``int4, fresh buffer``: the same as the workspace, allocating the fp32 weight on every call;
- ``uint8 values``: the 4-bit values kept one per byte (1 byte a weight), dequantized the same
  way without the shifts;
- ``grouped GEMM``: no dequantized weight: per group, ``x_g @ q_g`` on the unpacked integers,
  scaled per output and corrected by ``sum(x_g) * zero * scale``.

Prints one table: milliseconds per layer and the ratio to the fp32 weight, and the bytes each
option holds for the layer. ``python tools/bench_int4_cpu.py``.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu.int4_linear import int4_group_rows, int4_rows_linear
from pagedserve.kernels.int4_linear import (
    Int4Workspace,
    dequantize_int4,
    int4_linear_ref,
    pack_int4_rows,
    unpack_int4_rows,
)

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
GROUP = 64  # SmolLM2's 576 features are 4.5 groups of 128; AutoAWQ wants whole groups


def make_layers(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    layers = {}
    for name, (n, k) in SHAPES.items():
        q = torch.randint(0, 16, (k, n), generator=gen)
        zeros = torch.randint(0, 16, (k // GROUP + (k % GROUP > 0), n), generator=gen)
        scales = torch.rand(zeros.shape, generator=gen) / 100
        zeros = zeros.to(torch.uint8)
        qweight = pack_int4_rows(q)
        weight = dequantize_int4(qweight, scales, zeros, GROUP).t().contiguous()
        layers[name] = {"qweight": qweight, "scales": scales, "zeros": zeros,
                        "weight": weight, "values": q.to(torch.uint8),
                        "rows": int4_group_rows(q, scales, zeros, GROUP)}  # fmt: skip
    return layers


def uint8_values(x, layer):
    k = layer["values"].shape[0]
    w = layer["values"].float().view(-1, GROUP, layer["values"].shape[1])
    w = (w - layer["zeros"].float()[:, None]) * layer["scales"][:, None]
    return x @ w.view(k, -1)


def grouped_gemm(x, layer):
    q = unpack_int4_rows(layer["qweight"]).float()
    k, n = q.shape
    xg = x.view(x.shape[0], k // GROUP, GROUP).transpose(0, 1)  # [G, M, gs]
    partial = torch.bmm(xg, q.view(k // GROUP, GROUP, n))  # [G, M, N]
    zero_term = xg.sum(-1, keepdim=True) * layer["zeros"].float()[:, None]
    return ((partial - zero_term) * layer["scales"][:, None]).sum(0)


def options(workspace: Int4Workspace) -> dict:
    def int4(layer, ws):
        return lambda x: int4_linear_ref(
            x, layer["qweight"], layer["scales"], layer["zeros"], GROUP, workspace=ws
        )

    return {
        "fp32 weight": (lambda layer: lambda x: F.linear(x, layer["weight"]), ("weight",)),
        "int4, workspace": (lambda layer: int4(layer, workspace), ("qweight", "scales", "zeros")),
        "int4 rows": (lambda layer: lambda x: int4_rows_linear(x, layer["rows"]), ("rows",)),
        "int4, fresh buffer": (lambda layer: int4(layer, None), ("qweight", "scales", "zeros")),
        "uint8 values": (lambda layer: lambda x: uint8_values(x, layer), ("values", "scales", "zeros")),
        "grouped GEMM": (lambda layer: lambda x: grouped_gemm(x, layer), ("qweight", "scales", "zeros")),
    }  # fmt: skip


def timed(fn, x, repeat: int) -> float:
    """Best CPU time of this thread over ``repeat`` calls: on the shared 2-core machine, wall
    time mostly measures who else is running; one thread's CPU time does not (torch is on
    one thread here, ``OMP_NUM_THREADS=1``)."""
    fn(x)
    best = float("inf")
    for _ in range(repeat):
        start = time.thread_time()
        fn(x)
        best = min(best, time.thread_time() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    layers, workspace = make_layers(), Int4Workspace()
    results = {}
    for label, (build, held) in options(workspace).items():
        row = {}
        for m in (1, 64):
            total = 0.0
            for name, layer in layers.items():
                x = torch.randn(m, SHAPES[name][1])
                total += timed(build(layer), x, args.repeat)
            row[m] = total * 1e3
        row["bytes"] = sum(layer[t].nbytes for layer in layers.values() for t in held)
        results[label] = row
    base = results["fp32 weight"]
    print(f"threads {torch.get_num_threads()}; SmolLM2 layer, group {GROUP}; best of {args.repeat}")
    print(
        f"{'option':<20} {'decode ms':>10} {'x fp32':>7} {'prefill ms':>11} {'x fp32':>7} {'KiB held':>9}"
    )
    for label, row in results.items():
        print(
            f"{label:<20} {row[1]:>10.3f} {row[1] / base[1]:>7.2f} {row[64]:>11.3f} "
            f"{row[64] / base[64]:>7.2f} {row['bytes'] / 1024:>9.0f}"
        )


if __name__ == "__main__":
    main()
