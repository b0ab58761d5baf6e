"""Does numba earn its place in building a step's slot mapping and block-table array?

The numpy layout (pagedserve.blockmgr.slot_mapping, what the engine runs) against the same loops
compiled with numba, on a decode step of 256 sequences of up to 2,048 tokens (block size 16) and
a prefill step of 8 prompts of 256 tokens. Both must first turn the block tables' Python lists
into arrays; that dominates, so numba does not win and the engine keeps numpy. Run

    .venv/bin/python -m pytest tests/blockmgr/test_bench_slot_mapping.py --benchmark-only

(in the plain test run each benchmark is timed a few rounds only; it is not a pass/fail gate).
"""

from __future__ import annotations

import random
from itertools import chain

import numba
import numpy as np
import pytest

from pagedserve.blockmgr.slot_mapping import build_paged_batch

BLOCK_SIZE = 16


@numba.njit(cache=False)
def _layout_loops(flat, lengths, starts, counts, block_size, tables, positions, slots):
    offset, token = 0, 0
    for i in range(lengths.shape[0]):
        for j in range(lengths[i]):
            tables[i, j] = flat[offset + j]
        offset += lengths[i]
        for k in range(counts[i]):
            pos = starts[i] + k
            positions[token] = pos
            slots[token] = tables[i, pos // block_size] * block_size + pos % block_size
            token += 1


def numba_layout(block_tables, num_computed, num_new, block_size):
    lengths = np.fromiter(map(len, block_tables), dtype=np.int64, count=len(block_tables))
    flat = np.fromiter(chain.from_iterable(block_tables), dtype=np.int32, count=int(lengths.sum()))
    starts = np.asarray(num_computed, dtype=np.int64)
    counts = np.asarray(num_new, dtype=np.int64)
    num_tokens = int(counts.sum())
    tables = np.zeros((len(block_tables), int(lengths.max())), dtype=np.int32)
    positions = np.empty(num_tokens, dtype=np.int64)
    slots = np.empty(num_tokens, dtype=np.int64)
    _layout_loops(flat, lengths, starts, counts, block_size, tables, positions, slots)
    return positions, slots, tables


def _decode_step():
    rng = random.Random(0)
    lengths = [rng.randint(1, 2047) for _ in range(256)]
    tables = [rng.sample(range(40000), -(-(n + 1) // BLOCK_SIZE)) for n in lengths]
    return tables, lengths, [1] * len(lengths)


def _prefill_step():
    rng = random.Random(1)
    tables = [rng.sample(range(40000), 256 // BLOCK_SIZE) for _ in range(8)]
    return tables, [0] * 8, [256] * 8


STEPS = {"decode-256x2k": _decode_step, "prefill-8x256": _prefill_step}


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("impl", ["numpy", "numba"])
def test_bench_layout(benchmark, step, impl):
    tables, computed, new = STEPS[step]()
    expected = build_paged_batch(tables, computed, new, BLOCK_SIZE)
    if impl == "numpy":
        run = lambda: build_paged_batch(tables, computed, new, BLOCK_SIZE)  # noqa: E731
    else:
        positions, slots, array = numba_layout(tables, computed, new, BLOCK_SIZE)  # compiles
        assert positions.tolist() == expected.positions.tolist()
        assert slots.tolist() == expected.slot_mapping.tolist()
        assert array.tolist() == expected.block_tables.tolist()
        run = lambda: numba_layout(tables, computed, new, BLOCK_SIZE)  # noqa: E731
    benchmark.group = step
    benchmark.pedantic(run, rounds=30, iterations=1, warmup_rounds=2)
