"""weight_only_linear (int8 and fp8 e4m3 weights, per-channel scales): the Triton kernel (or
the implementation given with --impl) against the reference, and the fp8 byte decoding
against torch's own fp8 conversion for every finite byte."""

import pytest
import torch
from contracts import implementation
from suite_grid import DEVICE, DTYPES, pick
from tolerances import assert_close

from pagedserve.kernels.weight_only_linear import quantize_per_channel, weight_only_linear_ref

SHAPES = pick(  # (tokens, out features, in features): partial tiles on every axis
    [(1, 24, 40), (5, 70, 96), (33, 130, 200)],
    [(1, 576, 576), (7, 1536, 576), (64, 4096, 4096), (300, 14336, 4096), (17, 4096, 14336)],
)


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


@pytest.mark.contract("weight_only_linear")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("bias", [False, True])
def test_weight_only_linear(bias, shape, fmt, dtype):
    m, n, k = shape
    qweight, scale = quantize_per_channel(randn(n, k, seed=1), fmt)
    # Inputs scaled by 1/sqrt(k) keep outputs near 1, where the table's tolerances are meant.
    x = randn(m, k, dtype=dtype, scale=k**-0.5)
    b = randn(n, dtype=dtype, seed=2) if bias else None
    out = implementation("weight_only_linear")(x, qweight, scale, b)
    assert_close(out, weight_only_linear_ref(x, qweight, scale, b), gemm=True)


@pytest.mark.contract("weight_only_linear")
def test_every_finite_fp8_byte_decodes_exactly():
    every = torch.arange(256, dtype=torch.uint8)
    finite = every[(every & 0x7F) != 0x7F].view(torch.float8_e4m3fn).reshape(-1, 1).to(DEVICE)
    ones = torch.ones(len(finite), device=DEVICE)
    out = implementation("weight_only_linear")(torch.ones(1, 1, device=DEVICE), finite, ones)
    assert torch.equal(out[0].cpu(), finite.float()[:, 0].cpu())


@pytest.mark.contract("weight_only_linear")
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_a_batch_with_leading_dims_and_strided_rows(fmt):
    qweight, scale = quantize_per_channel(randn(20, 48, seed=3), fmt)
    x = randn(2, 3, 96, seed=4)[..., ::2]  # [2, 3, 48], rows not contiguous
    out = implementation("weight_only_linear")(x, qweight, scale)
    assert out.shape == (2, 3, 20)
    assert_close(out, weight_only_linear_ref(x, qweight, scale), gemm=True)
