"""numba_math.exp_f32, the vectorisable exp of the CPU kernels, against float64's exp: within
about one ulp over fp32's range, 0 below it (-inf included), inf above it, NaN kept."""

import numba
import numpy as np

from pagedserve.kernels.cpu.fast_exp import exp_f32

# The kernels that call exp_f32 reassociate their own arithmetic; exp_f32 must keep its own
# order inside them (it is compiled with its own flags and inlined by LLVM, not by numba).
_CALLER_FLAGS = {"reassoc", "contract", "arcp", "nsz"}


@numba.njit(fastmath=_CALLER_FLAGS)
def _exp_all(x, out):
    for i in range(x.shape[0]):
        out[i] = exp_f32(x[i])


def _exp(x: np.ndarray) -> np.ndarray:
    out = np.empty_like(x)
    _exp_all(x, out)
    return out


def test_within_about_one_ulp_over_the_range():
    x = np.linspace(-87.3, 88.7, 1_000_003).astype(np.float32)
    exact = np.exp(x.astype(np.float64))
    ulp = np.spacing(exact.astype(np.float32)).astype(np.float64)
    assert (np.abs(_exp(x) - exact) / ulp).max() <= 1.5


def test_the_ends_of_the_range_and_special_values():
    x = np.array([-np.inf, -1000, -87.5, 0, -0.0, 88.8, 1000, np.inf, np.nan], np.float32)
    got = _exp(x)
    assert got[:3].tolist() == [0, 0, 0] and got[3:5].tolist() == [1, 1]
    assert np.isposinf(got[5:8]).all() and np.isnan(got[8])
    top = np.float32(88.72)  # just under fp32's largest exp: no overflow on the way
    assert np.isfinite(_exp(np.array([top], np.float32))).all()
