"""lora_shrink / lora_expand (the BGMV pair that applies many adapters to one batch): the Triton
kernels (or the implementations given with --impl) against a per-token einsum, the literal
specification, and the references (the CPU path) against the same, over ranks 8-64, batches
that mix slots with rows that have no adapter, and the GQA-shaped slices of a fused qkv."""

import pytest
import torch
from contracts import implementation
from suite_grid import DEVICE, DTYPES, pick
from tolerances import assert_close

from pagedserve.kernels.lora import lora_expand_ref, lora_shrink_ref

RANKS = pick([8, 16, 64], [8, 16, 32, 64])
# (hidden, q heads, kv heads, head dim): GQA qkv slices of unequal widths
QKV_SHAPES = pick([(48, 6, 2, 8)], [(576, 9, 3, 64), (4096, 32, 8, 128)])


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def slots_for(num_tokens: int, num_slots: int, seed: int = 0) -> torch.Tensor:
    """Every slot and -1 (base model) among the rows, in no particular order."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-1, num_slots, (num_tokens,), generator=gen).to(DEVICE)


def shrink_literal(x, a, token_slot, scale):
    """Row t times its own slot's A; zero for slot -1."""
    picked = a[token_slot.clamp_min(0)].float()  # [T, r, in]
    y = torch.einsum("tk,trk->tr", x.float(), picked) * scale
    return torch.where(token_slot[:, None] >= 0, y, torch.zeros_like(y))


def expand_literal(y, b, token_slot, base, offset):
    out = base.clone()
    delta = torch.einsum("tr,tnr->tn", y.float(), b[token_slot.clamp_min(0)].float())
    cols = slice(offset, offset + b.shape[1])
    mixed = out[:, cols].float() + delta
    out[:, cols] = torch.where(token_slot[:, None] >= 0, mixed.to(out.dtype), out[:, cols])
    return out


@pytest.mark.contract("lora_shrink")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("num_tokens", [1, 7])
def test_lora_shrink(num_tokens, rank, dtype):
    slots, k = 3, 72
    x = randn(num_tokens, k, dtype=dtype, scale=k**-0.5)
    a = randn(slots, rank, k, dtype=dtype, seed=1)
    token_slot = slots_for(num_tokens, slots, seed=rank)
    out = implementation("lora_shrink")(x, a, token_slot, 0.5)
    expected = shrink_literal(x, a, token_slot, 0.5)
    assert_close(out, expected, gemm=True)
    assert_close(lora_shrink_ref(x, a, token_slot, 0.5), expected, gemm=True)


@pytest.mark.contract("lora_expand")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("num_tokens", [1, 7])
def test_lora_expand_into_a_slice(num_tokens, rank, dtype):
    slots, n, offset, width = 3, 70, 10, 100
    y = randn(num_tokens, rank, scale=rank**-0.5)
    b = randn(slots, n, rank, dtype=dtype, seed=2)
    base = randn(num_tokens, width, dtype=dtype, seed=3)
    token_slot = slots_for(num_tokens, slots, seed=rank + 1)
    expected = expand_literal(y, b, token_slot, base, offset)
    out = implementation("lora_expand")(y, b, token_slot, base.clone(), offset)
    assert_close(out, expected, gemm=True)
    assert_close(lora_expand_ref(y, b, token_slot, base.clone(), offset), expected, gemm=True)


@pytest.mark.contract("lora_expand")
def test_rows_without_an_adapter_are_left_exactly_as_they_were():
    base = randn(5, 32, seed=4)
    b = randn(2, 32, 8, seed=5)
    token_slot = torch.tensor([-1, 0, -1, 1, -1], device=DEVICE)
    out = implementation("lora_expand")(randn(5, 8, seed=6), b, token_slot, base.clone())
    keep = token_slot < 0
    assert torch.equal(out[keep].cpu(), base[keep].cpu())
    assert not torch.equal(out[~keep].cpu(), base[~keep].cpu())
    y = implementation("lora_shrink")(randn(5, 16), randn(2, 8, 16), token_slot)
    assert torch.equal(y[keep].cpu(), torch.zeros(3, 8))


@pytest.mark.contract("lora_expand")
@pytest.mark.parametrize("shape", QKV_SHAPES, ids=str)
@pytest.mark.parametrize("rank", [8, 16])
def test_a_fused_qkv_with_gqa_slices(shape, rank):
    """q, k and v each have their own A and B: one shrink over the three A stacked along the
    rank, then one expand per slice into its columns, equal to three separate adapters."""
    hidden, hq, hkv, d = shape
    widths = [hq * d, hkv * d, hkv * d]
    slots, num_tokens = 2, 6
    x = randn(num_tokens, hidden, scale=hidden**-0.5)
    a = [randn(slots, rank, hidden, seed=10 + i) for i in range(3)]
    b = [randn(slots, w, rank, seed=20 + i, scale=rank**-0.5) for i, w in enumerate(widths)]
    base = randn(num_tokens, sum(widths), seed=30)
    token_slot = slots_for(num_tokens, slots, seed=7)
    y = implementation("lora_shrink")(x, torch.cat(a, dim=1).contiguous(), token_slot)
    out = base.clone()
    offsets = [0, widths[0], widths[0] + widths[1]]
    for i, offset in enumerate(offsets):
        implementation("lora_expand")(
            y[:, i * rank : (i + 1) * rank], b[i], token_slot, out, offset
        )
    expected = base.clone()
    for i, offset in enumerate(offsets):
        part = shrink_literal(x, a[i], token_slot, 1.0)
        expected = expand_literal(part, b[i], token_slot, expected, offset)
    assert_close(out, expected, gemm=True)
