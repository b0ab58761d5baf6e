"""The CPU decode step's linear layers, by GEMM path, batch size and thread count.

At a small batch a decode step's GEMMs are thin (M = 1..16 rows against weights of 576 x 1536
and so on), where MKL's sgemm re-packs the weight on every call and the second OpenMP thread has
little to do. This times one decode step's linear layers (a layer's fused qkv, o_proj, fused
gate_up and down_proj, times the layers; the lm_head on the sampled rows) on the model's own
shapes, for each path:

- ``linear``: ``torch.nn.functional.linear`` (MKL sgemm), what the engine ran before the numba
  kernel and still runs above ``MAX_ROWS`` rows;
- ``numba``: ``dense_linear_numba``, what the engine runs for up to ``MAX_ROWS`` rows (timed
  at every batch size, to show where MKL overtakes it);
- ``onednn-packed``: the weight reordered once into oneDNN's blocked layout
  (``Tensor.to_mkldnn``) and applied with ``torch.ops.mkldnn._linear_pointwise``, which takes
  any batch size (MKL's own packed sgemm, ``torch.ops.mkl._mkl_linear``, packs for one batch
  size and falls back to sgemm at every other, so it is left out).

It prints milliseconds per decode step (the layers plus the lm_head) and each path's speed-up
over ``linear``, per batch size and thread count, with the load average: read it on a quiet
machine. The floor beside them is the time to read every weight once (a ``torch.sum`` over each,
the same threads): what a memory-bound step cannot beat.

    .venv/bin/python tools/bench_cpu_linear.py                       # SmolLM2-135M, 1 and 2 threads
    .venv/bin/python tools/bench_cpu_linear.py --batch-sizes 1 16 --threads 2
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F


def layer_shapes(config) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's linear layers as the engine fuses them."""
    hidden, head_dim = config.hidden_size, config.head_dim
    qkv = (config.num_attention_heads + 2 * config.num_kv_heads) * head_dim
    o_proj = config.num_attention_heads * head_dim
    inter = int(config.hf_config["intermediate_size"])
    return [(qkv, hidden), (hidden, o_proj), (2 * inter, hidden), (hidden, inter)]


def step_ms(apply, weights, xs, repeats: int) -> float:
    """Milliseconds of one pass of ``apply(x, w)`` over every (x, w) pair, best of ``repeats``."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for x, w in zip(xs, weights):
            apply(x, w)
        best = min(best, time.perf_counter() - start)
    return 1e3 * best


def paths(shapes: list[tuple[int, int]], layers: int, lm_head: torch.Tensor) -> dict[str, tuple]:
    """Each path: (its weights, one per linear of a step and the lm_head last; how to apply
    one)."""
    from pagedserve.kernels.cpu.dense_linear import dense_linear_numba

    dense = [torch.randn(n, k) for _ in range(layers) for n, k in shapes] + [lm_head]
    packed = [w.to_mkldnn() for w in dense]

    def onednn(x, w):
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

    return {
        "linear": (dense, F.linear),
        "numba": (dense, dense_linear_numba),
        "onednn-packed": (packed, onednn),
        "floor (read)": (dense, lambda x, w: w.sum()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    from pagedserve.models import ModelConfig
    from pagedserve.models.default_model import ensure_default_model

    config = ModelConfig(model=args.model or str(ensure_default_model()))
    shapes = layer_shapes(config)
    lm_head = torch.randn(config.vocab_size, config.hidden_size)
    by_path = paths(shapes, config.num_layers, lm_head)
    print(
        f"model {config.model}: {config.num_layers} layers x linear (out, in) {shapes}, lm_head "
        f"{tuple(lm_head.shape)}; fp32; load average {os.getloadavg()[0]:.1f}"
    )
    names = list(by_path)
    print(f"{'threads':>7}{'batch':>7}" + "".join(f"{p + ' ms':>18}" for p in names), end="")
    print("".join(f"{p + ' x':>16}" for p in names[1:3]))
    for threads in args.threads:
        torch.set_num_threads(threads)
        for m in args.batch_sizes:
            xs = [torch.randn(m, k) for _ in range(config.num_layers) for _, k in shapes]
            xs.append(torch.randn(m, config.hidden_size))
            times = {
                name: step_ms(apply, weights, xs, args.repeats)
                for name, (weights, apply) in by_path.items()
            }
            row = "".join(f"{times[p]:>18.2f}" for p in names)
            ratios = "".join(f"{times['linear'] / times[p]:>16.2f}" for p in names[1:3])
            print(f"{threads:>7}{m:>7}{row}{ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
