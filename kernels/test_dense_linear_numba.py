"""The CPU decode GEMM (dense_linear_numba): as accurate as MKL against a float64 product, on
the model shapes it serves (SmolLM2's projections, an lm_head-like width, widths that leave a
partial block of output features), and batch invariant: a row's result is the same bits whether
it is computed alone or with up to ``MAX_ROWS - 1`` others, and (the batch-invariant mode's
prefills, cut into row tiles) with a few hundred."""

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu import dense_linear as dense

SHAPES = [(960, 576), (576, 1536), (3074, 576), (7, 40), (4099, 64)]  # (N, K)


def _operands(rows: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g) / k**0.5


# The two loops: the default's (one weight row against four rows of ``x``) and the
# batch-invariant mode's (four weight rows against four rows), each invariant on its own.
LOOPS = pytest.mark.parametrize("invariant", [False, True], ids=["default", "batch_invariant"])


@LOOPS
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [1, 3, dense.MAX_ROWS, 70])
def test_as_accurate_as_mkl_against_float64(n, k, rows, invariant):
    x, w = _operands(rows, n, k, seed=n + rows)
    exact = F.linear(x.double(), w.double())
    got = dense.dense_linear_numba(x, w, invariant)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    mkl_error = (F.linear(x, w).double() - exact).abs().max().item()
    our_error = (got.double() - exact).abs().max().item()
    # fp32 rounding of a K-long dot: both errors are ~1e-6 here; ours may not be much worse
    assert our_error <= max(2 * mkl_error, 1e-6), (our_error, mkl_error)


@LOOPS
@pytest.mark.parametrize("n,k", SHAPES)
def test_a_rows_result_does_not_depend_on_its_batch(n, k, invariant):
    x, w = _operands(dense.MAX_ROWS, n, k, seed=k)
    together = dense.dense_linear_numba(x, w, invariant)
    for size in (1, 2, 5):
        for start in range(0, dense.MAX_ROWS - size + 1, size):
            part = dense.dense_linear_numba(x[start : start + size].clone(), w, invariant)
            assert torch.equal(part, together[start : start + size]), (size, start)


@LOOPS
@pytest.mark.parametrize("n,k", SHAPES)
def test_a_rows_result_is_the_same_in_a_prefill_of_any_length(n, k, invariant):
    x, w = _operands(150, n, k, seed=k + 1)
    together = dense.dense_linear_numba(x, w, invariant)
    assert (together.double() - F.linear(x.double(), w.double())).abs().max() < 1e-4
    for start, size in [(0, 1), (149, 1), (63, 2), (64, 17), (5, 100)]:
        part = dense.dense_linear_numba(x[start : start + size].clone(), w, invariant)
        assert torch.equal(part, together[start : start + size]), (size, start)


@LOOPS
@pytest.mark.parametrize("n,k", SHAPES)
def test_the_serial_kernel_gives_the_parallel_ones_bits(n, k, invariant):
    x, w = _operands(5, n, k, seed=3)
    arrays = [x.numpy(), w.numpy()]
    parallel, serial = (torch.empty(5, n).numpy() for _ in range(2))
    dense.dense_linear_parallel(*arrays, parallel, invariant)
    dense.dense_linear_serial(*arrays, serial, invariant)
    assert (parallel == serial).all()
    x = _operands(130, n, k, seed=4)[0]  # several row tiles
    arrays[0] = x.numpy()
    parallel, serial = (torch.empty(130, n).numpy() for _ in range(2))
    dense.dense_linear_parallel(*arrays, parallel, invariant)
    dense.dense_linear_serial(*arrays, serial, invariant)
    assert (parallel == serial).all()


def test_leading_dims_strided_rows_and_thread_counts():
    x, w = _operands(6, 963, 64, seed=1)
    want = dense.dense_linear_numba(x, w)
    assert torch.equal(dense.dense_linear_numba(x.view(2, 3, 64), w), want.view(2, 3, 963))
    strided = torch.zeros(6, 128)
    strided[:, ::2] = x
    assert torch.equal(dense.dense_linear_numba(strided[:, ::2], w), want)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # the numba kernel follows torch's count: same bits
        assert torch.equal(dense.dense_linear_numba(x, w), want)
    finally:
        torch.set_num_threads(threads)


def test_supports_only_what_it_computes():
    w = torch.randn(8, 16)
    assert dense.supports(torch.randn(dense.MAX_ROWS, 16), w)
    assert not dense.supports(torch.randn(dense.MAX_ROWS + 1, 16), w)  # MKL's rows
    assert dense.supports(torch.randn(300, 16), w, max_rows=None)  # the batch-invariant mode's
    assert not dense.supports(torch.randn(2, 16).double(), w.double())
    assert not dense.supports(torch.randn(2, 16).bfloat16(), w.bfloat16())
    assert not dense.supports(torch.randn(2, 16), w.t().contiguous().t()[:, :16])
    assert not dense.supports(torch.randn(0, 16), w)
    assert not dense.supports(torch.empty(2, 16, device="meta"), w)  # not a CPU tensor
