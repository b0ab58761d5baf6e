"""AttentionMetadata.decode_split: which sequences of a step decode and which run more, read
from the host copies the runner provides (or, for metadata built by hand, the device's)."""

from __future__ import annotations

import torch

from pagedserve.models import AttentionMetadata


def _meta(q_lens: list[int], seq_lens: list[int], host: bool) -> AttentionMetadata:
    starts = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.zeros(int(starts[-1]), dtype=torch.int64),
        block_tables=torch.zeros(len(q_lens), 4, dtype=torch.int32),
        seq_lens=lens,
        query_start_loc=starts,
        query_start_loc_cpu=starts.clone() if host else None,
        seq_lens_cpu=lens.clone() if host else None,
    )


def test_a_mixed_step_splits_decodes_from_prefills():
    for host in (True, False):
        split = _meta([1, 5, 1, 3, 1], [9, 5, 30, 12, 2], host).decode_split
        assert split.num_decodes == 3
        assert split.decode_seqs.tolist() == [0, 2, 4]
        assert split.decode_rows.tolist() == [0, 6, 10]
        assert split.prefills == [(1, 1, 6, 5), (3, 7, 10, 12)]


def test_a_pure_decode_step_needs_no_index():
    meta = _meta([1, 1, 1], [4, 7, 1], host=True)
    split = meta.decode_split
    assert (split.num_decodes, split.decode_seqs, split.decode_rows) == (3, None, None)
    assert split.prefills == []
    assert meta.decode_split is split  # worked out once per step, whatever reads it


def test_a_prefill_only_step_has_no_decodes():
    split = _meta([4, 2], [4, 9], host=True).decode_split
    assert split.num_decodes == 0 and split.decode_seqs.numel() == 0
    assert split.prefills == [(0, 0, 4, 4), (1, 4, 6, 9)]
