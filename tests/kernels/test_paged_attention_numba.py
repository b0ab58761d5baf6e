"""The numba CPU paged attention against the PyTorch reference, over the kernel suite's grid.

The reference (itself held to a naive float64 attention in test_paged_attention_ref.py) reads
each sequence through a gather; the numba kernel reads K and V through the block table in
place, tile by tile, with an online softmax. Every batch comes from make_paged_batch:
shuffled block tables, padding entries, NaN in every slot no sequence owns. Lengths cross
TILE_N (32 positions) and PREFILL_TILE_Q (8 tokens) boundaries so that the online softmax
folds several tiles and a long chunk is split into several parallel work items.

numba follows torch's thread count (tests/conftest.py keeps torch to 1-2 threads), bounded by
NUMBA_NUM_THREADS.
"""

import numba
import numpy as np
import pytest
import torch

from pagedserve.kernels import paged_attention, paged_attention_ref
from pagedserve.kernels.cpu import paged_attention as pan
from pagedserve.kernels.cpu.half import to_float32
from pagedserve.kernels.cpu.paged_attention import (
    paged_attention_cpu,
    paged_attention_numba,
    warm_up,
)
from pagedserve.kernels.cpu.paged_attention_plan import step_plan
from pagedserve.kernels.testing import make_paged_batch

TOLERANCES = {  # CONVENTIONS.md: attention fp32 atol 1e-4; fp16 and bf16 as for any kernel
    torch.float32: (1e-4, 1.3e-6),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1e-2, 1.6e-2),
}

CASES = {
    "decode": [(1, 1), (17, 1), (33, 1), (100, 1)],
    "prompt": [(45, 45)],
    "prompt_block_multiple": [(32, 32)],
    "chunk_over_cached_prefix": [(70, 20)],
    "prefix_all_but_one": [(64, 1), (41, 2)],
    "mixed": [(9, 1), (12, 12), (30, 5), (1, 1), (77, 1), (8, 3), (50, 0), (40, 17)],
}
HEADS = {  # (Hq, Hkv): GQA ratios 1, 3 (SmolLM2's 9/3), 4, 8 (MQA)
    "mha": (4, 4),
    "smollm2": (9, 3),
    "gqa4": (8, 2),
    "mqa": (8, 1),
}


def assert_matches_reference(batch, out=None):
    expected = paged_attention_ref(*batch.args())
    out = paged_attention_numba(*batch.args()) if out is None else out
    assert out.dtype == batch.query.dtype
    assert not out.isnan().any(), "NaN in the numba kernel's output"
    atol, rtol = TOLERANCES[batch.query.dtype]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_matches_reference_fp32(case, heads, head_dim, block_size):
    batch = make_paged_batch(CASES[case], *HEADS[heads], head_dim, block_size, seed=3)
    assert_matches_reference(batch)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", ["decode", "chunk_over_cached_prefix", "mixed"])
@pytest.mark.parametrize("heads", ["smollm2", "mqa"])
def test_matches_reference_half_caches(dtype, case, heads):
    batch = make_paged_batch(CASES[case], *HEADS[heads], 64, 16, dtype=dtype, seed=4)
    assert_matches_reference(batch)


@pytest.mark.parametrize("pad_value", [-1, 0, 10**6])
def test_block_table_padding_and_stale_slots_are_never_read(pad_value):
    batch = make_paged_batch([(9, 1), (6, 6), (13, 4), (40, 1)], 9, 3, 64, 8, pad_value=pad_value)
    assert_matches_reference(batch)


def _plan(q_lens, seq_lens, max_q_len=None, num_kv_splits=None):
    """The step plan of a layout given by each sequence's new tokens and length."""
    starts = torch.tensor([0, *np.cumsum(q_lens).tolist()], dtype=torch.int32)
    tables = torch.zeros(len(q_lens), 64, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return step_plan(tables, lens, starts, max_q_len, num_kv_splits)


def test_long_prefill_is_split_into_parallel_tiles():
    plan = _plan([1, 20, 0], [50, 30, 7], num_kv_splits=1)
    # 1 decode tile + ceil(20 / 8) = 3 chunk tiles, none for the sequence without new tokens;
    # (seq, q0, q1, kv_lo, kv_hi, partial slot), most KV positions first, none split
    assert plan.work.tolist() == [
        [0, 0, 1, 0, 50, -1], [1, 16, 20, 0, 30, -1], [1, 8, 16, 0, 26, -1],
        [1, 0, 8, 0, 18, -1],
    ]  # fmt: skip
    assert len(plan.merges) == 0 and plan.long_seqs == ()
    short = _plan([1, 20, 0], [50, 30, 7], max_q_len=15)
    assert short.work.tolist() == [[0, 0, 1, 0, 50, -1]]
    assert short.long_seqs == ((1, 1, 21),)  # left to the caller (SDPA)


def test_a_single_long_decode_is_split_over_the_kv_axis(monkeypatch):
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs two numba threads")
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # too few tiles for two threads: split into 3 KV ranges
        assert _plan([1], [1000]).merges.tolist() == [[0, 0, 3]]
        assert len(_plan([1, 1, 1, 1], [1000, 999, 998, 997]).merges) == 0  # enough tiles
        torch.set_num_threads(1)
        assert len(_plan([1], [1000]).merges) == 0  # one thread: nothing to share out
    finally:
        torch.set_num_threads(saved)
    plan = _plan([1, 1], [600, 100], num_kv_splits=3)
    # 600 positions in 3 ranges of whole 32-position tiles; the 100-token decode is not split
    assert sorted(plan.work.tolist()) == [
        [0, 0, 1, 0, 224, 0], [0, 0, 1, 224, 448, 1], [0, 0, 1, 448, 600, 2],
        [1, 0, 1, 0, 100, -1],
    ]  # fmt: skip
    assert plan.merges.tolist() == [[0, 0, 3]]


@pytest.mark.parametrize("splits", [2, 3, 7])
@pytest.mark.parametrize("heads", ["smollm2", "mqa"])
def test_kv_splits_match_reference(splits, heads):
    seqs = [(600, 1), (517, 1), (30, 1), (700, 5), (1000, 1)]
    batch = make_paged_batch(seqs, *HEADS[heads], 64, 16, seed=5)
    assert_matches_reference(batch, paged_attention_numba(*batch.args(), num_kv_splits=splits))


def test_max_q_len_leaves_longer_sequences_to_the_caller():
    batch = make_paged_batch([(30, 1), (40, 16), (20, 15)], 9, 3, 64, 16)
    out = paged_attention_numba(*batch.args(), max_q_len=15)
    expected = paged_attention_ref(*batch.args())
    torch.testing.assert_close(out[:1], expected[:1], atol=1e-4, rtol=1.3e-6)
    assert (out[1:17] == 0).all()
    torch.testing.assert_close(out[17:], expected[17:], atol=1e-4, rtol=1.3e-6)


@pytest.mark.parametrize("heads", ["smollm2", "mha"])
def test_cpu_path_splits_decode_and_prefill_and_matches_reference(heads):
    """numba rows (q_len <= 15) and SDPA rows (longer) in one batch, over cached prefixes."""
    seqs = [(300, 1), (64, 64), (90, 15), (120, 16), (5, 1), (200, 40)]
    batch = make_paged_batch(seqs, *HEADS[heads], 64, 16)
    assert_matches_reference(batch, paged_attention_cpu(*batch.args()))


def test_public_function_takes_the_numba_path_on_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("PAGEDSERVE_KERNELS", raising=False)
    batch = make_paged_batch([(10, 1), (60, 20)], 9, 3, 64, 16)
    assert torch.equal(paged_attention(*batch.args()), paged_attention_cpu(*batch.args()))
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "numba")
    assert torch.equal(paged_attention(*batch.args()), paged_attention_cpu(*batch.args()))


@numba.njit(cache=False)
def _widen(bits, out):
    for i in range(bits.shape[0]):
        out[i] = to_float32(bits[i])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_patterns_widen_exactly(dtype):
    """Every one of the 65,536 bit patterns, subnormals, infinities and NaNs included."""
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    out = np.empty(patterns.numel(), np.float32)
    _widen(pan.cache_as_numpy(patterns), out)
    expected = patterns.float()
    got = torch.from_numpy(out)
    assert torch.equal(got.isnan(), expected.isnan())
    finite = ~expected.isnan()
    assert torch.equal(got[finite], expected[finite])
    assert torch.equal(got[finite].signbit(), expected[finite].signbit())  # -0.0 stays -0.0


def test_threads_follow_torch(monkeypatch):
    batch = make_paged_batch([(20, 1)], 4, 2, 64, 16)
    paged_attention_numba(*batch.args())
    expected = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    assert numba.get_num_threads() == expected


def test_warm_up_compiles_every_cache_dtype():
    """The compiled launch is the entry point (the kernels behind it are compiled into it, and
    when it comes from numba's disk cache their own dispatchers never see a call)."""
    warm_up((torch.float32, torch.float16, torch.bfloat16))
    assert len(pan.launch_attention.signatures) >= 3


def test_rejects_unsupported_inputs():
    batch = make_paged_batch([(20, 1)], 4, 2, 64, 16)
    args = list(batch.args())
    args[1] = batch.k_cache.double()
    with pytest.raises(ValueError, match="dtype"):
        paged_attention_numba(*args)
    args[1] = batch.k_cache.transpose(0, 1).contiguous().transpose(0, 1)
    with pytest.raises(ValueError, match="contiguous"):
        paged_attention_numba(*args)
