"""``exp`` for fp32 inside numba-compiled loops, written so that LLVM can vectorise the loop.

numba lowers ``np.exp`` on a float32 to a call of the C library's ``expf`` per element (its
vectorised math library, Intel's SVML, is not installed here), and a call in a loop keeps
LLVM from vectorising it: a softmax over a tile of scores or SiLU over a 1,536-wide row then
spends most of its time in calls. :func:`exp_f32` is the textbook range reduction plus
polynomial instead, all branch-free arithmetic, emitted inline into the calling loop:

    exp(x) = 2**n * exp(r),  n = round(x / ln 2),  r = x - n ln 2 in [-ln2/2, ln2/2]

with ``n ln 2`` subtracted in two parts (a high part whose product with ``n`` is exact in
fp32, then the rest) so that ``r`` keeps its precision, ``exp(r)`` from a degree-7 polynomial
(the coefficients of Cephes' ``expf``), and ``2**n`` built from exponent bits, as two factors
so that ``n = 128`` (x just under fp32's overflow) does not overflow one exponent field.
Accurate to ~1 ulp over fp32's range (kernels/test_numba_math.py holds it to float64's exp);
inputs below ~-87.34 give exactly 0 (``-inf`` included: the online softmax's empty running
max), above ~88.72 ``inf``; NaN stays NaN.

**Why an intrinsic, not an ``@njit`` function.** The kernels that call it are compiled with
``fastmath`` reassociation, and numba stamps a function's fast-math flags on every float
instruction that has none, inlined callees' included. Reassociated, the two-part reduction
folds back into one multiply by a rounded ``ln 2`` (errors of ~1e-5 near the range's ends)
and the two power-of-two factors multiply each other first (``inf``). The instructions below
carry their own flag (``contract``: FMAs allowed, order kept), which numba leaves alone. (An
``@njit`` function called without numba's inlining keeps its flags too, but LLVM then inlines
it in some loops and not in others, and a loop with a call in it runs scalar.)
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

_LOG2E = 1.44269504088896341
_LN2_HIGH = 0.693359375  # few mantissa bits: n * _LN2_HIGH is exact for |n| <= 128
_LN2_LOW = -2.12194440e-4  # ln 2 - _LN2_HIGH
_LOWEST = -87.33654  # below: exp is under fp32's smallest normal, 0
_HIGHEST = 88.72283  # above: exp overflows, inf
# exp(r) ~ 1 + r + r**2 * (_POLY[0] r**5 + ... + _POLY[5])
_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
         5.0000001201e-1)  # fmt: skip
_FLAGS = ("contract",)  # kept as they are: see the module docstring


@intrinsic
def exp_f32(typingctx, x):
    """``exp(x)`` for a float32 ``x`` in numba-compiled code (see the module docstring)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        f32, i32 = ir.FloatType(), ir.IntType(32)
        (value,) = args

        def const(v):
            return ir.Constant(f32, float(np.float32(v)))

        def mul(a, b):
            return builder.fmul(a, b, flags=_FLAGS)

        def add(a, b):
            return builder.fadd(a, b, flags=_FLAGS)

        def less(a, b):
            return builder.fcmp_ordered("<", a, b, flags=_FLAGS)

        clamped = builder.select(less(value, const(_LOWEST)), const(_LOWEST), value)
        clamped = builder.select(less(const(_HIGHEST), clamped), const(_HIGHEST), clamped)
        floor = builder.module.declare_intrinsic("llvm.floor", [f32])
        n = builder.call(floor, [add(mul(clamped, const(_LOG2E)), const(0.5))])
        r = builder.fsub(clamped, mul(n, const(_LN2_HIGH)), flags=_FLAGS)
        r = builder.fsub(r, mul(n, const(_LN2_LOW)), flags=_FLAGS)
        poly = const(_POLY[0])
        for coefficient in _POLY[1:]:
            poly = add(mul(poly, r), const(coefficient))
        y = add(add(mul(poly, mul(r, r)), r), const(1.0))

        def power_of_two(k):  # 2.0**k from its exponent bits, k in [-126, 127]
            bits = builder.shl(builder.add(k, ir.Constant(i32, 127)), ir.Constant(i32, 23))
            return builder.bitcast(bits, f32)

        n_int = builder.fptosi(n, i32)
        half = builder.ashr(n_int, ir.Constant(i32, 1))
        y = mul(mul(y, power_of_two(half)), power_of_two(builder.sub(n_int, half)))
        y = builder.select(less(value, const(_LOWEST)), const(0.0), y)
        y = builder.select(less(const(_HIGHEST), value), const(np.inf), y)
        is_nan = builder.fcmp_unordered("uno", value, value, flags=_FLAGS)
        return builder.select(is_nan, value, y)

    return types.float32(types.float32), codegen
