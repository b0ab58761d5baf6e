"""encoder_attention: the Triton kernel (or the implementation given with --impl) against the
reference, over varlen batches whose sequences must not see each other."""

import pytest
import torch
from contracts import implementation
from suite_grid import DEVICE, DTYPES, pick
from tolerances import assert_close

from pagedserve.kernels.encoder_attention import encoder_attention_ref

LENGTHS = pick([[5, 40, 1, 17]], [[5, 40, 1, 17], [512], [1] * 9, [130, 3, 257, 64]])


def _batch(lengths, heads, kv_heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(0)
    total = sum(lengths)
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(total, heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    k = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    return q, k, v, starts.to(DEVICE)


@pytest.mark.contract("encoder_attention")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lengths", LENGTHS, ids=str)
@pytest.mark.parametrize("heads", [(12, 12, 32), (4, 2, 64), (2, 2, 80)], ids=str)
def test_encoder_attention(heads, lengths, dtype):
    n_heads, n_kv_heads, head_dim = heads
    q, k, v, starts = _batch(lengths, n_heads, n_kv_heads, head_dim, dtype)
    scale = head_dim**-0.5
    out = implementation("encoder_attention")(q, k, v, starts, max(lengths), scale)
    assert_close(out, encoder_attention_ref(q, k, v, starts, max(lengths), scale), attention=True)


@pytest.mark.contract("encoder_attention")
def test_sequences_do_not_see_each_other():
    """Changing one sequence's keys leaves every other sequence's output as it was."""
    q, k, v, starts = _batch([6, 9, 4], 2, 2, 32, torch.float32)
    attend = implementation("encoder_attention")
    before = attend(q, k, v, starts, 9, 0.2)
    k2, v2 = k.clone(), v.clone()
    k2[6:15], v2[6:15] = 100.0, -100.0  # the middle sequence only
    after = attend(q, k2, v2, starts, 9, 0.2)
    assert torch.equal(before[:6], after[:6]) and torch.equal(before[15:], after[15:])
    assert not torch.allclose(before[6:15], after[6:15])
