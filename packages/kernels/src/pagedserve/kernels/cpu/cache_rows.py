"""One head's key or value row of the KV cache in numba-compiled code, whatever the cache holds.

The paged attention's tiles (cpu/paged_attention_tile.py) dot query rows with K rows and add
probability-weighted V rows; the KV store (cpu/layer_ops.py) writes new rows. A row is ``D``
elements of fp32, fp16 or bf16 bits, or fp8 bytes (each widened or narrowed on its own:
cpu/half.py), or a q8_0 row (kv_q8.py): ``D`` int8 elements in groups of 32, then each
group's fp16 scale. Each function here is an overload on the row's numba type, so a float
cache compiles exactly the element loop it always had, and a q8_0 row works a group at a
time: the dot sums a group's ``q * k`` and scales the sum once, the weighted add scales a
group's weight once.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.extending import overload

from pagedserve.kernels.cpu import numba_cache  # noqa: F401  (before any cached @njit)
from pagedserve.kernels.cpu.half import float32_to_fp16_bits, to_cache_element, to_float32

GROUP = 32  # kv_q8.GROUP


def dot_row(q, r, key, head_dim):  # pragma: no cover - compiled
    """``q[r] . key``: a query row (fp32) and a cached K row of ``head_dim`` elements."""
    raise NotImplementedError("only callable from numba-compiled code")


def add_weighted_row(acc, r, weight, value, head_dim):  # pragma: no cover - compiled
    """``acc[r] += weight * value``: a cached V row into an fp32 accumulator row."""
    raise NotImplementedError("only callable from numba-compiled code")


def add_four_rows(acc, r, w0, w1, w2, w3, v0, v1, v2, v3, head_dim):  # pragma: no cover
    """``acc[r] += (w0 * v0 + w1 * v1) + (w2 * v2 + w3 * v3)``: four V rows in one pass."""
    raise NotImplementedError("only callable from numba-compiled code")


def write_row(out, x, cache):  # pragma: no cover - compiled
    """fp32 ``x [D]`` into a cache row ``out`` as ``cache`` stores it."""
    raise NotImplementedError("only callable from numba-compiled code")


def _is_q8(row) -> bool:
    return isinstance(row, types.Array) and row.dtype == types.int8


@numba.njit(inline="always")
def _scale(row, head_dim, g):  # pragma: no cover - compiled
    """Group ``g``'s scale: the fp16 after the row's elements, two bytes little-endian."""
    low = np.uint16(np.uint8(row[head_dim + 2 * g]))
    high = np.uint16(np.uint8(row[head_dim + 2 * g + 1]))
    return to_float32(np.uint16(low | (high << np.uint16(8))))


@overload(dot_row, inline="always")
def _dot_row_impl(q, r, key, head_dim):
    if not _is_q8(key):

        def dot(q, r, key, head_dim):
            total = np.float32(0.0)
            for d in range(head_dim):
                total += q[r, d] * to_float32(key[d])
            return total

        return dot

    def dot_q8(q, r, key, head_dim):
        total = np.float32(0.0)
        for g in range(head_dim // GROUP):
            part = np.float32(0.0)
            for d in range(g * GROUP, g * GROUP + GROUP):
                part += q[r, d] * np.float32(key[d])
            total += part * _scale(key, head_dim, g)
        return total

    return dot_q8


@overload(add_weighted_row, inline="always")
def _add_weighted_row_impl(acc, r, weight, value, head_dim):
    if not _is_q8(value):

        def add(acc, r, weight, value, head_dim):
            for d in range(head_dim):
                acc[r, d] += weight * to_float32(value[d])

        return add

    def add_q8(acc, r, weight, value, head_dim):
        for g in range(head_dim // GROUP):
            scaled = weight * _scale(value, head_dim, g)
            for d in range(g * GROUP, g * GROUP + GROUP):
                acc[r, d] += scaled * np.float32(value[d])

    return add_q8


@overload(add_four_rows, inline="always")
def _add_four_rows_impl(acc, r, w0, w1, w2, w3, v0, v1, v2, v3, head_dim):
    if not _is_q8(v0):

        def add(acc, r, w0, w1, w2, w3, v0, v1, v2, v3, head_dim):
            for d in range(head_dim):
                acc[r, d] += (w0 * to_float32(v0[d]) + w1 * to_float32(v1[d])) + (
                    w2 * to_float32(v2[d]) + w3 * to_float32(v3[d])
                )

        return add

    def add_q8(acc, r, w0, w1, w2, w3, v0, v1, v2, v3, head_dim):
        for g in range(head_dim // GROUP):
            s0, s1 = w0 * _scale(v0, head_dim, g), w1 * _scale(v1, head_dim, g)
            s2, s3 = w2 * _scale(v2, head_dim, g), w3 * _scale(v3, head_dim, g)
            for d in range(g * GROUP, g * GROUP + GROUP):
                acc[r, d] += (s0 * np.float32(v0[d]) + s1 * np.float32(v1[d])) + (
                    s2 * np.float32(v2[d]) + s3 * np.float32(v3[d])
                )

    return add_q8


@overload(write_row, inline="always")
def _write_row_impl(out, x, cache):
    if not _is_q8(out):

        def write(out, x, cache):
            for d in range(x.shape[0]):
                out[d] = to_cache_element(x[d], cache)

        return write

    return lambda out, x, cache: _quantize_q8_row(out, x)


@numba.njit(cache=True)
def _quantize_q8_row(out, x):  # pragma: no cover - compiled
    """kv_q8.quantize_rows, operation for operation (the same bytes). A function of its own,
    not inlined: numba's inliner trips over the loops' reassigned locals."""
    head_dim = x.shape[0]
    for g in range(head_dim // GROUP):
        amax = np.float32(0.0)
        for d in range(g * GROUP, g * GROUP + GROUP):
            amax = max(amax, abs(x[d]))
        scale = amax / np.float32(127.0)
        inverse = np.float32(0.0)
        if scale > 0:
            inverse = np.float32(1.0) / scale
        for d in range(g * GROUP, g * GROUP + GROUP):
            scaled = x[d] * inverse
            magnitude = abs(scaled)  # rounded half away from zero, exactly (ggml's roundf)
            whole = np.floor(magnitude)
            rounded = whole + np.floor(np.float32(2.0) * (magnitude - whole))
            out[d] = np.int8(-rounded if scaled < 0 else rounded)
        bits = float32_to_fp16_bits(scale)
        out[head_dim + 2 * g] = np.int8(np.uint8(bits & np.uint16(0xFF)))
        out[head_dim + 2 * g + 1] = np.int8(np.uint8(bits >> np.uint16(8)))
