"""kv_splits.py's reduce kernels against ``merge_kv_splits_ref``: the flash-decoding merge
and the batch-invariant in-order fold (with and without attention sinks), including splits
that saw nothing (lse -inf, their partials garbage) and a row whose splits all saw nothing."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.kv_splits import merge_kv_splits, merge_kv_splits_ref


@pytest.mark.parametrize("in_order", [False, True])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_merge_equals_its_reference(in_order, with_sinks):
    torch.manual_seed(0)
    tokens, heads, splits, head_dim = 3, 4, 5, 24
    partial = torch.randn(tokens, heads, splits, head_dim)
    lse = torch.randn(tokens, heads, splits) * 4
    lse[0, 1, 2:] = float("-inf")  # the row's later splits saw nothing
    partial[0, 1, 2:] = float("nan")  # ... and hold garbage, which must be dropped
    lse[2, 3, :] = float("-inf")  # a row that saw nothing at all
    sinks = torch.randn(heads) if with_sinks else None
    out = torch.empty(tokens, heads, head_dim)
    merge_kv_splits(partial, lse, out, in_order=in_order, sinks=sinks)
    want = torch.empty_like(out)
    merge_kv_splits_ref(partial, lse, want, in_order=in_order, sinks=sinks)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
