"""Paged attention with a key limit per query row (``key_limits``: Gemma 3's image tokens see
their whole image, in global and sliding-window layers) against the literal specification,
and the specification against a dense masked attention that knows nothing of paging.

The chunk's image starts in its first query tile and ends past that tile's last row (in the
fp32 tile of 16 tokens and the tensor-core one of 32), so a kernel that walks the KV positions
only up to a tile's own last row misses keys; a whole prompt opens with an image. Every slot
no sequence owns is NaN (make_paged_batch), blocks before a window's horizon too.
"""

import contracts
import pytest
import torch
from suite_grid import DEVICE, DTYPES
from tolerances import assert_close

from pagedserve.kernels.dispatch import taken_as_cuda
from pagedserve.kernels.paged_attention import paged_attention_triton
from pagedserve.kernels.paged_attention_literal import paged_attention_literal
from pagedserve.kernels.testing import (
    PagedBatch,
    dense_attention,
    image_key_limits,
    make_paged_batch,
)

contract = pytest.mark.contract("paged_attention")
BS = 16
# (seq_len, q_len), and the images among the new tokens: [first, end) positions
SEQS = [(50, 1), (75, 40), (24, 24)]
IMAGES = {1: [(38, 68)], 2: [(0, 20)]}
WINDOWS = pytest.mark.parametrize("window", [None, 13], ids=["global", "window13"])


def _batch(window, dtype=torch.float32, heads=(4, 2), head_dim=32, seed=0, seqs=SEQS):
    return make_paged_batch(
        seqs, *heads, head_dim, BS, dtype, DEVICE, seed=seed, sliding_window=window
    )


@WINDOWS
def test_specification_is_dense_masked_attention(window):
    batch, limits = _batch(window), image_key_limits(SEQS, IMAGES, DEVICE)
    spec = paged_attention_literal(*batch.args(), sliding_window=window, key_limits=limits)
    assert_close(spec, dense_attention(batch, limits, window).to(DEVICE), attention=True)
    causal = paged_attention_literal(*batch.args(), sliding_window=window)
    assert_close(
        causal,
        dense_attention(batch, image_key_limits(SEQS, {}), window).to(DEVICE),
        attention=True,
    )


@contract
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@WINDOWS
def test_key_limits(window, dtype):
    batch, limits = _batch(window, dtype, seed=1), image_key_limits(SEQS, IMAGES, DEVICE)
    args = dict(sliding_window=window, key_limits=limits)
    out = contracts.implementation("paged_attention")(*batch.args(), **args)
    assert_close(out, paged_attention_literal(*batch.args(), **args), attention=True)


@contract
@WINDOWS
def test_causal_limits_are_the_same_bits_as_none(window):
    """Limits of ``position + 1`` everywhere: the KEY_LIMITS variant computes what the causal
    one does, bit for bit."""
    contracts.own_wrapper_only("paged_attention")
    batch = _batch(window, seed=2)
    none = paged_attention_triton(*batch.args(), sliding_window=window)
    causal = image_key_limits(SEQS, {}, DEVICE)
    out = paged_attention_triton(*batch.args(), sliding_window=window, key_limits=causal)
    assert torch.equal(out, none)


@contract
@WINDOWS
def test_tensor_core_branch_in_fp16(window):
    """The fp16 tensor-core branch a GPU takes (32-token query tiles at this group), capped."""
    contracts.own_wrapper_only("paged_attention")
    batch = _batch(window, torch.float16, heads=(8, 4), head_dim=64, seed=3)
    args = dict(
        sliding_window=window,
        logits_soft_cap=30.0,
        key_limits=image_key_limits(SEQS, IMAGES, DEVICE),
    )
    with taken_as_cuda(multi_processor_count=16):
        out = paged_attention_triton(*batch.args(), **args)
    assert_close(out, paged_attention_literal(*batch.args(), **args), attention=True)


@contract
def test_split_kv_decode_rows():
    """Forced KV splits of a decode batch (each row's limit is its sequence's end) beside the
    KEY_LIMITS walk's end, which every split clips to."""
    contracts.own_wrapper_only("paged_attention")
    seqs = [(70, 1), (5, 1), (33, 1)]
    batch, limits = _batch(None, seqs=seqs, seed=4), image_key_limits(seqs, {}, DEVICE)
    out = paged_attention_triton(*batch.args(), num_kv_splits=3, key_limits=limits)
    assert_close(out, paged_attention_literal(*batch.args(), key_limits=limits), attention=True)


# Batch invariance: a chunk across the first fixed split (512 positions) with an image, a prompt
# that opens with one and a decode long enough for split programs.
INVARIANT_SEQS = [(530, 14), (40, 40), (600, 1)]
INVARIANT_IMAGES = {0: [(520, 527)], 1: [(5, 25)]}


def _alone(batch: PagedBatch, b: int, cached: int, limits: torch.Tensor):
    """Sequence b's positions from ``cached`` on, the only sequence of a step."""
    seq_len, end = int(batch.seq_lens[b]), int(batch.query_start_loc[b + 1])
    rows = slice(end - (seq_len - cached), end)
    step = PagedBatch(
        batch.query[rows], batch.k_cache, batch.v_cache, batch.block_tables[b : b + 1],
        batch.seq_lens[b : b + 1],
        torch.tensor([0, seq_len - cached], dtype=torch.int32, device=DEVICE), batch.scale, [], [],
    )  # fmt: skip
    return step, limits[rows].clone(), rows


@contract
@pytest.mark.parametrize("window", [None, 17], ids=["global", "window17"])
def test_batch_invariant_rows_are_the_same_bits_in_any_step(window):
    contracts.own_wrapper_only("paged_attention")
    batch = _batch(window, seqs=INVARIANT_SEQS, seed=5)
    limits = image_key_limits(INVARIANT_SEQS, INVARIANT_IMAGES, DEVICE)
    args = dict(sliding_window=window, batch_invariant=True)
    whole = paged_attention_triton(*batch.args(), key_limits=limits, **args)
    expected = paged_attention_literal(*batch.args(), sliding_window=window, key_limits=limits)
    assert_close(whole, expected, attention=True)
    for b, cached, splits in [(0, 516, None), (0, 520, None), (1, 0, None), (2, 599, 2)]:
        step, step_limits, rows = _alone(batch, b, cached, limits)
        out = paged_attention_triton(
            *step.args(), key_limits=step_limits, num_kv_splits=splits, **args
        )
        assert torch.equal(out, whole[rows]), (b, cached, splits)
