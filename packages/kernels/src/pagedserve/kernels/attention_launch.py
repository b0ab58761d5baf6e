"""How the Triton paged attention is launched: its tile shape and its KV split count.

These are the wrapper's choices, kept apart from the kernel so that the warm-up
(warmup.py) enumerates exactly the variants the wrapper can pick, from the same functions.
"""

from __future__ import annotations

import math

import torch
import triton

from pagedserve.kernels.dispatch import is_cuda, multi_processor_count

# Caches whose tiles are widened in registers before the dots: fp8 e4m3 (kv_fp8.py) and q8_0
# rows (kv_q8.py, int8 tensors).
BYTE_CACHE_DTYPES = (torch.float8_e4m3fn, torch.int8)


def tile_shape(
    group: int, head_dim: int, decode_like: bool, dot_fp32: bool, byte_cache: bool = False
) -> tuple[int, int, int]:
    """(BLOCK_M rows = tokens x group heads, TILE_N kv positions per step, warps).

    The fp32 dot runs on FMA units with its operands in registers: half the prefill rows and
    twice the warps keep it spill-free (at head_dim 128, prefill went from 255 registers and
    2.4 KB of spill stores per thread on sm90, 16 KB on sm80, to ~110 registers and none;
    docs/kernel-suite.md has the table). A 16-bit query over a cache of bytes (fp8, q8_0)
    widens each tile in registers first: 8 warps (with 4, SmolLM2's prefill over fp8 spilled
    4-8 bytes on sm80)."""
    if dot_fp32:
        rows, warps = (16 if decode_like else 32), 8
    else:
        rows = 16 if decode_like else (64 if head_dim <= 128 else 32)
        warps = 8 if byte_cache else 4
    return max(rows, triton.next_power_of_2(group)), 32 if head_dim <= 128 else 16, warps


# KV positions per split in the batch-invariant mode: every row's positions are cut here and
# folded in order, whatever the batch (a multiple of every TILE_N).
BATCH_INVARIANT_SPLIT = 512


def batch_invariant_tile_shape(group: int, head_dim: int, dot_fp32: bool) -> tuple[int, int, int]:
    """The batch-invariant mode's one tile for decode and prefill alike, so that a row's
    scores and sums are reduced over the same lanes and warps in every step (``tile_shape``
    picks a smaller tile for decodes). fp32: the decode tile (16 rows, 8 warps: with 32 rows
    the split programs took 255 registers and spilled 0.5 KB on sm90); 16-bit: 32 rows over 8
    warps (the fold's running sum is a second accumulator, which 4 warps spilled at head_dim
    128 on sm90, 28 bytes; docs/batch_invariance.md has the compile check's table)."""
    rows = 16 if dot_fp32 else 32
    return max(rows, triton.next_power_of_2(group)), 32 if head_dim <= 128 else 16, 8


def kv_split_count(n_seqs: int, n_kv_heads: int, max_context: int, n_sms: int) -> int:
    """KV splits of a decode-shaped batch on a GPU with ``n_sms`` SMs: only for long contexts
    (>= 1024 positions) and too few (sequence, KV head) programs to fill the device; each
    split keeps >= 512 positions so the merge stays cheap. At most 64."""
    if max_context < 1024:
        return 1
    wanted = triton.cdiv(2 * n_sms, max(1, n_seqs * n_kv_heads))
    return max(1, min(wanted, max_context // 512, 64))


def decode_kv_splits(query: torch.Tensor, n_kv_heads: int, max_context: int) -> int:
    """The split count for this decode batch (1 off CUDA: the interpreter and CPU need none)."""
    if not is_cuda(query):
        return 1
    return kv_split_count(query.shape[0], n_kv_heads, max_context, multi_processor_count(query))


def launch_shape(
    query: torch.Tensor,
    n_kv_heads: int,
    max_context: int,
    decode_like: bool,
    windowed: bool,
    num_kv_splits: int | None,
    batch_invariant: bool,
    cache_dtype: torch.dtype | None = None,
) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, TILE_N, warps, KV splits, positions per split) of a launch. Splits: the
    caller's ``num_kv_splits``, else ``decode_kv_splits`` for a decode-shaped batch without a
    window, else 1. Batch invariant: the one tile, and when the launch splits, one program per
    fixed split of ``BATCH_INVARIANT_SPLIT`` positions (1: a program walks them all).
    ``cache_dtype``: the KV cache's (a cache of bytes takes more warps: ``tile_shape``)."""
    group, head_dim = query.shape[1] // n_kv_heads, query.shape[2]
    dot_fp32 = query.dtype == torch.float32 or not is_cuda(query)
    may_split = decode_like and not windowed
    splits = num_kv_splits or (decode_kv_splits(query, n_kv_heads, max_context) if may_split else 1)
    if batch_invariant:
        block_m, tile_n, warps = batch_invariant_tile_shape(group, head_dim, dot_fp32)
        splits = triton.cdiv(max_context, BATCH_INVARIANT_SPLIT) if splits > 1 else 1
        return block_m, tile_n, warps, splits, BATCH_INVARIANT_SPLIT
    byte_cache = cache_dtype in BYTE_CACHE_DTYPES
    block_m, tile_n, warps = tile_shape(group, head_dim, decode_like, dot_fp32, byte_cache)
    per_split = triton.cdiv(triton.cdiv(max_context, splits), tile_n) * tile_n
    return block_m, tile_n, warps, splits, per_split


def score_scales(scale: float, logits_soft_cap: float | None) -> tuple[float, float, float]:
    """The kernel's three score scalars: ``scale * log2(e)`` (scores in exp2 units),
    ``scale / cap`` and ``cap * log2(e)`` (soft-capping; 0 for the last when uncapped)."""
    cap = logits_soft_cap or 0.0
    return scale * math.log2(math.e), scale / (cap or 1.0), cap * math.log2(math.e)
