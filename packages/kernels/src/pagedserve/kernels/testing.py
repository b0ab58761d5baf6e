"""Builders of paged-attention inputs for tests and benchmarks (no production code uses this).

A :class:`PagedBatch` holds a varlen batch laid out exactly as the engine lays it out:
blocks handed out in a shuffled order (so block tables are non-contiguous), padding
entries in block tables, and every cache slot that no sequence owns filled with NaN, so an
implementation that reads past a sequence fails loudly. It also keeps each sequence's keys
and values contiguously, for naive references that know nothing about paging.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pagedserve.kernels.kv_q8 import Q8_CACHE_DTYPE, dequantize_q8_ref, quantize_q8_ref, row_width


@dataclass
class PagedBatch:
    query: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    scale: float
    keys: list[torch.Tensor]  # per sequence [seq_len, Hkv, D], contiguous
    values: list[torch.Tensor]

    def args(self) -> tuple:
        """The positional arguments of ``paged_attention``."""
        return (
            self.query, self.k_cache, self.v_cache, self.block_tables, self.seq_lens,
            self.query_start_loc, self.scale,
        )  # fmt: skip


def make_paged_batch(
    seqs: list[tuple[int, int]],
    n_q_heads: int,
    n_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    pad_value: int = -1,
    spare_blocks: int = 3,
    sliding_window: int | None = None,
    cache_dtype: torch.dtype | None = None,
) -> PagedBatch:
    """A batch of sequences given as ``(seq_len, q_len)``: q_len new tokens at the end.

    ``(n, n)`` is a whole prompt, ``(n, 1)`` a decode, ``(n, k)`` with 1 < k < n a prefill
    chunk or a prompt over a cached prefix. Block tables are padded with ``pad_value`` to
    the longest sequence plus one, so every table has at least one padding entry. With
    ``sliding_window``, blocks wholly before the first new token's window are "freed" as the
    block manager frees them: their entries point at a spare all-NaN block. ``cache_dtype``
    (default: ``dtype``): the caches' own, as ``--kv-cache-dtype`` gives it.
    """
    cache_dtype = cache_dtype or dtype
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(seq_len / block_size) for seq_len, _ in seqs]
    order = torch.randperm(sum(blocks_per_seq) + spare_blocks, generator=gen)
    shape = (len(order), block_size, n_kv_heads, head_dim)
    k_cache, v_cache = (_nan_cache(shape, cache_dtype) for _ in range(2))
    block_tables = torch.full((len(seqs), max(blocks_per_seq, default=0) + 1), pad_value)
    keys, values, queries, starts, next_block = [], [], [0], [], 0
    for b, (seq_len, q_len) in enumerate(seqs):
        if not 0 <= q_len <= seq_len:
            raise ValueError(f"sequence {b}: need 0 <= q_len {q_len} <= seq_len {seq_len}")
        blocks = order[next_block : next_block + blocks_per_seq[b]]
        next_block += blocks_per_seq[b]
        block_tables[b, : len(blocks)] = blocks
        if sliding_window is not None:  # positions < horizon are out of every window
            horizon = max(0, seq_len - q_len - sliding_window + 1)
            block_tables[b, : horizon // block_size] = order[-1]
        k = _as_stored(torch.randn(seq_len, n_kv_heads, head_dim, generator=gen), cache_dtype)
        v = _as_stored(torch.randn(seq_len, n_kv_heads, head_dim, generator=gen), cache_dtype)
        pos = torch.arange(seq_len)
        k_cache[blocks[pos // block_size], pos % block_size] = k
        v_cache[blocks[pos // block_size], pos % block_size] = v
        keys, values = keys + [_held(k)], values + [_held(v)]
        starts.append(torch.randn(q_len, n_q_heads, head_dim, generator=gen).to(dtype))
        queries.append(queries[-1] + q_len)
    query = torch.cat(starts) if starts else torch.empty(0, n_q_heads, head_dim, dtype=dtype)
    return PagedBatch(
        query=query.to(device),
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        block_tables=block_tables.to(torch.int32).to(device),
        seq_lens=torch.tensor([s for s, _ in seqs], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(queries, dtype=torch.int32, device=device),
        scale=head_dim**-0.5,
        keys=[k.to(device) for k in keys],
        values=[v.to(device) for v in values],
    )


def _nan_cache(shape: tuple[int, ...], cache_dtype: torch.dtype) -> torch.Tensor:
    """A cache whose every element reads as NaN: q8_0 rows with NaN scales (kv_q8.py)."""
    if cache_dtype != Q8_CACHE_DTYPE:
        return torch.full(shape, float("nan"), dtype=cache_dtype)
    cache = torch.zeros(*shape[:-1], row_width(shape[-1]), dtype=Q8_CACHE_DTYPE)
    cache[..., shape[-1] + 1 :: 2] = 0x7E  # each scale's high byte: fp16 NaN, 0x7e00
    return cache


def _as_stored(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    return quantize_q8_ref(x) if cache_dtype == Q8_CACHE_DTYPE else x.to(cache_dtype)


def _held(stored: torch.Tensor) -> torch.Tensor:
    """The values stored rows hold: q8_0 rows dequantized, others as they are."""
    return dequantize_q8_ref(stored) if stored.dtype == Q8_CACHE_DTYPE else stored


# Byte offsets of the fp16 fields (scales, mins) in one block of each GGUF block type.
_GGUF_HALF_OFFSETS = {
    "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "IQ4_NL": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ4_XS": (0,),
}  # fmt: skip


def random_gguf_rows(
    qtype: int, n: int, k: int, seed: int = 0, scale: float = 0.02
) -> torch.Tensor:
    """``uint8 [N, row_bytes]`` GGUF rows with every quant and sub-block scale bit drawn at
    random and every fp16 field a finite value near ``scale`` (random bytes there could be
    infinities or NaN), so a decoder meets every bit pattern a real file can hold. The float
    types are random normal weights in their own encoding."""
    from pagedserve.kernels.gguf_dequant import gguf_type, row_bytes

    t = gguf_type(qtype)
    gen = torch.Generator().manual_seed(seed)
    if t.name in ("F32", "F16", "BF16"):
        dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[t.name]
        return torch.randn(n, k, generator=gen).to(dtype).view(torch.uint8).reshape(n, -1)
    shape = (n * k // t.block_size, t.block_bytes)
    raw = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    for offset in _GGUF_HALF_OFFSETS[t.name]:
        half = (torch.rand(raw.shape[0], generator=gen) + 0.5) * scale
        raw[:, offset : offset + 2] = half.to(torch.float16).view(torch.uint8).reshape(-1, 2)
    return raw.reshape(n, row_bytes(qtype, k))


def image_key_limits(seqs, images: dict, device="cpu") -> torch.Tensor:
    """Key limits (paged attention's ``key_limits``) for a batch of ``seqs`` ((seq_len, q_len)
    each) whose sequence ``b`` holds images at ``images[b]`` ([first, end) positions): each new
    token's image end inside an image, its own position + 1 elsewhere."""
    limits = []
    for b, (seq_len, q_len) in enumerate(seqs):
        for pos in range(seq_len - q_len, seq_len):
            ends = [end for first, end in images.get(b, []) if first <= pos < end]
            limits.append(ends[0] if ends else pos + 1)
    return torch.tensor(limits, dtype=torch.int32, device=device)


def dense_attention(batch: PagedBatch, limits: torch.Tensor, window: int | None) -> torch.Tensor:
    """An independent reference for paged attention with key limits: per sequence, over its
    contiguous keys in float64, row t sees ``lower <= p < limits[t]`` (``lower``: the window's
    bound, or 0). On the host, in the query's dtype."""
    out = torch.zeros(batch.query.shape, dtype=torch.float64)
    starts, limits = batch.query_start_loc.tolist(), limits.cpu().long()
    for b, (k, v) in enumerate(zip(batch.keys, batch.values, strict=True)):
        q = batch.query[starts[b] : starts[b + 1]].double().cpu()
        group = q.shape[1] // k.shape[1]
        k = k.double().cpu().repeat_interleave(group, 1)
        v = v.double().cpu().repeat_interleave(group, 1)
        pos = torch.arange(k.shape[0] - q.shape[0], k.shape[0])[:, None]
        lower = pos - window + 1 if window else torch.zeros_like(pos)
        p = torch.arange(k.shape[0])[None, :]
        seen = (p >= lower) & (p < limits[starts[b] : starts[b + 1], None])
        scores = torch.einsum("qhd,khd->hqk", q, k) * batch.scale
        probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
        out[starts[b] : starts[b + 1]] = torch.einsum("hqk,khd->qhd", probs, v)
    return out.to(batch.query.dtype)


def e4m3_rounding_inputs(n_random: int = 1 << 20, seed: int = 0) -> torch.Tensor:
    """fp32 values that test a conversion to fp8 e4m3: every finite e4m3 value, every halfway
    point between two neighbours (ties to even) and the fp32 values either side of it, both
    signs; values past 448 (saturated), inf, NaN, zeros; and random fp32 bit patterns."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    positive = values[(values >= 0) & values.isfinite()].unique()  # sorted
    halfway = (positive[:-1] + positive[1:]) / 2
    near = torch.cat([halfway, halfway.nextafter(torch.tensor(0.0)), halfway.nextafter(
        torch.tensor(float("inf"))), positive])  # fmt: skip
    edges = torch.tensor([448.0, 449.0, 464.0, 465.0, 480.0, 1e6, float("inf"), float("nan"),
                          2.0**-10, 2.0**-10 * 1.0001, 2.0**-11, 1e-30, 0.0])  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    random = torch.randint(-(2**31), 2**31, (n_random,), generator=gen, dtype=torch.int64)
    random = random.to(torch.int32).view(torch.float32)
    return torch.cat([near, -near, edges, -edges, random])
