"""A step's paged batch layout: positions, slot mapping and the block-table array.

The scheduler hands each scheduled sequence's block table (a list of block ids), how many of its
tokens are already in the cache and how many it runs now. The model needs, for the flat varlen
batch of new tokens, each token's position and cache slot
(``slot = block_table[pos // block_size] * block_size + pos % block_size``), and per sequence
its row of the block-table array, its length in the cache after the step and where its tokens
start in the flat batch.

Plain numpy, vectorised over tokens and sequences. A numba version of the same loops was
measured against this one (tests/blockmgr/test_bench_slot_mapping.py) and does not win: the
time goes into turning the block tables' Python lists into one array, which both must do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np


@dataclass
class PagedBatch:
    """Host arrays of one step; B sequences, T new tokens."""

    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    block_tables: np.ndarray  # [B, max_blocks] int32, rows padded with 0
    seq_lens: np.ndarray  # [B] int32: tokens in the cache after the step, new ones included
    query_start_loc: np.ndarray  # [B + 1] int32


def build_paged_batch(
    block_tables: Sequence[Sequence[int]],
    num_computed_tokens: Sequence[int],
    num_new_tokens: Sequence[int],
    block_size: int,
) -> PagedBatch:
    """Lay out one step. Every table must cover its sequence's computed and new tokens."""
    return layout_paged_batch(
        block_table_array(block_tables),
        np.asarray(num_computed_tokens, dtype=np.int64),
        np.asarray(num_new_tokens, dtype=np.int64),
        block_size,
    )


def layout_paged_batch(
    table_array: np.ndarray, starts: np.ndarray, counts: np.ndarray | None, block_size: int
) -> PagedBatch:
    """Lay out one step from its block-table array (``[B, max_blocks]`` int32; a model runner
    keeps one across steps), each sequence's computed count and its new tokens' count (int64;
    None when every sequence runs one token, as in a step of decodes: token i is then sequence
    i's, and the layout takes a handful of numpy calls, the fewest a busy server's step makes)."""
    num_seqs = len(starts)
    if counts is None:
        query_start_loc = np.arange(num_seqs + 1, dtype=np.int32)
        seq_index, positions, seq_lens = np.arange(num_seqs), starts, starts + 1
    else:
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int32)
        np.cumsum(counts, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        seq_index = np.repeat(np.arange(num_seqs), counts)
        positions = starts[seq_index] + (
            np.arange(num_tokens, dtype=np.int64) - query_start_loc[:-1][seq_index]
        )
        seq_lens = starts + counts
    slot_mapping = (
        table_array[seq_index, positions // block_size].astype(np.int64) * block_size
        + positions % block_size
    )
    return PagedBatch(
        positions=positions,
        slot_mapping=slot_mapping,
        block_tables=table_array,
        seq_lens=seq_lens.astype(np.int32),
        query_start_loc=query_start_loc,
    )


def block_table_array(block_tables: Sequence[Sequence[int]]) -> np.ndarray:
    """Stack ragged block tables into one ``[B, max_blocks]`` int32 array, padded with 0.

    One pass over all ids (``fromiter``), then one masked store: row-major mask order is the
    tables' concatenation order.
    """
    lengths = np.fromiter(map(len, block_tables), dtype=np.int64, count=len(block_tables))
    total = int(lengths.sum())
    flat = np.fromiter(chain.from_iterable(block_tables), dtype=np.int32, count=total)
    width = int(lengths.max()) if len(block_tables) else 0
    array = np.zeros((len(block_tables), width), dtype=np.int32)
    array[np.arange(width) < lengths[:, None]] = flat
    return array
