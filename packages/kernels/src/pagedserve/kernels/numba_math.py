"""``exp`` for fp32 inside numba-compiled loops, written so that LLVM can vectorise the loop.

numba lowers ``np.exp`` on a float32 to a call of the C library's ``expf`` per element (its
vectorised math library, Intel's SVML, is not installed here), and a call in a loop keeps
LLVM from vectorising it: a softmax over a tile of scores or SiLU over a 1,536-wide row then
spends most of its time in ~10 ns calls. :func:`exp_f32` is the textbook range reduction
plus polynomial instead, all branch-free arithmetic, so a loop that calls it (inlined) runs
eight lanes at a time:

    exp(x) = 2**n * exp(r),  n = round(x / ln 2),  r = x - n ln 2 in [-ln2/2, ln2/2]

with ``n ln 2`` subtracted in two parts (a high part exact in fp32, then the rest) so that
``r`` keeps its precision, ``exp(r)`` from its degree-6 Taylor-like minimax polynomial (the
coefficients of Cephes' ``expf``), and ``2**n`` built from its exponent bits. Accurate to
~2 ulp over fp32's range (kernels/test_numba_math.py holds it to float64's ``exp``); inputs
below ~-87.3 give exactly 0 (``-inf`` included: the online softmax's empty running max), above
~88.7 ``inf``.
"""

from __future__ import annotations

import numba
import numpy as np

from pagedserve.kernels.numba_half import _bits_as_float32

_LOG2E = np.float32(1.44269504088896341)
_LN2_HIGH = np.float32(0.693359375)  # few mantissa bits: n * _LN2_HIGH is exact
_LN2_LOW = np.float32(-2.12194440e-4)  # ln 2 - _LN2_HIGH
_LOWEST = np.float32(-87.33654)  # exp below this is under fp32's smallest normal: 0
_HIGHEST = np.float32(88.72283)  # exp above this overflows: inf
_P0, _P1, _P2 = np.float32(1.9875691500e-4), np.float32(1.3981999507e-3), np.float32(8.3334519073e-3)
_P3, _P4, _P5 = np.float32(4.1665795894e-2), np.float32(1.6666665459e-1), np.float32(5.0000001201e-1)


@numba.njit(cache=True)
def _power_of_two(n):  # pragma: no cover - compiled
    """``2.0**n`` for an int32 ``n`` in [-126, 127], from its exponent bits."""
    return _bits_as_float32(np.uint32((n + np.int32(127)) << np.int32(23)))


@numba.njit(cache=True, fastmath={"contract"})
def exp_f32(x):  # pragma: no cover - compiled
    """``exp(x)`` for a float32 ``x`` (see the module docstring); branch-free."""
    clamped = min(max(x, _LOWEST), _HIGHEST)
    n = np.floor(clamped * _LOG2E + np.float32(0.5))
    r = clamped - n * _LN2_HIGH - n * _LN2_LOW
    poly = ((((_P0 * r + _P1) * r + _P2) * r + _P3) * r + _P4) * r + _P5
    y = poly * (r * r) + r + np.float32(1.0)
    # 2**n as two powers of two (n up to 128 would overflow one exponent field)
    n_int = np.int32(n)
    half = n_int >> np.int32(1)
    y = y * _power_of_two(half) * _power_of_two(n_int - half)
    y = np.float32(0.0) if x < _LOWEST else y
    return np.float32(np.inf) if x > _HIGHEST else y
