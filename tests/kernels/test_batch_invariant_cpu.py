"""The CPU's batch-invariant paths, through the kernels' public dispatch (no interpreter): the
linear layer's GEMM, the MoE experts and the LoRA adapters keep each row's bits whatever the
other rows, and stay within the references' tolerance; without the mode the GEMM's bits
follow the row count (MKL from 17 rows on); the reference path refuses the mode."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels import fused_moe, lora_expand, lora_shrink, paged_attention
from pagedserve.kernels.fused_moe import fused_moe_ref
from pagedserve.kernels.linear import linear
from pagedserve.kernels.lora import lora_expand_ref, lora_shrink_ref
from pagedserve.kernels.testing import make_paged_batch


def _randn(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def test_linear_rows_are_the_same_bits_at_any_row_count():
    x, w, b = _randn(200, 96, seed=0), _randn(130, 96, seed=1, scale=0.1), _randn(130, seed=2)
    whole = linear(x, w, b, batch_invariant=True)
    torch.testing.assert_close(whole, F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    for start, rows in [(0, 1), (3, 16), (20, 17), (100, 100)]:
        part = linear(x[start : start + rows].clone(), w, b, batch_invariant=True)
        assert torch.equal(part, whole[start : start + rows]), (start, rows)


def test_without_the_mode_a_rows_bits_follow_the_row_count():
    x, w = _randn(40, 576, seed=3), _randn(960, 576, seed=4, scale=0.05)
    alone = linear(x[:1].clone(), w)  # the numba kernel
    among = linear(x, w)[:1]  # MKL
    assert not torch.equal(alone, among)


def test_reference_kernels_refuse_the_mode(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "ref")
    with pytest.raises(ValueError, match="no batch-invariant GEMM"):
        linear(torch.randn(2, 8), torch.randn(4, 8), batch_invariant=True)
    batch = make_paged_batch([(9, 1)], 4, 2, 16, 8)
    with pytest.raises(ValueError, match="not batch invariant"):
        paged_attention(*batch.args(), batch_invariant=True)


def test_moe_token_is_the_same_bits_among_others():
    n_experts, top_k = 8, 3
    x = _randn(41, 64, seed=5)
    w13 = _randn(n_experts, 96, 64, seed=6, scale=0.1)
    w2 = _randn(n_experts, 64, 48, seed=7, scale=0.1)
    weights, ids = _randn(41, n_experts, seed=8).softmax(-1).topk(top_k, dim=-1)
    whole = fused_moe(x, w13, w2, weights, ids, batch_invariant=True)
    torch.testing.assert_close(whole, fused_moe_ref(x, w13, w2, weights, ids), atol=1e-4, rtol=0)
    for t in (0, 20, 40):
        alone = fused_moe(
            x[t : t + 1], w13, w2, weights[t : t + 1], ids[t : t + 1], batch_invariant=True
        )
        assert torch.equal(alone, whole[t : t + 1]), t


def test_gpt_oss_moe_token_is_the_same_bits_among_others():
    """gpt-oss's experts: biases after both projections and the clamped SwiGLU."""
    n_experts, top_k = 8, 4
    x = _randn(41, 64, seed=13)
    w13 = _randn(n_experts, 128, 64, seed=14, scale=0.2)
    w2 = _randn(n_experts, 64, 64, seed=15, scale=0.2)
    b13, b2 = _randn(n_experts, 128, seed=16), _randn(n_experts, 64, seed=17)
    weights, ids = _randn(41, n_experts, seed=18).softmax(-1).topk(top_k, dim=-1)
    gpt_oss = dict(w13_bias=b13, w2_bias=b2, activation="swigluoai", swiglu_limit=7.0)
    whole = fused_moe(x, w13, w2, weights, ids, **gpt_oss, batch_invariant=True)
    expected = fused_moe_ref(x, w13, w2, weights, ids, **gpt_oss)
    torch.testing.assert_close(whole, expected, atol=1e-4, rtol=1e-5)
    for t in (0, 20, 40):
        one = (x[t : t + 1], w13, w2, weights[t : t + 1], ids[t : t + 1])
        alone = fused_moe(*one, **gpt_oss, batch_invariant=True)
        assert torch.equal(alone, whole[t : t + 1]), t


def test_lora_rows_are_the_same_bits_among_other_adapters():
    x = _randn(30, 64, seed=9)
    a, b = _randn(3, 8, 64, seed=10, scale=0.1), _randn(3, 48, 8, seed=11, scale=0.1)
    slots = torch.tensor([0, 1, 2, -1, 1] * 6)
    base = _randn(30, 48, seed=12)

    def adapted(rows: slice) -> torch.Tensor:
        y = lora_shrink(x[rows].clone(), a, slots[rows], 0.5, batch_invariant=True)
        return lora_expand(y, b, slots[rows], base[rows].clone(), batch_invariant=True)

    whole = adapted(slice(0, 30))
    expected = lora_expand_ref(lora_shrink_ref(x, a, slots, 0.5), b, slots, base.clone())
    torch.testing.assert_close(whole, expected, atol=1e-5, rtol=1e-5)
    for row in (0, 1, 3, 29):
        assert torch.equal(adapted(slice(row, row + 1)), whole[row : row + 1]), row


def test_a_sigmoid_over_whole_vectors_is_a_rows_own_at_any_thread_count():
    """``on_whole_vectors`` (a router's few scores a token): a token's value is the same bits
    in a batch of any size, also where torch would cut a large tensor among three threads
    mid-row and send the end of each share to scalar libm (batch sizes from 513 rows on)."""
    from pagedserve.models.layers.batch_invariance import on_whole_vectors

    x = torch.randn(3000, 8, generator=torch.Generator().manual_seed(0)) * 4
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([on_whole_vectors(torch.sigmoid, row[None]) for row in x])
        torch.set_num_threads(3)
        for rows in (1, 7, 513, 1030, 1063, 1150, 1999, 3000):  # 1030..1150: differed before
            assert torch.equal(on_whole_vectors(torch.sigmoid, x[:rows]), alone[:rows]), rows
    finally:
        torch.set_num_threads(threads)
