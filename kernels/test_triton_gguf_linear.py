"""gguf_linear (weights in GGUF blocks: the float types and every block type): the
Triton kernel (or the implementation given with --impl) against the reference, on rows whose
quant and scale bits are random (every bit pattern a file can hold)."""

import pytest
import torch
from contracts import implementation
from suite_grid import DEVICE, DTYPES, pick
from tolerances import assert_close

from pagedserve.kernels.gguf_dequant import GGUF_TYPE_IDS, GGUF_TYPES
from pagedserve.kernels.gguf_linear import gguf_linear_ref
from pagedserve.kernels.testing import random_gguf_rows

TYPES = list(GGUF_TYPE_IDS)
SHAPES = pick(  # (tokens, out features, in features): partial tiles on the M and N axes
    [(5, 70, 256)],
    [(1, 576, 768), (7, 1536, 512), (64, 4096, 4096), (17, 4096, 14336), (300, 2048, 2048)],
)


def _inputs(qtype: int, shape, dtype, seed: int = 0):
    m, n, k = shape
    qweight = random_gguf_rows(qtype, n, k, seed=seed).to(DEVICE)
    gen = torch.Generator().manual_seed(seed + 1)
    # Inputs scaled by 1/sqrt(k) keep outputs near 1, where the table's tolerances are meant
    # (the K-quants' random 6-bit scales make their weights ~30x larger: scaled down too).
    spread = 1.0 if GGUF_TYPES[qtype].block_size < 256 else 1 / 32
    x = (torch.randn(m, k, generator=gen) * k**-0.5 * spread).to(dtype).to(DEVICE)
    return x, qweight


@pytest.mark.contract("gguf_linear")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gguf_linear(shape, qtype, dtype):
    x, qweight = _inputs(GGUF_TYPE_IDS[qtype], shape, dtype)
    out = implementation("gguf_linear")(x, qweight, GGUF_TYPE_IDS[qtype])
    assert_close(out, gguf_linear_ref(x, qweight, GGUF_TYPE_IDS[qtype]), gemm=True)


@pytest.mark.contract("gguf_linear")
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0"])
def test_bias_leading_dims_and_strided_rows(qtype):
    qt = GGUF_TYPE_IDS[qtype]
    x, qweight = _inputs(qt, (6, 20, 256), torch.float32, seed=3)
    x = torch.cat([x, x], dim=-1).reshape(2, 3, 512)[..., ::2]  # [2, 3, 256], strided rows
    bias = torch.randn(20).to(DEVICE)
    out = implementation("gguf_linear")(x, qweight, qt, bias)
    assert out.shape == (2, 3, 20)
    assert_close(out, gguf_linear_ref(x, qweight, qt, bias), gemm=True)
