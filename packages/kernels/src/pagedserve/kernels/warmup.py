"""Compile, at start-up, every paged-attention variant that serving can launch.

Triton compiles a kernel the first time it meets a new combination of dtypes, constexprs and
argument specialisations: 1-3 s of stall, in the middle of serving, for the unlucky step.
Paged attention is the one kernel whose launches change with the batch: decode and prefill
steps take different tiles, and a decode batch over long contexts splits the KV axis
(flash-decoding), with a merge kernel whose tile follows the split count. Every argument that
varies per step is marked ``do_not_specialize`` in the kernels, so the variants left are:

- a decode step without splits and a prefill (or mixed) step;
- a decode step for each split count it can take (the merge's tile follows the count, and the
  partials' strides do too). ``kv_split_count`` is at most ``cdiv(2 * SMs, Hkv)`` (one
  sequence) and at most ``max_context // 512``, and every count from 2 up to the smaller
  bound is reachable; so the batch sizes served do not matter, only the model, the GPU and
  ``max_model_len`` (block tables are never wider than ``cdiv(max_model_len, block_size)``).
  Launches with one key compile once: for head_dim a multiple of 16 the counts differ only
  in the merge's tile, a power of two.

The query, output and cache strides stay specialised (they vectorise the tile loads): the
warm-up's query is contiguous, the models' may be a view of the fused qkv output; for head_dim
a multiple of 16 (every model here) both strides divide by 16 and give one variant.

A model with sliding-window layers (or soft-capped scores) adds the windowed variants: a decode
step and a prefill step (a windowed decode never splits its KV axis); the window's width is a
runtime scalar, so one window compiles for all. The batch-invariant mode has fewer: its one
tile serves decode and prefill alike, and its splits are fixed (the fold loops over them). A
model with attention sinks (gpt-oss) has them on every layer: each of its variants is launched
with sinks (fp32, as the model holds them), and none without.

Multi-head latent attention's decode (mla_decode.py) has the same kind of variants: a decode
step without splits and one for each reachable split count, its head tiles standing for the
KV heads in the split choice (``mla_decode_warmup``). Its prefill runs torch's own attention.

Every other kernel has one variant per model and dtype and is compiled by the first forward
(the profiling step, on a GPU).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import triton

from pagedserve.kernels.attention_launch import kv_split_count
from pagedserve.kernels.dispatch import is_cuda, multi_processor_count, use_triton
from pagedserve.kernels.kv_q8 import zeros_cache
from pagedserve.kernels.mla_decode import mla_paged_decode_triton, mla_tile_shape
from pagedserve.kernels.paged_attention import paged_attention_triton


def reachable_kv_splits(n_kv_heads: int, max_context: int, n_sms: int) -> range:
    """Every split count > 1 that ``kv_split_count`` can return for some batch size and some
    context up to ``max_context``: 2 up to its value for one sequence at the longest context
    (one sequence at ``512 * c`` positions gets ``min(that, c)``)."""
    return range(2, kv_split_count(1, n_kv_heads, max_context, n_sms) + 1)


def paged_attention_warmup(
    n_q_heads: int,
    n_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    block_size: int,
    max_model_len: int,
    device: torch.device | str,
    layer_windows: Sequence[int | None] = (None,),
    logits_soft_cap: float | None = None,
    cache_dtype: torch.dtype | None = None,
    batch_invariant: bool = False,
    sinks: bool = False,
    key_limits: bool = False,
) -> int:
    """Launch paged attention once per variant on tiny batches (compiling each, on a GPU);
    returns the number of launches. Does nothing off a GPU (CPU tensors outside
    ``taken_as_cuda``) or where dispatch would not pick Triton (``PAGEDSERVE_KERNELS=ref``).
    ``layer_windows``: every layer's window (None: global), as ``ModelConfig.sliding_windows``
    gives them; ``logits_soft_cap``: the model's attention soft cap, if any; ``cache_dtype``:
    the KV cache's element type when it differs from the model's (``--kv-cache-dtype``);
    ``batch_invariant``: the batch-invariant mode's variants instead (one tile for every step:
    a program that walks its fixed splits, split programs and their fold; windowed, the
    first); ``sinks``: whether the model's layers have attention sinks; ``key_limits``: whether
    its steps may carry per-row key limits (Gemma 3's images read both ways): every variant
    again with them."""
    probe = torch.empty(0, device=device)
    if not (is_cuda(probe) and use_triton(probe)):
        return 0
    max_blocks = triton.cdiv(max_model_len, block_size)
    splits = reachable_kv_splits(n_kv_heads, max_blocks * block_size, multi_processor_count(probe))
    shape = (2, block_size, n_kv_heads, head_dim)
    caches = [zeros_cache(shape, cache_dtype or dtype, device) for _ in range(2)]
    block_tables = torch.zeros(1, max_blocks, dtype=torch.int32, device=device)
    seq_lens = torch.full((1,), 2, dtype=torch.int32, device=device)
    windows = {w for w in layer_windows if w is not None}
    sink_logits = torch.zeros(n_q_heads, device=device) if sinks else None
    variants = [(None, 1, 1), (None, 2, 1), *((None, 1, s) for s in splits)]  # decode, prefill
    if batch_invariant:
        variants = [(None, 1, 1), (None, 1, 2)]
    variants = variants if None in layer_windows else []
    if windows:
        variants += [(min(windows), 1, 1)] + [(min(windows), 2, 1)] * (not batch_invariant)
    limits = [None, torch.full((2,), 2, dtype=torch.int32, device=device)][: 1 + key_limits]
    for (window, n_tokens, kv_splits), limit in itertools.product(variants, limits):
        query = torch.zeros(n_tokens, n_q_heads, head_dim, dtype=dtype, device=device)
        query_start_loc = torch.tensor([0, n_tokens], dtype=torch.int32, device=device)
        paged_attention_triton(
            query, *caches, block_tables, seq_lens, query_start_loc, head_dim**-0.5, kv_splits,
            sliding_window=window, logits_soft_cap=logits_soft_cap, sinks=sink_logits,
            batch_invariant=batch_invariant,
            key_limits=None if limit is None else limit[:n_tokens],
        )  # fmt: skip
    return len(variants) * len(limits)


def mla_decode_warmup(
    n_heads: int,
    kv_lora_rank: int,
    rope_dim: int,
    dtype: torch.dtype,
    block_size: int,
    max_model_len: int,
    device: torch.device | str,
    cache_dtype: torch.dtype | None = None,
) -> int:
    """Launch MLA's decode once per variant (no split, then every reachable split count) on a
    one-sequence batch; returns the number of launches. As ``paged_attention_warmup``, nothing
    off a GPU or where dispatch would not pick Triton. ``n_heads``: one rank's query heads."""
    probe = torch.empty(0, device=device)
    if not (is_cuda(probe) and use_triton(probe)):
        return 0
    max_blocks = triton.cdiv(max_model_len, block_size)
    dot_fp32 = dtype == torch.float32
    head_tiles = triton.cdiv(n_heads, mla_tile_shape(kv_lora_rank, dot_fp32)[0])
    splits = reachable_kv_splits(head_tiles, max_blocks * block_size, multi_processor_count(probe))
    width = kv_lora_rank + rope_dim
    cache = torch.zeros(2, block_size, 1, width, dtype=cache_dtype or dtype, device=device)
    block_tables = torch.zeros(1, max_blocks, dtype=torch.int32, device=device)
    seq_lens = torch.full((1,), 2, dtype=torch.int32, device=device)
    query = torch.zeros(1, n_heads, width, dtype=dtype, device=device)
    variants = [1, *splits]
    for kv_splits in variants:
        mla_paged_decode_triton(
            query, cache, block_tables, seq_lens, width**-0.5, kv_lora_rank, kv_splits
        )
    return len(variants)
