"""The CPU's 4-bit group GEMM (cpu/int4_linear.py: AWQ / GPTQ layers rewritten at load into
rows of 4-bit groups, multiplied by the GGUF GEMM) against the reference: the rows decode to
the reference's dequantized weight bit for bit (whole groups, a short last group, one group
the width of the layer, zero points up to 16), ``x W^T + bias`` within the GEMM tolerance for
a decode step's rows and a prefill's, on one thread and two, and a row's result the same bits
alone or among fifteen others."""

import pytest
import torch
from test_triton_int4_linear import gen, random_layer
from tolerances import assert_close, assert_rows_invariant

from pagedserve.kernels.cpu import gguf_linear as cpu
from pagedserve.kernels.cpu.int4_linear import (
    dequantize_int4_group_rows,
    int4_group_rows,
    int4_rows_linear,
)
from pagedserve.kernels.int4_linear import dequantize_int4, int4_linear_ref

ROWS = [1, 3, cpu.MAX_ROWS, cpu.MAX_ROWS + 1, 40]  # decode rows, then prefill tiles
LAYERS = [(24, 64, 32), (70, 104, 32), (40, 72, -1), (33, 200, 64), (16, 48, 8)]


def _layer(n: int, k: int, group_size: int, seed: int = 0):
    """``(words, values, scales, zeros, group size)`` of a random layer, on the CPU."""
    (qweight, scales, zeros, gs, _), q = random_layer(n, k, group_size, seed=seed)
    return qweight.cpu(), q, scales.cpu(), zeros.cpu(), gs


@pytest.mark.parametrize(("n", "k", "group_size"), LAYERS, ids=str)
def test_rows_decode_to_the_references_weight(n, k, group_size):
    qweight, q, scales, zeros, gs = _layer(n, k, group_size, seed=n)
    zeros[0, 0], zeros[-1, -1] = 16, 0  # the extremes a zero point takes (GPTQ's 0 - 1 + 1)
    rows = int4_group_rows(q, scales, zeros, gs)
    groups = -(-k // gs)
    assert rows.shape == (n, 4 + 5 * groups + k // 2) and rows.dtype == torch.uint8
    want = dequantize_int4(qweight, scales, zeros, gs).t()
    assert torch.equal(dequantize_int4_group_rows(rows, k), want)


@pytest.mark.parametrize("rows", ROWS)
def test_matches_the_reference(rows, threads):
    """70 output features: four blocks of 16 shared out, a partial group of four at the end;
    104 input features in groups of 32: three whole groups and a short one of 8."""
    qweight, q, scales, zeros, gs = _layer(70, 104, 32, seed=rows)
    x, bias = torch.randn(rows, 104, generator=gen(rows)), torch.randn(70, generator=gen(1))
    out = int4_rows_linear(x, int4_group_rows(q, scales, zeros, gs), bias)
    assert out.shape == (rows, 70)
    assert_close(out, int4_linear_ref(x, qweight, scales, zeros, gs, None, bias), gemm=True)


def test_a_rows_result_does_not_depend_on_its_batch_or_threads():
    qweight, q, scales, zeros, gs = _layer(263, 768, 128, seed=5)
    rows = int4_group_rows(q, scales, zeros, gs)
    x = torch.randn(cpu.MAX_ROWS, 768, generator=gen(6))
    assert_rows_invariant(lambda some: int4_rows_linear(some, rows), x)


def test_leading_dims_strided_and_half_precision_input():
    qweight, q, scales, zeros, gs = _layer(20, 64, 16, seed=3)
    rows = int4_group_rows(q, scales, zeros, gs)
    x = torch.randn(6, 64, generator=gen(4))
    wide = torch.zeros(6, 128)
    wide[:, ::2] = x
    out = int4_rows_linear(wide[:, ::2].view(2, 3, 64), rows)
    ref = int4_linear_ref(x, qweight, scales, zeros, gs)
    assert_close(out.view(6, 20), ref, gemm=True)
    half = int4_rows_linear(x.bfloat16(), rows)  # widened, multiplied in fp32, narrowed back
    assert half.dtype == torch.bfloat16
    assert torch.equal(half, int4_linear_ref(x.bfloat16(), qweight, scales, zeros, gs))
