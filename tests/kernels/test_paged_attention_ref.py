"""paged_attention_ref and paged_attention_literal against a naive attention that knows nothing
about paging.

The naive side reads each sequence's contiguous keys/values and computes, one new token at
a time in float64, softmax(q.k * scale) over the positions <= the token's own. The paged
sides read the same tokens through shuffled block tables, with NaN in every unowned slot.
(The kernel suite holds the Triton kernel and the reference to the spec; this holds the spec,
and the reference independently, to the plain definition.)
"""

import pytest
import torch

from pagedserve.kernels import paged_attention, paged_attention_ref
from pagedserve.kernels.paged_attention_literal import paged_attention_literal
from pagedserve.kernels.testing import make_paged_batch


def naive_attention(batch) -> torch.Tensor:
    out = torch.zeros(batch.query.shape, dtype=torch.float64)
    starts = batch.query_start_loc.tolist()
    n_q_heads, n_kv_heads = batch.query.shape[1], batch.keys[0].shape[1] if batch.keys else 1
    group = n_q_heads // n_kv_heads
    for b, (k, v) in enumerate(zip(batch.keys, batch.values)):
        q_len = starts[b + 1] - starts[b]
        for j in range(q_len):
            pos = k.shape[0] - q_len + j
            q = batch.query[starts[b] + j].double()  # [Hq, D]
            kh = k[: pos + 1].double().repeat_interleave(group, dim=1)  # [pos+1, Hq, D]
            vh = v[: pos + 1].double().repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,phd->hp", q, kh) * batch.scale
            out[starts[b] + j] = torch.einsum("hp,phd->hd", scores.softmax(-1), vh)
    return out


CASES = {
    "decode": [(5, 1), (16, 1), (33, 1), (1, 1)],
    "prompt": [(7, 7)],
    "prompt_block_multiple": [(16, 16)],
    "chunk": [(20, 6)],
    "prefix_all_but_last": [(17, 1), (24, 2)],
    "mixed": [(9, 1), (12, 12), (30, 5), (1, 1), (40, 1), (8, 3)],
}


IMPLEMENTATIONS = pytest.mark.parametrize(
    "attention", [paged_attention_ref, paged_attention_literal], ids=["ref", "spec"]
)


@IMPLEMENTATIONS
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 1)], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_matches_naive_attention(case, heads, block_size, attention):
    batch = make_paged_batch(CASES[case], *heads, head_dim=8, block_size=block_size, seed=1)
    out = attention(*batch.args())
    assert out.dtype == batch.query.dtype
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), naive_attention(batch), atol=1e-5, rtol=1e-5)


@IMPLEMENTATIONS
@pytest.mark.parametrize("pad_value", [0, -1, 10**6])
def test_block_table_padding_is_never_read(pad_value, attention):
    batch = make_paged_batch([(9, 1), (6, 6), (13, 4)], 4, 2, 8, 4, pad_value=pad_value)
    torch.testing.assert_close(
        attention(*batch.args()).double(), naive_attention(batch), atol=1e-5, rtol=1e-5
    )


@IMPLEMENTATIONS
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_dtypes_keep_query_dtype(dtype, attention):
    batch = make_paged_batch([(11, 1), (9, 9), (14, 3)], 4, 2, 16, 8, dtype=dtype)
    out = attention(*batch.args())
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), naive_attention(batch), atol=1e-2, rtol=1e-2)


@IMPLEMENTATIONS
def test_sequences_without_new_tokens_are_skipped(attention):
    batch = make_paged_batch([(6, 2), (5, 0), (7, 1)], 2, 2, 8, 4)
    torch.testing.assert_close(
        attention(*batch.args()).double(), naive_attention(batch), atol=1e-5, rtol=1e-5
    )


def test_public_function_uses_reference_when_forced(monkeypatch):
    """On CPU the default is the numba path (test_paged_attention_numba.py); ref is forced."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "ref")
    batch = make_paged_batch([(10, 1), (6, 6)], 4, 2, 8, 4)
    torch.testing.assert_close(paged_attention(*batch.args()), paged_attention_ref(*batch.args()))
