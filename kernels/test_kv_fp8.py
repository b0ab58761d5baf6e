"""fp8 e4m3 KV cache elements in Triton (kv_fp8.py), against torch's conversions bit for bit:
the writer saturates at ±448 and rounds to nearest even over every halfway point, subnormal
and random fp32 pattern; the reader widens each of the 256 bytes as ``.float()``. Then
store_kv into an fp8 cache (the keys as any model dtype hands them over) writes the
reference's bytes, padding slots skipped."""

import pytest
import torch
import triton
import triton.language as tl
from contracts import implementation
from suite_grid import DEVICE, DTYPES

from pagedserve.kernels.kv_fp8 import (
    e4m3_to_float16,
    e4m3_to_float32,
    float32_to_e4m3,
    float32_to_e4m3_ref,
)
from pagedserve.kernels.store_kv import store_kv_ref
from pagedserve.kernels.testing import e4m3_rounding_inputs

FP8 = torch.float8_e4m3fn


@triton.jit
def _round_trip_kernel(x_ptr, bits_ptr, widened_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    bits = float32_to_e4m3(tl.load(x_ptr + offs, mask=mask, other=0.0))
    tl.store(bits_ptr + offs, bits, mask=mask)
    tl.store(widened_ptr + offs, e4m3_to_float32(bits), mask=mask)


def _round_trip(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    bits = torch.empty(x.shape, dtype=torch.uint8, device=DEVICE)
    widened = torch.empty(x.shape, device=DEVICE)
    block = 1024
    _round_trip_kernel[(triton.cdiv(x.numel(), block),)](x, bits, widened, x.numel(), BLOCK=block)
    return bits.cpu(), widened.cpu()


def test_writer_and_reader_match_torch_bit_for_bit():
    x = e4m3_rounding_inputs(n_random=1 << 14).to(DEVICE)
    bits, widened = _round_trip(x)
    x = x.cpu()
    finite = ~x.isnan()
    assert torch.equal(bits[finite], float32_to_e4m3_ref(x[finite]))
    assert ((bits[~finite] & 0x7F) == 0x7F).all()  # NaN stays NaN
    want = bits.view(FP8).float()
    assert torch.equal(widened[finite].view(torch.int32), want[finite].view(torch.int32))
    assert widened[~finite].isnan().all()


def test_reader_widens_every_byte():
    every = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    _, widened = _round_trip(every.to(DEVICE))  # each finite byte is its own rounding
    finite = ~every.isnan()
    assert torch.equal(widened[finite].view(torch.int32), every[finite].view(torch.int32))


@triton.jit
def _widen_to_half_kernel(bits_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, e4m3_to_float16(tl.load(bits_ptr + offs)))


def test_half_reader_widens_every_finite_byte_exactly():
    """The 16-bit query's reader: every byte but the two NaNs, as fp16, exactly."""
    bits = torch.arange(256, dtype=torch.uint8)
    out = torch.empty(256, dtype=torch.float16, device=DEVICE)
    _widen_to_half_kernel[(1,)](bits.to(DEVICE), out, BLOCK=256)
    want = bits.view(FP8).float()
    finite = ~want.isnan()
    assert torch.equal(out.cpu().float()[finite], want[finite])
    assert torch.equal(out.cpu()[finite].view(torch.int16), want[finite].half().view(torch.int16))


@pytest.mark.contract("store_kv")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_kv_into_an_fp8_cache(dtype):
    n_tokens, n_heads, head_dim, block_size = 9, 3, 64, 8
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(n_tokens, n_heads, head_dim, generator=gen) * 100  # past 448: saturated
    key, value = key.to(dtype).to(DEVICE), torch.randn(key.shape, generator=gen).to(dtype)
    value = value.to(DEVICE)
    slots = torch.tensor([3, -1, 17, 0, 40, -1, 8, 9, 47], device=DEVICE)
    caches = [
        torch.full((6, block_size, n_heads, head_dim), float("nan"), device=DEVICE).to(FP8)
        for _ in range(4)
    ]
    implementation("store_kv")(key, value, caches[0], caches[1], slots)
    store_kv_ref(key, value, caches[2], caches[3], slots)
    for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert caches[0].view(torch.uint8).view(-1, n_heads, head_dim)[1].eq(0x7F).all()
