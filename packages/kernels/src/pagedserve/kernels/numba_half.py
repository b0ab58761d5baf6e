"""16-bit cache elements widened to fp32 inside numba-compiled code (numba has no half types).

fp16 and bf16 caches are handed to numba as their 16-bit patterns (uint16 and int16 views);
:func:`_to_float32` widens one element bit-exactly in registers, so the paged attention kernel
(paged_attention_numba.py) reads any cache dtype in place.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload


@intrinsic
def _bits_as_float32(typingctx, bits):
    """Reinterpret a uint32 bit pattern as a float32 (numba cannot view a scalar)."""
    if bits != types.uint32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@intrinsic
def _float32_as_bits(typingctx, value):
    """Reinterpret a float32 as its uint32 bit pattern."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


def _to_float32(x):
    """A cache element as fp32: fp32 as is, int16 as bf16 bits, uint16 as fp16 bits."""
    raise NotImplementedError("only callable from numba-compiled code")


@overload(_to_float32, inline="always")
def _to_float32_impl(x):
    if x == types.float32:
        return lambda x: x
    if x == types.int16:  # bf16: the high half of an fp32

        def bf16(x):
            return _bits_as_float32(np.uint32(np.uint32(np.uint16(x)) << np.uint32(16)))

        return bf16
    if x == types.uint16:  # fp16: move exponent/mantissa into place, rescale by 2**112

        def fp16(x):
            h = np.uint32(x)
            magnitude = np.uint32(h & np.uint32(0x7FFF))
            shifted = np.uint32(magnitude << np.uint32(13))
            # One multiply rebiases the exponent and renormalises subnormals exactly.
            finite = _float32_as_bits(_bits_as_float32(shifted) * np.float32(2.0**112))
            special = np.uint32(shifted | np.uint32(0x7F800000))  # inf / NaN: all-ones exponent
            # Branch-free (a mask, not an if): no control flow for numba to inline, and a
            # loop over a 16-bit cache row stays one vectorisable block.
            is_special = np.uint32(0) - np.uint32(magnitude >= np.uint32(0x7C00))
            bits = (finite & ~is_special) | (special & is_special)
            return _bits_as_float32(np.uint32(bits | ((h & np.uint32(0x8000)) << np.uint32(16))))

        return fp16
    return None
