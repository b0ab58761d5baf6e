"""encoder_attention_ref, the reference the Triton kernel is held to and the CPU's encoder
attention, against softmax attention written out per sequence: it stacks the sequences of one
length into one call, and none may see another."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.encoder_attention import encoder_attention_ref


def literal_attention(q, k, v, starts, scale):
    """softmax(q k^T * scale) v for each sequence alone, its kv heads shared by their groups."""
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for start, end in zip(starts[:-1], starts[1:]):
        for head in range(q.shape[1]):
            qs, ks, vs = (
                q[start:end, head],
                k[start:end, head // group],
                v[start:end, head // group],
            )
            out[start:end, head] = torch.softmax(qs @ ks.T * scale, dim=-1) @ vs
    return out


@pytest.mark.parametrize(
    "lengths", [[5, 40, 1, 17], [3, 7, 3, 3, 7, 1, 1], [9]], ids=str
)  # repeated lengths share a call
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=str)
def test_the_reference_is_each_sequences_own_softmax_attention(lengths, heads):
    gen = torch.Generator().manual_seed(0)
    total, (num_heads, num_kv_heads) = sum(lengths), heads
    q = torch.randn(total, num_heads, 16, generator=gen)
    k = torch.randn(total, num_kv_heads, 16, generator=gen)
    v = torch.randn(total, num_kv_heads, 16, generator=gen)
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    got = encoder_attention_ref(q, k, v, torch.tensor(starts), max(lengths), 0.25)
    torch.testing.assert_close(got, literal_attention(q, k, v, starts, 0.25), rtol=1e-5, atol=1e-5)
