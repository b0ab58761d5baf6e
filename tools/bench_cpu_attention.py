"""CPU paged attention: the numba kernel against the PyTorch reference, one process, ratios.

Workload (SmolLM2-135M's attention layout: 9 query heads, 3 KV heads, head dim 64, fp32 cache,
block size 16, shuffled block tables, seed 0):

- decode: 1, 16 and 64 sequences, one new token each, contexts uniform in [300, 1000];
- prefill: one 2,000-token prompt (no cached prefix), and a 512-token chunk over a
  1,488-token cached prefix; SDPA as the reference ran it before (3-D inputs, enable_gqa:
  torch's "math" path) against the reference now (4-D, KV heads repeated: the flash kernel)
  against the numba kernel;
- crossover: one sequence, q_len 1..128 new tokens over 200 and 1,000 positions, numba vs
  SDPA: where ``paged_attention_cpu`` switches (``NUMBA_MAX_Q_LEN``).

``--cache-dtypes float16 fp8 q8_0``: the decode rows again over caches of those dtypes, each
with its ratio to the fp32 cache's time on the same sequences.

Each figure is the best of ``--repeats`` calls, after a warm-up call. numba uses
``min(torch threads, NUMBA_NUM_THREADS)`` threads: set both, e.g.

    NUMBA_NUM_THREADS=2 .venv/bin/python tools/bench_cpu_attention.py --threads 2
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np
import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu.paged_attention import (
    NUMBA_MAX_Q_LEN,
    paged_attention_numba,
    warm_up,
)
from pagedserve.kernels.paged_attention_ref import _gather_kv, paged_attention_ref
from pagedserve.kernels.testing import make_paged_batch

HEADS = (9, 3, 64)  # SmolLM2-135M: Hq, Hkv, head dim
BLOCK_SIZE = 16


def best_of(fn, args, repeats: int) -> float:
    fn(*args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return min(times)


def sdpa_3d_enable_gqa(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale):
    """One sequence's prefill as the reference ran it before: 3-D SDPA with enable_gqa."""
    q_len = query.shape[0]
    k = _gather_kv(k_cache, block_tables[:1], seq_lens[:1])[:, 0]
    v = _gather_kv(v_cache, block_tables[:1], seq_lens[:1])[:, 0]
    n_kv = k.shape[1]
    n_cached = n_kv - q_len
    mask = None
    if n_cached:
        mask = torch.arange(n_kv)[None, :] <= torch.arange(n_cached, n_kv)[:, None]
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1), k, v, attn_mask=mask, is_causal=not n_cached, scale=scale,
        enable_gqa=True,
    )  # fmt: skip
    return out.transpose(0, 1)


def decode_rows(repeats: int) -> list[str]:
    rng = np.random.default_rng(0)
    lines = []
    for n_seqs in (1, 16, 64):
        lens = rng.integers(300, 1001, n_seqs).tolist()
        args = make_paged_batch([(n, 1) for n in lens], *HEADS, BLOCK_SIZE).args()
        ref, numba = (
            best_of(paged_attention_ref, args, repeats),
            best_of(paged_attention_numba, args, repeats),
        )
        lines.append(
            f"decode {n_seqs:>3} seqs      ref {ref * 1e3:8.2f} ms   numba {numba * 1e3:8.2f} ms"
            f"   ref/numba {ref / numba:5.2f}x"
        )
    return lines


CACHE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16,
                "fp8": torch.float8_e4m3fn, "q8_0": torch.int8}  # fmt: skip


def cache_dtype_rows(names: list[str], repeats: int) -> list[str]:
    """The numba decode over caches of other dtypes (``--kv-cache-dtype``), each against the
    fp32 cache's time on the same batch (the same sequences, the values rounded to the cache)."""
    rng = np.random.default_rng(0)
    lines = []
    for n_seqs in (1, 16, 64):
        seqs = [(n, 1) for n in rng.integers(300, 1001, n_seqs).tolist()]
        fp32 = best_of(
            paged_attention_numba, make_paged_batch(seqs, *HEADS, BLOCK_SIZE).args(), repeats
        )
        cells = [f"fp32 {fp32 * 1e3:7.3f} ms"]
        for name in names:
            batch = make_paged_batch(seqs, *HEADS, BLOCK_SIZE, cache_dtype=CACHE_DTYPES[name])
            took = best_of(paged_attention_numba, batch.args(), repeats)
            cells.append(f"{name} {took * 1e3:7.3f} ms ({took / fp32:4.2f}x)")
        lines.append(f"decode {n_seqs:>3} seqs   " + "   ".join(cells))
    return lines


def prefill_rows(repeats: int) -> list[str]:
    lines = []
    for seq_len, q_len in ((2000, 2000), (2000, 512)):
        args = make_paged_batch([(seq_len, q_len)], *HEADS, BLOCK_SIZE).args()
        old, new = (
            best_of(sdpa_3d_enable_gqa, args, repeats),
            best_of(paged_attention_ref, args, repeats),
        )
        numba = best_of(paged_attention_numba, args, repeats)
        lines.append(
            f"prefill {q_len:>4} new / {seq_len} ctx   SDPA 3-D gqa {old * 1e3:8.1f} ms   "
            f"SDPA 4-D {new * 1e3:7.1f} ms   numba {numba * 1e3:7.1f} ms   "
            f"before/after {old / new:4.2f}x   numba/SDPA {numba / new:4.2f}x"
        )
    return lines


def crossover_rows(repeats: int) -> list[str]:
    lines = [
        f"crossover (numba/SDPA time; paged_attention_cpu uses numba up to q_len {NUMBA_MAX_Q_LEN})"
    ]
    for context in (200, 1000):
        cells = []
        for q_len in (2, 4, 8, 16, 32, 64, 128):
            args = make_paged_batch([(context, q_len)], *HEADS, BLOCK_SIZE).args()
            ratio = best_of(paged_attention_numba, args, repeats) / best_of(
                paged_attention_ref, args, repeats
            )
            cells.append(f"q{q_len}:{ratio:4.2f}")
        lines.append(f"  ctx {context:>4}  " + "  ".join(cells))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-crossover", action="store_true")
    parser.add_argument(
        "--cache-dtypes", nargs="*", default=[], choices=list(CACHE_DTYPES),
        help="also time the decode over these KV cache dtypes, against fp32's",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warm_up((torch.float32, *(CACHE_DTYPES[n] for n in args.cache_dtypes)))
    import numba

    print(
        f"# {platform.processor() or platform.machine()}, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), numba {numba.__version__} "
        f"({min(args.threads, numba.config.NUMBA_NUM_THREADS)} threads, "
        f"{numba.threading_layer()} layer); Hq/Hkv/D {HEADS}, block {BLOCK_SIZE}, fp32"
    )
    rows = decode_rows(args.repeats) + cache_dtype_rows(args.cache_dtypes, args.repeats)
    rows += prefill_rows(args.repeats)
    if not args.skip_crossover:
        rows += crossover_rows(args.repeats)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
