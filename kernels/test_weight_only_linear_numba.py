"""The CPU's 8-bit weight GEMM (cpu/weight_only_linear.py: int8 and fp8 e4m3 rows through the
GGUF GEMM) against the reference: every byte decoded to the reference's value,
``x (scale * Q)^T + bias`` within the GEMM tolerance for a decode step's rows and a prefill's,
on one thread and two, and a row's result the same bits alone or among fifteen others. int8
rows of whole 32-weight groups take the integer dots (cpu/integer_dot.py) for a decode step's
rows: the reference's product where the activations are on their 16-bit grid, and within
what rounding them allows elsewhere."""

import numpy as np
import pytest
import torch
from tolerances import (
    assert_close,
    assert_rows_invariant,
    assert_within_rounding,
    on_the_activation_grid,
)

from pagedserve.kernels.cpu import gguf_linear as cpu
from pagedserve.kernels.cpu.gguf_blocks import E4M3_ROWS, INT8_ROWS, decode_row
from pagedserve.kernels.cpu.integer_dot import GROUP, has_integer_dot
from pagedserve.kernels.cpu.weight_only_linear import weight_only_linear_numba
from pagedserve.kernels.weight_only_linear import quantize_per_channel, weight_only_linear_ref

ROWS = [1, 3, cpu.MAX_ROWS, cpu.MAX_ROWS + 1, 40]  # decode rows, then prefill tiles


def _operands(fmt: str, rows: int, n: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    qweight, scale = quantize_per_channel(torch.randn(n, k, generator=gen), fmt)
    x = torch.randn(rows, k, generator=gen) * k**-0.5
    return x, qweight, scale


def test_every_byte_decodes_to_the_references_value():
    """Every byte of a row: int8 as a signed byte, e4m3 as torch widens it (every finite byte,
    subnormals and both zeros included: the NaN bytes 0x7f and 0xff are never written)."""
    raw = np.array([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=np.uint8)
    for kind, dtype in ((INT8_ROWS, torch.int8), (E4M3_ROWS, torch.float8_e4m3fn)):
        decoded = np.full(len(raw), 7.0, np.float32)
        decode_row(raw, kind, decoded, cpu.LANES)
        want = torch.from_numpy(raw).view(dtype).float().numpy()
        assert np.array_equal(decoded, want)
        assert np.array_equal(np.signbit(decoded), np.signbit(want))  # -0.0 stays -0.0


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_matches_the_reference(fmt, rows, threads):
    """70 output features: four blocks of 16 shared out, a partial group of four at the end."""
    x, qweight, scale = _operands(fmt, rows, 70, 200, seed=rows)
    bias = torch.randn(70)
    out = weight_only_linear_numba(x, qweight, scale, bias)
    assert out.shape == (rows, 70)
    assert_close(out, weight_only_linear_ref(x, qweight, scale, bias), gemm=True)


def test_int8_rows_of_whole_groups_take_the_integer_dots():
    assert has_integer_dot(INT8_ROWS, 768) and has_integer_dot(INT8_ROWS, 32)
    assert not has_integer_dot(INT8_ROWS, 200)  # decoded: the integer dots take whole groups
    assert not has_integer_dot(E4M3_ROWS, 768)


@pytest.mark.parametrize("rows", [1, 3, 4, 9, cpu.MAX_ROWS])
def test_int8_integer_dots_equal_the_reference_where_rounding_is_exact(rows, threads):
    """Activations on the 16-bit grid (integers times ``2^-20``, each group's largest
    ``ACTIVATION_MAX`` of them) round to themselves: the reference's product to fp32's
    rounding, for rows in calls of four and of one, K = 800 (three calls of eight groups,
    then one)."""
    _, qweight, scale = _operands("int8", 1, 70, 800, seed=rows)
    x = on_the_activation_grid(rows, 800, seed=rows)
    out = weight_only_linear_numba(x, qweight, scale)
    assert_close(out, weight_only_linear_ref(x, qweight, scale), gemm=True)


@pytest.mark.parametrize("rows", [1, 5, cpu.MAX_ROWS])
def test_int8_integer_dots_are_within_the_activations_rounding(rows, threads):
    """Each activation is within half its group's step (``max |x| / ACTIVATION_MAX`` over 32) of
    its value, so an output is within ``sum |w| * step / 2`` of the exact product (plus the
    GEMM tolerance)."""
    x, qweight, scale = _operands("int8", rows, 70, 768, seed=rows)
    out = weight_only_linear_numba(x, qweight, scale)
    want = weight_only_linear_ref(x, qweight, scale)
    assert_within_rounding(out, want, x, qweight.float() * scale[:, None], GROUP)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_a_rows_result_does_not_depend_on_its_batch_or_threads(fmt):
    x, qweight, scale = _operands(fmt, cpu.MAX_ROWS, 263, 768, seed=5)
    assert_rows_invariant(lambda some: weight_only_linear_numba(some, qweight, scale), x)


def test_leading_dims_strided_input_and_refusals():
    x, qweight, scale = _operands("int8", 6, 20, 64, seed=3)
    wide = torch.zeros(6, 128)
    wide[:, ::2] = x
    out = weight_only_linear_numba(wide[:, ::2].view(2, 3, 64), qweight, scale)
    assert_close(out.view(6, 20), weight_only_linear_ref(x, qweight, scale), gemm=True)
    with pytest.raises(ValueError, match="fp32 x and int8"):
        weight_only_linear_numba(x.half(), qweight, scale)
    with pytest.raises(ValueError, match="fp32 x and int8"):
        weight_only_linear_numba(x, qweight.float(), scale)
