"""The step layout against a plain per-token loop: positions, slots, block-table rows, lengths."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.blockmgr.slot_mapping import (
    block_table_array,
    build_paged_batch,
    layout_paged_batch,
)


def naive_layout(tables, computed, new, block_size):
    positions, slots, query_start_loc = [], [], [0]
    for table, start, count in zip(tables, computed, new, strict=True):
        for pos in range(start, start + count):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        query_start_loc.append(query_start_loc[-1] + count)
    return positions, slots, query_start_loc


@st.composite
def batches(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    one_each = draw(st.booleans())  # a step of decodes: one new token per sequence
    tables, computed, new = [], [], []
    for _ in range(draw(st.integers(1, 6))):
        start = draw(st.integers(0, 40))
        count = 1 if one_each else draw(st.integers(1, 20))
        num_blocks = -(-(start + count) // block_size) + draw(st.integers(0, 2))
        tables.append(draw(st.lists(st.integers(0, 999), min_size=num_blocks, max_size=num_blocks)))
        computed.append(start)
        new.append(count)
    return tables, computed, new, block_size


@settings(max_examples=150, deadline=None)
@given(batches())
def test_layout_equals_a_per_token_loop(batch):
    tables, computed, new, block_size = batch
    layout = build_paged_batch(tables, computed, new, block_size)
    positions, slots, query_start_loc = naive_layout(tables, computed, new, block_size)
    assert layout.positions.tolist() == positions
    assert layout.slot_mapping.tolist() == slots
    assert layout.query_start_loc.tolist() == query_start_loc
    assert layout.seq_lens.tolist() == [s + n for s, n in zip(computed, new, strict=True)]
    width = max(len(t) for t in tables)
    assert layout.block_tables.tolist() == [t + [0] * (width - len(t)) for t in tables]
    if set(new) == {1}:  # the runner's layout of a step of decodes (counts None) is the same
        starts = np.array(computed, dtype=np.int64)
        one_each = layout_paged_batch(layout.block_tables, starts, None, block_size)
        for field in ("positions", "slot_mapping", "seq_lens", "query_start_loc"):
            got, want = getattr(one_each, field), getattr(layout, field)
            assert got.dtype == want.dtype and got.tolist() == want.tolist()


def test_block_table_array_pads_ragged_rows():
    assert block_table_array([[5], [1, 2, 3], []]).tolist() == [[5, 0, 0], [1, 2, 3], [0, 0, 0]]
    assert block_table_array([[7, 8]]).dtype.name == "int32"
