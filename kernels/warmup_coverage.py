"""After the warm-up, serving compiles nothing: a workload's kernel variants, all warmed up.

A workload of decode steps (batch sizes 1 to max_num_seqs, contexts from a few tokens to
max_model_len), mixed prefill steps and whole prompts goes through the real launch wrappers on
CPU tensors, taken as a target GPU's (``launch_capture``). Triton's jit cache hook records the
key of every variant a launch would compile and compiles nothing. Every paged-attention key of
the workload must be among those ``paged_attention_warmup`` produced, and every key of MLA's
decode (the workload's decode steps over DeepSeek's latent cache) among
``mla_decode_warmup``'s; every other kernel must need one variant per model, whatever the
batch (so the first forward compiles it for good).

    python kernels/warmup_coverage.py           # exit status 0 when covered
"""

from __future__ import annotations

import random
import sys
from itertools import product

import torch
import triton
from engine_launches import (
    MLA_SHAPE,
    MODELS,
    ModelShape,
    layer_launches,
    sampler_launches,
    store_launches,
)
from launch_capture import TARGETS, Target, compiling_for, jit_cache_keys

from pagedserve.kernels.mla_decode import mla_paged_decode_triton
from pagedserve.kernels.paged_attention import paged_attention_triton
from pagedserve.kernels.warmup import mla_decode_warmup, paged_attention_warmup

ATTENTION = {"_paged_attention_kernel", "_merge_kv_splits_kernel", "_fold_kv_splits_kernel"}


def workload(rng: random.Random, max_num_seqs: int, max_model_len: int) -> list:
    """Steps as (seq_len, q_len) lists: decodes at many batch sizes and context lengths (short
    and long, so split counts vary), mixed steps, single prompts."""
    steps = []
    for batch in sorted({1, 2, 3, 4, 7, 8, 16, 31, 64, max_num_seqs}):
        for longest in (5, 100, 1023, 1024, 3000, max_model_len):
            steps.append([(rng.randint(1, longest), 1) for _ in range(batch - 1)] + [(longest, 1)])
    for _ in range(6):
        decodes = [(rng.randint(1, max_model_len), 1) for _ in range(rng.randint(0, 8))]
        prompt = rng.randint(2, 300)
        steps.append(decodes + [(prompt + rng.randint(0, 500), prompt)])
    steps += [[(n, n)] for n in (2, 17, 256)]
    return steps


def step_args(m: ModelShape, seqs, dtype, block_size: int, device: str = "cpu") -> tuple:
    """paged_attention's arguments for one step, laid out as the model runner and the models
    lay them out (block tables as wide as the step's longest sequence; llama's query a view of
    the fused qkv output), with a cache of two blocks: only shapes, strides and dtypes decide
    the variant, and nothing runs."""
    n_tokens = sum(q for _, q in seqs)
    q_width = m.n_q_heads * m.head_dim
    fused = torch.zeros(n_tokens, q_width + 2 * m.n_kv_heads * m.head_dim, dtype=dtype)
    query = fused[:, :q_width].view(n_tokens, m.n_q_heads, m.head_dim)
    if m.gpt2 or m.name.startswith("qwen3"):  # gpt2 copies q out, qwen3's q_norm makes a new one
        query = query.contiguous()
    cache = torch.zeros(2, block_size, m.n_kv_heads, m.head_dim, dtype=dtype)
    width = triton.cdiv(max(s for s, _ in seqs), block_size)
    starts = torch.tensor([0] + [q for _, q in seqs]).cumsum(0).to(torch.int32)
    args = (
        query, cache, cache, torch.zeros(len(seqs), width, dtype=torch.int32),
        torch.tensor([s for s, _ in seqs], dtype=torch.int32), starts,
    )  # fmt: skip
    return (*(a.to(device) for a in args), m.head_dim**-0.5)


def attention_keys(
    m, dtype, block_size, max_model_len, steps, target, batch_invariant=False, key_limits=False
) -> tuple[set, set]:
    """(keys the warm-up made, keys the workload needs). A model with a window serves every
    step through its global layers and through its windowed ones (as Gemma's alternate).
    ``key_limits``: every step also carries per-row key limits (Gemma 3's images)."""
    sinks = dict(sinks=torch.zeros(m.n_q_heads)) if m.sinks else {}
    kinds = [dict(logits_soft_cap=m.logits_soft_cap, **sinks)]
    if m.sliding_window is not None:
        kinds.append(
            dict(sliding_window=m.sliding_window, logits_soft_cap=m.logits_soft_cap, **sinks)
        )
    with compiling_for(target), jit_cache_keys() as warm:
        paged_attention_warmup(
            m.n_q_heads, m.n_kv_heads, m.head_dim, dtype, block_size, max_model_len, "cpu",
            layer_windows=(None, m.sliding_window), logits_soft_cap=m.logits_soft_cap,
            batch_invariant=batch_invariant,
            sinks=m.sinks, key_limits=key_limits,
        )  # fmt: skip
    with compiling_for(target), jit_cache_keys() as served:
        for seqs in steps:
            for kind in kinds:
                args = step_args(m, seqs, dtype, block_size)
                paged_attention_triton(*args, **kind, batch_invariant=batch_invariant)
                if key_limits:
                    limits = torch.ones(args[0].shape[0], dtype=torch.int32)
                    paged_attention_triton(
                        *args, **kind, batch_invariant=batch_invariant, key_limits=limits
                    )
    return set(warm), set(served)


def mla_keys(dtype, block_size, max_model_len, steps, target) -> tuple[set, set]:
    """(keys MLA's warm-up made, keys the workload's decode steps need) for DeepSeek's shape;
    the query as the model builds it (a concatenation: contiguous)."""
    _, heads, kv_lora_rank, rope_dim = MLA_SHAPE
    width = kv_lora_rank + rope_dim
    with compiling_for(target), jit_cache_keys() as warm:
        mla_decode_warmup(heads, kv_lora_rank, rope_dim, dtype, block_size, max_model_len, "cpu")
    cache = torch.zeros(2, block_size, 1, width, dtype=dtype)
    with compiling_for(target), jit_cache_keys() as served:
        for seqs in steps:
            if any(q != 1 for _, q in seqs):
                continue  # prefills take the expanded path: torch's attention
            query = torch.zeros(len(seqs), heads, width, dtype=dtype)
            width_blocks = triton.cdiv(max(s for s, _ in seqs), block_size)
            tables = torch.zeros(len(seqs), width_blocks, dtype=torch.int32)
            seq_lens = torch.tensor([s for s, _ in seqs], dtype=torch.int32)
            mla_paged_decode_triton(query, cache, tables, seq_lens, width**-0.5, kv_lora_rank)
    return set(warm), set(served)


def other_kernel_keys(m: ModelShape, dtype, target: Target) -> dict[int, set]:
    """Every other kernel's keys for steps of each of many token (and row) counts."""
    keys = {}
    for n_tokens in (1, 2, 3, 16, 17, 255, 256):
        with compiling_for(target), jit_cache_keys() as seen:
            layer_launches(m, dtype, 16, n_tokens)
            store_launches(m, dtype, 16, n_tokens)
            sampler_launches(m, rows=1 + n_tokens % 9)
        keys[n_tokens] = set(seen)
    return keys


def check(target: Target, max_num_seqs: int = 256, max_model_len: int = 8192) -> list[str]:
    steps = workload(random.Random(0), max_num_seqs, max_model_len)
    problems = []
    for m in MODELS:
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            for block_size, batch_invariant in product((16, 32), (False, True)):
                # a windowed model stands for Gemma 3's: its image steps carry key limits
                limited = m.sliding_window is not None and not m.sinks
                warm, served = attention_keys(
                    m, dtype, block_size, max_model_len, steps, target, batch_invariant, limited
                )
                missing = served - warm
                # decode, prefill and split decode at least; batch invariant: walk and split
                if len(served) < (2 if batch_invariant else 3) or missing:
                    mode = " batch-invariant" * batch_invariant
                    problems.append(
                        f"{m.name} {dtype} bs{block_size}{mode}: {len(missing)} of "
                        f"{len(served)} served variants not warmed up, e.g. {sorted(missing)[:1]}"
                    )
                if m is MODELS[0] and not batch_invariant:  # MLA decode: once per dtype, bs
                    warm, served = mla_keys(dtype, block_size, max_model_len, steps, target)
                    if len(served) < 2 or served - warm:  # decode and split decode
                        problems.append(f"MLA {dtype} bs{block_size}: {served - warm} not warm")
            by_size = other_kernel_keys(m, dtype, target)
            first = by_size[1]
            for n_tokens, keys in by_size.items():
                if keys != first:  # a variant that only some step sizes need
                    extra = sorted({name for name, _ in keys ^ first})
                    problems.append(f"{m.name} {dtype}: {extra} differ at {n_tokens} tokens")
    return problems


def main() -> int:
    for name in ("sm90", "sm80"):
        problems = check(TARGETS[name])
        print(f"warm-up coverage on {name}: {'ok' if not problems else 'MISSING'}")
        for line in problems:
            print("  " + line)
        if problems:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
