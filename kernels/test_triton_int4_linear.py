"""int4_linear (4-bit groups: int32 words, per-group scales and zero points, optional g_idx):
the Triton kernel (or the implementation given with --impl) against the reference, and the
reference's dequantization against a literal, element-by-element reading of the layout."""

import pytest
import torch
from contracts import implementation
from suite_grid import DEVICE, DTYPES, pick
from tolerances import assert_close

from pagedserve.kernels.int4_linear import (
    Int4Workspace,
    dequantize_int4,
    int4_linear_ref,
    pack_int4_rows,
    unpack_int4_rows,
)

SHAPES = pick(  # (tokens, out features, in features, group size): partial tiles and groups
    [(1, 24, 64, 32), (5, 70, 96, 32), (33, 130, 200, 64), (3, 16, 72, -1)],
    [(1, 576, 576, 64), (7, 1536, 576, 128), (64, 4096, 4096, 128), (300, 14336, 4096, 128),
     (17, 4096, 14336, 128), (2, 512, 1000, -1)],
)  # fmt: skip


def gen(seed):
    return torch.Generator().manual_seed(seed)


def random_layer(n, k, group_size, seed=0, act_order=False):
    """A layer in the internal layout: words, fp32 scales near 1/(8 sqrt k), zeros 0..16."""
    gs = k if group_size == -1 else group_size
    groups = -(-k // gs)
    q = torch.randint(0, 16, (k, n), generator=gen(seed))
    zeros = torch.randint(0, 17, (groups, n), generator=gen(seed + 1)).to(torch.uint8)
    scales = (torch.rand(groups, n, generator=gen(seed + 2)) + 0.5) / (8 * k**0.5)
    g_idx = None
    if act_order:  # groups in no order and of uneven sizes (a tensor-parallel shard)
        g_idx = torch.sort(torch.randint(0, groups, (k,), generator=gen(seed + 3))).values
        g_idx = g_idx.to(torch.int32).to(DEVICE)
    return (pack_int4_rows(q).to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE), gs, g_idx), q


@pytest.mark.contract("int4_linear")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(("bias", "act_order"), [(False, False), (True, True)])
def test_int4_linear(bias, act_order, shape, dtype):
    m, n, k, group_size = shape
    (qweight, scales, zeros, gs, g_idx), _ = random_layer(n, k, group_size, act_order=act_order)
    x = (torch.randn(m, k, generator=gen(9))).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=gen(10)).to(dtype).to(DEVICE) if bias else None
    out = implementation("int4_linear")(x, qweight, scales, zeros, gs, g_idx, b)
    assert_close(out, int4_linear_ref(x, qweight, scales, zeros, gs, g_idx, b), gemm=True)


@pytest.mark.contract("int4_linear")
def test_a_batch_with_leading_dims_and_strided_rows():
    (qweight, scales, zeros, gs, g_idx), _ = random_layer(16, 48, 16, seed=4)
    x = torch.randn(2, 3, 96, generator=gen(5)).to(DEVICE)[..., ::2]  # [2, 3, 48], strided
    out = implementation("int4_linear")(x, qweight, scales, zeros, gs, g_idx)
    assert out.shape == (2, 3, 16)
    assert_close(out, int4_linear_ref(x, qweight, scales, zeros, gs, g_idx), gemm=True)


@pytest.mark.parametrize("act_order", [False, True])
def test_dequantize_reads_the_layout_element_by_element(act_order):
    """The specification, literally: W^T[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n] with
    g = g_idx[k] or k // group_size; the reference (in a reused workspace) must match it."""
    (qweight, scales, zeros, gs, g_idx), q = random_layer(24, 40, 16, seed=6, act_order=act_order)
    qweight, scales, zeros = qweight.cpu(), scales.cpu(), zeros.cpu()
    g_idx = g_idx.cpu() if g_idx is not None else None
    assert torch.equal(unpack_int4_rows(qweight), q.to(torch.int32))
    expected = torch.empty(40, 24)
    for k in range(40):
        g = int(g_idx[k]) if g_idx is not None else k // gs
        for n in range(24):
            expected[k, n] = (int(q[k, n]) - int(zeros[g, n])) * float(scales[g, n])
    workspace = Int4Workspace()
    dequantize_int4(torch.zeros_like(qweight), scales, zeros, gs, g_idx, workspace)  # dirty it
    got = dequantize_int4(qweight, scales, zeros, gs, g_idx, workspace)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
