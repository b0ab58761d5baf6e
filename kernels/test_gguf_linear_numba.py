"""The CPU's GGUF GEMM (cpu/gguf_linear.py), its block decoders (cpu/gguf_blocks.py) and its
integer dots (cpu/integer_dot.py), for every type a GGUF file holds, against the reference on
rows whose quant and scale bits are random: each decoded row bit for bit
``gguf_dequantize_ref``'s (itself held to gguf's own decoder:
tests/kernels/test_gguf_dequant_ref.py), ``x @ W.T`` within the GEMM tolerance for a decode
step's rows and a prefill's (for the integer types' decode rows, within that plus what
rounding the activations to 16 bits allows, and within the GEMM tolerance alone where the
rounding is exact), on one thread and two, and a row's result the same bits alone or among
fifteen others."""

import numpy as np
import pytest
import torch
from tolerances import assert_close, assert_within_rounding, on_the_activation_grid

from pagedserve.kernels.cpu import gguf_linear as cpu
from pagedserve.kernels.cpu.gguf_blocks import decode_row
from pagedserve.kernels.cpu.integer_dot import (
    INTEGER_TYPES,
    activation_group,
)
from pagedserve.kernels.gguf_dequant import GGUF_TYPE_IDS, GGUF_TYPES, gguf_dequantize_ref
from pagedserve.kernels.gguf_linear import gguf_linear_ref
from pagedserve.kernels.testing import random_gguf_rows

TYPES = list(GGUF_TYPE_IDS)
INTEGER_NAMES = [name for name in TYPES if GGUF_TYPE_IDS[name] in INTEGER_TYPES]
ROWS = [1, 3, cpu.MAX_ROWS, cpu.MAX_ROWS + 1, 40]  # decode rows, then prefill tiles


def _operands(name: str, rows: int, n: int, k: int, seed: int = 0):
    qtype = GGUF_TYPE_IDS[name]
    qweight = random_gguf_rows(qtype, n, k, seed=seed)
    # the K-quants' random 6-bit scales make their weights ~30x larger: inputs scaled down
    spread = 1.0 if GGUF_TYPES[qtype].block_size < 256 else 1 / 32
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed + 1)) * k**-0.5
    return x * spread, qweight, qtype


def _assert_matches_reference(out, x, qweight, qtype, bias=None):
    """Within the GEMM tolerance of the reference; for a decode step's rows of an integer type
    (cpu/integer_dot.py) within that plus the activations' rounding: each activation is within
    half its group's step (``max |x| / ACTIVATION_MAX`` over the type's ``activation_group``) of
    its value, so an output is within ``sum |w| * step / 2`` of the exact product."""
    want = gguf_linear_ref(x, qweight, qtype, bias)
    x2 = x.reshape(-1, x.shape[-1])
    if qtype not in INTEGER_TYPES or x2.shape[0] > cpu.MAX_ROWS:
        assert_close(out, want, gemm=True)
        return
    weights = gguf_dequantize_ref(qweight, qtype)
    assert_within_rounding(out, want, x2, weights, activation_group(qtype))


@pytest.mark.parametrize("name", [t for t in TYPES if t != "F32"])
def test_every_decoded_row_is_the_references_bits(name):
    qtype = GGUF_TYPE_IDS[name]
    rows = random_gguf_rows(qtype, 3, 768 if GGUF_TYPES[qtype].block_size == 256 else 576)
    expected = gguf_dequantize_ref(rows, qtype).numpy()
    decoded = np.full_like(expected, np.nan)
    for r in range(3):
        decode_row(rows[r].numpy(), qtype, decoded[r], cpu.LANES)
    assert np.array_equal(decoded, expected)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("name", TYPES)
def test_every_type_matches_the_reference(name, rows, threads):
    """70 output features: four blocks of 16 shared out, a partial group of four at the end."""
    x, qweight, qtype = _operands(name, rows, 70, 512, seed=rows)
    out = cpu.gguf_linear_numba(x, qweight, qtype)
    assert out.shape == (rows, 70)
    _assert_matches_reference(out, x, qweight, qtype)


@pytest.mark.parametrize("rows", [1, 3, 4, 9, cpu.MAX_ROWS])
@pytest.mark.parametrize("name", INTEGER_NAMES)
def test_integer_dots_equal_the_reference_where_rounding_is_exact(name, rows, threads):
    """Activations on the 16-bit grid (integers times ``2^-20``, each group's largest
    ``ACTIVATION_MAX`` of them) round to themselves, so the integer dots must give the
    reference's product to fp32's rounding: every quant, scale and minimum in its place, for
    rows in calls of four and of one, in calls of several blocks and of one: K = 1280 for the
    K-quants (a call of ``K_GROUPED`` blocks, then one), 800 for the 32-weight types (three
    calls of ``GROUPED``, then one)."""
    qtype = GGUF_TYPE_IDS[name]
    k = 1280 if GGUF_TYPES[qtype].block_size == 256 else 800
    qweight = random_gguf_rows(qtype, 70, k, seed=rows)
    x = on_the_activation_grid(rows, k, seed=rows)
    out = cpu.gguf_linear_numba(x, qweight, qtype)
    assert_close(out, gguf_linear_ref(x, qweight, qtype), gemm=True)


@pytest.mark.parametrize("name", [*INTEGER_NAMES, "F16"])
def test_a_rows_result_does_not_depend_on_its_batch_or_threads(name, threads):
    """K = 1280: calls of several blocks and of one, for every type."""
    x, qweight, qtype = _operands(name, cpu.MAX_ROWS, 263, 1280, seed=5)
    together = cpu.gguf_linear_numba(x, qweight, qtype)
    for size in (1, 2, 5):
        for start in range(0, cpu.MAX_ROWS - size + 1, size):
            part = cpu.gguf_linear_numba(x[start : start + size].clone(), qweight, qtype)
            assert torch.equal(part, together[start : start + size]), (size, start)
    arrays = (x.numpy(), qweight.numpy(), qtype, cpu.LANES)
    parallel, serial = (np.empty((cpu.MAX_ROWS, 263), np.float32) for _ in range(2))
    cpu.gguf_linear_parallel(*arrays, parallel)
    cpu.gguf_linear_serial(*arrays, serial)
    assert np.array_equal(parallel, serial)
    assert np.array_equal(parallel, together.numpy())


def test_a_fused_projection_of_parts_of_several_types(threads):
    """What the fused decoder layer multiplies a Q4_K_M-like qkv by: parts of their own types
    (F32 among them), each product in its columns, as the modules concatenate them; a part
    with scales (8-bit weights) scaled after its product."""
    parts = [
        _operands(name, 5, n, 512, seed=n) for name, n in (("Q4_K", 40), ("F32", 8), ("Q6_K", 24))
    ]
    x = parts[0][0]
    rows = tuple(q.numpy() for _, q, _ in parts) + (np.empty((0, 0), np.uint8),)
    qtypes = tuple(t for _, _, t in parts) + (-1,)
    scales = (
        np.empty(0, np.float32),
        np.empty(0, np.float32),
        np.linspace(0.5, 2, 24, dtype=np.float32),
        np.empty(0, np.float32),
    )
    got = torch.from_numpy(
        cpu.gguf_parts_compiled(x.numpy(), rows, qtypes, scales, cpu.LANES, threads)
    )
    first = 0
    for (_, qweight, qtype), part_scales in zip(parts, scales):
        part = got[:, first : first + qweight.shape[0]]
        if part_scales.shape[0]:  # a part's own scales, after its product
            part = part / torch.from_numpy(part_scales)
        _assert_matches_reference(part, x, qweight, qtype)
        first += qweight.shape[0]


def test_bias_leading_dims_and_strided_rows():
    x, qweight, qtype = _operands("Q5_K", 6, 20, 256, seed=3)
    bias = torch.randn(20)
    wide = torch.zeros(6, 512)
    wide[:, ::2] = x
    strided = wide[:, ::2].view(2, 3, 256)
    for rows in (strided, torch.cat([strided] * 4, dim=1)):  # decode rows, then a prefill
        out = cpu.gguf_linear_numba(rows, qweight, qtype, bias)
        assert out.shape == (*rows.shape[:-1], 20)
        _assert_matches_reference(out[:, :3], strided, qweight, qtype, bias)


def test_a_row_that_is_not_its_types_blocks_is_refused():
    with pytest.raises(ValueError, match="do not hold"):
        cpu.gguf_linear_numba(torch.randn(1, 256), torch.zeros(4, 140, dtype=torch.uint8), 12)
    with pytest.raises(ValueError, match="fp32"):
        cpu.gguf_linear_numba(torch.randn(1, 32).half(), torch.zeros(4, 34, dtype=torch.uint8), 8)
