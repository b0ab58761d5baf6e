"""Paged attention with a key limit per query row (``key_limits``: Gemma 3's image tokens see
their whole image) on the CPU's paths, against a dense masked attention written here.

The batch mixes a decode, a prefill chunk over a cached prefix with an image inside it (its
first rows' tiles reach past their own last row), a short chunk with an image (numba's work
items beside SDPA's) and a whole prompt that opens with an image, under GQA; with a sliding
window and without. Every slot no sequence owns is NaN (make_paged_batch).
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import paged_attention, paged_attention_ref
from pagedserve.kernels.cpu.paged_attention import paged_attention_cpu, paged_attention_numba
from pagedserve.kernels.testing import (
    PagedBatch,
    dense_attention,
    image_key_limits,
    make_paged_batch,
)

BS = 8
# (seq_len, q_len) and the images among the new tokens: [first, end) positions.
SEQS = [(37, 1), (70, 40), (25, 12), (16, 16), (600, 1)]
IMAGES = {1: [(38, 58)], 2: [(15, 22)], 3: [(0, 10)]}
HEADS = (6, 2)  # GQA, 3 query heads a KV head


def _batch(window: int | None, seed: int = 0, dtype=torch.float32) -> PagedBatch:
    return make_paged_batch(SEQS, *HEADS, 16, BS, dtype, seed=seed, sliding_window=window)


def _close(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1.3e-6)


WINDOWS = pytest.mark.parametrize("window", [None, 12], ids=["global", "window12"])


@WINDOWS
def test_reference_is_dense_masked_attention(window):
    batch, limits = _batch(window), image_key_limits(SEQS, IMAGES)
    out = paged_attention_ref(*batch.args(), sliding_window=window, key_limits=limits)
    _close(out, dense_attention(batch, limits, window))
    causal = paged_attention_ref(*batch.args(), sliding_window=window)
    assert not torch.allclose(out, causal)  # the images changed their rows


@WINDOWS
def test_causal_limits_are_the_none_path(window):
    """Limits of ``position + 1`` everywhere are causal: within tolerance on the reference
    (SDPA with a mask instead of its causal flag), the same bits on numba's path."""
    batch, causal = _batch(window, seed=1), image_key_limits(SEQS, {})
    args = dict(sliding_window=window)
    none = paged_attention_ref(*batch.args(), **args)
    _close(paged_attention_ref(*batch.args(), key_limits=causal, **args), none)
    _close(none, dense_attention(batch, causal, window))
    numba_none = paged_attention_numba(*batch.args(), **args)
    assert torch.equal(paged_attention_numba(*batch.args(), key_limits=causal, **args), numba_none)


CPU_PATHS = {
    "numba": paged_attention_numba,
    "numba+sdpa": paged_attention_cpu,  # the chunk of 40 goes to SDPA, the one of 12 to numba
    "numba-splits": lambda *a, **kw: paged_attention_numba(*a, num_kv_splits=3, **kw),
    "numba-batch-invariant": lambda *a, **kw: paged_attention_numba(*a, batch_invariant=True, **kw),
}


@WINDOWS
@pytest.mark.parametrize("path", list(CPU_PATHS))
def test_cpu_paths_match_the_reference(path, window):
    batch, limits = _batch(window, seed=2), image_key_limits(SEQS, IMAGES)
    args = dict(sliding_window=window, key_limits=limits)
    out = CPU_PATHS[path](*batch.args(), **args)
    _close(out, paged_attention_ref(*batch.args(), **args))


@pytest.mark.parametrize("forced", ["ref", "numba"])
def test_public_dispatch_passes_the_limits(monkeypatch, forced):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("PAGEDSERVE_KERNELS", forced)
    batch, limits = _batch(12, seed=3, dtype=torch.float16), image_key_limits(SEQS, IMAGES)
    out = paged_attention(*batch.args(), sliding_window=12, key_limits=limits)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, dense_attention(batch, limits, 12), atol=1e-3, rtol=1e-3)


def _alone(batch: PagedBatch, b: int, cached: int, limits: torch.Tensor) -> tuple:
    """Sequence b's positions from ``cached`` on as the only sequence of a step, and its
    rows' limits; the same cache and block table."""
    seq_len = int(batch.seq_lens[b])
    first = int(batch.query_start_loc[b + 1]) - (seq_len - cached)
    rows = slice(first, int(batch.query_start_loc[b + 1]))
    args = (
        batch.query[rows], batch.k_cache, batch.v_cache, batch.block_tables[b : b + 1],
        batch.seq_lens[b : b + 1], torch.tensor([0, seq_len - cached], dtype=torch.int32),
        batch.scale,
    )  # fmt: skip
    return args, limits[rows].clone(), rows


@WINDOWS
def test_batch_invariant_rows_are_the_same_bits_in_any_step(window):
    """The chunk's rows (the image's among them) alone, and from the image's first token on
    (a later chunk), against the same rows in the whole batch."""
    batch, limits = _batch(window, seed=4), image_key_limits(SEQS, IMAGES)
    args = dict(sliding_window=window, batch_invariant=True)
    whole = paged_attention_numba(*batch.args(), key_limits=limits, **args)
    for b, cached in [(1, 30), (1, 38), (2, 15), (3, 0)]:
        step, step_limits, rows = _alone(batch, b, cached, limits)
        out = paged_attention_numba(*step, key_limits=step_limits, **args)
        assert torch.equal(out, whole[rows]), (b, cached)


BAD_LIMITS = {
    "int64": lambda t: torch.ones(t, dtype=torch.int64),
    "too short": lambda t: torch.ones(t - 1, dtype=torch.int32),
    "2-d": lambda t: torch.ones(t, 1, dtype=torch.int32),
    "other device": lambda t: torch.ones(t, dtype=torch.int32, device="meta"),
    "a list": lambda t: [1] * t,
}


@pytest.mark.parametrize("bad", list(BAD_LIMITS))
@pytest.mark.parametrize("path", ["ref", "numba", "public"])
def test_wrong_key_limits_are_refused(path, bad):
    batch = make_paged_batch([(9, 1), (12, 5)], 4, 2, 16, BS)
    fn = {"ref": paged_attention_ref, "numba": paged_attention_cpu, "public": paged_attention}
    with pytest.raises(ValueError, match="key_limits must be int32"):
        fn[path](*batch.args(), key_limits=BAD_LIMITS[bad](batch.query.shape[0]))
