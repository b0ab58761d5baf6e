"""One head's key or value row of the KV cache in numba-compiled code, whatever the cache holds.

The paged attention's tiles (cpu/paged_attention_tile.py) dot query rows with K rows and add
probability-weighted V rows; the KV store (cpu/layer_ops.py) writes new rows. A row is ``D``
elements of fp32, fp16 or bf16 bits, or fp8 bytes (each widened or narrowed on its own as it
is read or written: cpu/half.py), or a q8_0 row (kv_q8.py): ``D`` int8 elements in groups of
32, then each group's fp16 scale. Each function here is an overload on the row's numba type,
so a float cache compiles exactly the loops it always had. A q8_0 row is widened once into a
scratch row (each group's elements times its scale) and read from there by every query head
of its group and every new token of the tile. Read group by group in each head's dot instead
(a sum and a scale per group), the decode attention took 2.6x, 3.7x and 1.8x fp32's time at 1,
16 and 64 sequences; widened once, 1.8-2.0x, 2.0-2.3x and 1.1-1.2x (2-core AMD EPYC VM,
quiet; not measured on the Intel VM or beside a busy neighbour: docs/cpu.md).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.extending import overload

from pagedserve.kernels.cpu import numba_cache  # noqa: F401  (before any cached @njit)
from pagedserve.kernels.cpu.half import float32_to_fp16_bits, to_cache_element, to_float32

GROUP = 32  # kv_q8.GROUP


def scratch(cache, rows, head_dim):  # pragma: no cover - compiled
    """Room for ``rows`` widened rows of ``cache``: a q8_0 cache's rows are widened once per
    position and KV head, then read by the whole group of query heads; other caches need none
    (their rows are read in place, element by element)."""
    raise NotImplementedError("only callable from numba-compiled code")


def as_float_rows(rows, room, head_dim):  # pragma: no cover - compiled
    """One position's cached K or V rows ``[Hkv, W]`` as the dots read them: the rows
    themselves (each element widened as it is read: cpu/half.py ``to_float32``), or q8_0 rows
    widened into ``room[:Hkv]`` (``q * d``, exact in fp32) and those returned."""
    raise NotImplementedError("only callable from numba-compiled code")


def write_row(out, x, cache):  # pragma: no cover - compiled
    """fp32 ``x [D]`` into a cache row ``out`` as ``cache`` stores it."""
    raise NotImplementedError("only callable from numba-compiled code")


_NO_ROOM = np.empty((0, 0), np.float32)


def _is_q8(row) -> bool:
    return isinstance(row, types.Array) and row.dtype == types.int8


@numba.njit(inline="always")
def _scale(row, head_dim, g):  # pragma: no cover - compiled
    """Group ``g``'s scale: the fp16 after the row's elements, two bytes little-endian."""
    low = np.uint16(np.uint8(row[head_dim + 2 * g]))
    high = np.uint16(np.uint8(row[head_dim + 2 * g + 1]))
    return to_float32(np.uint16(low | (high << np.uint16(8))))


@overload(scratch, inline="always")
def _scratch_impl(cache, rows, head_dim):
    if _is_q8(cache):
        return lambda cache, rows, head_dim: np.empty((rows, head_dim), np.float32)
    return lambda cache, rows, head_dim: _NO_ROOM


@overload(as_float_rows, inline="always")
def _as_float_rows_impl(rows, room, head_dim):
    if not _is_q8(rows):
        return lambda rows, room, head_dim: rows

    def widen(rows, room, head_dim):
        for h in range(rows.shape[0]):
            row, out = rows[h], room[h]
            for g in range(head_dim // GROUP):
                scale = _scale(row, head_dim, g)
                for d in range(g * GROUP, g * GROUP + GROUP):
                    out[d] = np.float32(row[d]) * scale
        return room[: rows.shape[0]]

    return widen


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
    """kv_q8.quantize_q8_ref, operation for operation (the same bytes). A function of its own,
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
