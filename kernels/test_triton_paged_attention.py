"""paged_attention's Triton kernel (varlen and split-KV paths) against paged_attention_ref.

Every batch reads K/V through shuffled, non-contiguous block tables padded with -1, and
every cache slot no sequence owns is NaN, so reading past a sequence fails loudly.
"""

import pytest
import torch
from suite_grid import DEVICE, DTYPES, FULL, pick
from tolerances import assert_close

from pagedserve.kernels.paged_attention import paged_attention_ref, paged_attention_triton
from pagedserve.kernels.testing import make_paged_batch


def batch_case(name: str, bs: int) -> list[tuple[int, int]]:
    """(seq_len, q_len) per sequence; lengths both on and off block boundaries."""
    long = pick(3, 24) * bs
    return {
        "decode": [(2 * bs, 1), (3 * bs + 1, 1), (1, 1), (bs - 1, 1), (long + 5, 1)],
        "chunk": [(3 * bs + 5, 7), (2 * bs, bs), (long, pick(9, 100))],
        "prompt": [(2 * bs, 2 * bs), (bs + 3, bs + 3), (pick(5, long + 3), pick(5, long + 3))],
        "prefix_but_last": [(2 * bs + 1, 1), (3 * bs, 2), (bs + 1, bs)],
        "mixed": [(bs + 2, 1), (2 * bs, 2 * bs), (3 * bs + 1, 6), (1, 1), (long, 1), (bs, bs - 1)],
    }[name]


CASES = ["decode", "chunk", "prompt", "prefix_but_last", "mixed"]
GQA = [(4, 4), (4, 2), (8, 2), (8, 1)]  # (Hq, Hkv): ratios 1, 2, 4, 8 (the last is MQA)
BLOCK_SIZES = [8, 16, 32]


def run(seqs, heads, head_dim, block_size, dtype, splits=None, seed=0):
    batch = make_paged_batch(seqs, *heads, head_dim, block_size, dtype, DEVICE, seed=seed)
    out = paged_attention_triton(*batch.args(), num_kv_splits=splits)
    assert_close(out, paged_attention_ref(*batch.args()), attention=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"gqa{h[0] // h[1]}")
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("case", CASES)
def test_varlen(case, block_size, heads, dtype):
    run(batch_case(case, block_size), heads, pick(32, 128), block_size, dtype)


@pytest.mark.parametrize("head_dim", pick([16, 64, 128, 256], [32, 64, 80, 128, 256]))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_head_dims(head_dim, dtype):
    run(batch_case("mixed", 16), (4, 2), head_dim, 16, dtype, seed=1)


@pytest.mark.parametrize("splits", [2, 3, pick(5, 16)])
@pytest.mark.parametrize("heads", [(4, 4), (8, 1)], ids=["mha", "mqa"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_kv_decode(splits, heads, dtype):
    """Flash-decoding: some splits of the short sequences see no positions at all."""
    seqs = [(pick(70, 3000), 1), (1, 1), (17, 1), (pick(41, 1500), 1)]
    run(seqs, heads, pick(32, 128), 16, dtype, splits=splits, seed=2)


def test_split_kv_is_also_correct_on_non_decode_rows():
    """The split path never assumes q_len == 1; the wrapper merely chooses it for decodes."""
    run(batch_case("mixed", 8), (8, 2), 32, 8, torch.float32, splits=3, seed=3)


@pytest.mark.skipif(DEVICE != "cuda" or not FULL, reason="default split choice needs CUDA")
def test_default_split_choice_on_long_decodes():
    run([(8000, 1), (4000, 1)], (32, 8), 128, 16, torch.bfloat16, seed=4)


def test_padding_rows_and_empty_sequences():
    """Sequences with no new tokens own no rows; rows past the last sequence stay zero."""
    batch = make_paged_batch([(9, 2), (5, 0), (12, 1)], 4, 2, 32, 8, device=DEVICE)
    query = torch.cat([batch.query, torch.randn(2, 4, 32, device=DEVICE)])
    args = (query, *batch.args()[1:])
    out = paged_attention_triton(*args)
    assert_close(out, paged_attention_ref(*args), attention=True)
    assert not out[-2:].any()
