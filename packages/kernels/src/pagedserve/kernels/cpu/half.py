"""16-bit and 8-bit cache elements in numba-compiled code, which has no half or fp8 types:
widened to fp32, and fp32 rounded to them.

fp16 and bf16 caches are handed to numba as their 16-bit patterns (uint16 and int16 views),
fp8 e4m3 caches as their bytes (uint8, kv_fp8.py);
:func:`to_float32` widens one element bit-exactly in registers, so the paged attention kernel
(cpu/paged_attention.py) reads any cache dtype in place, and :func:`to_cache_element`
rounds an fp32 value to the cache's element as torch's conversion does, so the KV store
(cpu/layer_ops.py) writes any cache dtype.
"""

from __future__ import annotations

import numpy as np
import torch
from llvmlite import ir
from numba import njit, types
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


def to_float32(x):
    """A cache element as fp32: fp32 as is, int16 as bf16 bits, uint16 as fp16 bits, uint8 as
    fp8 e4m3 bits."""
    raise NotImplementedError("only callable from numba-compiled code")


@overload(to_float32, inline="always")
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
    if x == types.uint8:  # e4m3: exponent/mantissa moved into place, rescaled by 2**120
        return _e4m3_to_float32
    return None


def _e4m3_to_float32(x):  # pragma: no cover - compiled
    """As fp16's: one multiply rebiases (127 - 7) and renormalises subnormals exactly; a mask
    (not a branch) turns 0x7f / 0xff into NaN, so a cache row's loop stays vectorisable."""
    b = np.uint32(x)
    magnitude = np.uint32(b & np.uint32(0x7F))
    finite = _float32_as_bits(
        _bits_as_float32(np.uint32(magnitude << np.uint32(20))) * np.float32(2.0**120)
    )
    is_nan = np.uint32(0) - np.uint32(magnitude == np.uint32(0x7F))
    bits = (finite & ~is_nan) | (np.uint32(0x7FC00000) & is_nan)
    return _bits_as_float32(np.uint32(bits | ((b & np.uint32(0x80)) << np.uint32(24))))


@njit(inline="always")
def _shifted_to_nearest_even(mantissa, shift):  # pragma: no cover - compiled
    """``mantissa >> shift`` (uint32, 1 <= shift <= 31), rounded to nearest, ties to even."""
    kept = mantissa >> shift
    rest = mantissa & ((np.uint32(1) << shift) - np.uint32(1))
    halfway = np.uint32(1) << (shift - np.uint32(1))
    if rest > halfway or (rest == halfway and (kept & np.uint32(1))):
        kept += np.uint32(1)
    return np.uint32(kept)


def float32_to_e4m3_bits(x):  # pragma: no cover - compiled
    """fp32 -> e4m3fn bits, saturated at ±448 and rounded to nearest even: torch's
    ``clamp(x, -448, 448).to(torch.float8_e4m3fn)``, bit for bit (kv_fp8.py; the Triton
    writer is the same arithmetic). NaN to 0x7f with the sign."""
    raise NotImplementedError("only callable from numba-compiled code")


@overload(float32_to_e4m3_bits, inline="always")
def _float32_to_e4m3_bits_impl(x):
    if x != types.float32:
        return None

    def narrow(x):
        bits = _float32_as_bits(x)
        sign = np.uint32((bits >> np.uint32(24)) & np.uint32(0x80))
        a = np.uint32(bits & np.uint32(0x7FFFFFFF))
        if a > np.uint32(0x7F800000):
            return np.uint8(sign | np.uint32(0x7F))
        a = min(a, np.uint32(0x43E00000))  # 448
        if a >= np.uint32(0x3C800000):  # normal: round 20 bits away, rebias the exponent
            rounded = (a + np.uint32(0x7FFFF) + ((a >> np.uint32(20)) & np.uint32(1))) >> 20
            return np.uint8(sign | (rounded - np.uint32(120 << 3)))
        shift = np.uint32(min(141 - np.int32(a >> np.uint32(23)), 30))  # |x| * 2^9, rounded
        mantissa = (a & np.uint32(0x7FFFFF)) | np.uint32(0x800000)
        return np.uint8(sign | _shifted_to_nearest_even(mantissa, shift))

    return narrow


def float32_to_fp16_bits(x):  # pragma: no cover - compiled
    """fp32 -> fp16 bits, rounded to nearest even as torch's ``.to(torch.float16)`` rounds (the
    same bits for every non-NaN input: tests/kernels/test_numba_half_narrow.py): overflow to
    inf, fp16 subnormals kept, NaN to a quiet NaN (not necessarily torch's payload). Integer
    arithmetic only, so no fast-math flag of a caller can change it."""
    raise NotImplementedError("only callable from numba-compiled code")


@overload(float32_to_fp16_bits, inline="always")
def _float32_to_fp16_bits_impl(x):
    if x != types.float32:
        return None

    def narrow(x):
        bits = _float32_as_bits(x)
        sign = np.uint32((bits >> np.uint32(16)) & np.uint32(0x8000))
        exponent = np.int32((bits >> np.uint32(23)) & np.uint32(0xFF))
        mantissa = np.uint32(bits & np.uint32(0x7FFFFF))
        if exponent == 0xFF:  # inf, NaN (quiet, as torch makes it)
            return np.uint16(sign | np.uint32(0x7C00 if mantissa == 0 else 0x7E00))
        half_exponent = exponent - 112  # rebias: 127 - 15
        if half_exponent >= 31:
            return np.uint16(sign | np.uint32(0x7C00))
        if half_exponent <= 0:  # an fp16 subnormal (or 0): the implicit bit shifted in
            if half_exponent < -10:
                return np.uint16(sign)
            mantissa = mantissa | np.uint32(0x800000)
            shift = np.uint32(14 - half_exponent)
        else:
            mantissa = mantissa | np.uint32(half_exponent << 23)  # exponent rides the carry
            shift = np.uint32(13)
        # a carry out of the mantissa raises the exponent, up to inf
        return np.uint16(sign | _shifted_to_nearest_even(mantissa, shift))

    return narrow


def float32_to_bf16_bits(x):  # pragma: no cover - compiled
    """fp32 -> bf16 bits (as int16), rounded to nearest even as torch rounds (the same bits for
    every non-NaN input); NaN to a quiet NaN (torch's bits for it differ by version)."""
    raise NotImplementedError("only callable from numba-compiled code")


@overload(float32_to_bf16_bits, inline="always")
def _float32_to_bf16_bits_impl(x):
    if x != types.float32:
        return None

    def narrow(x):
        bits = _float32_as_bits(x)
        if x != x:
            return np.int16(0x7FC0)
        rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> 16
        return np.int16(np.uint16(rounded))

    return narrow


def to_cache_element(x, cache):
    """An fp32 value as an element of ``cache``: fp32 as is, fp16, bf16 or fp8 e4m3 bits
    rounded."""
    raise NotImplementedError("only callable from numba-compiled code")


@overload(to_cache_element, inline="always")
def _to_cache_element_impl(x, cache):
    if cache.dtype == types.float32:
        return lambda x, cache: x
    if cache.dtype == types.uint16:
        return lambda x, cache: float32_to_fp16_bits(x)
    if cache.dtype == types.int16:
        return lambda x, cache: float32_to_bf16_bits(x)
    if cache.dtype == types.uint8:
        return lambda x, cache: float32_to_e4m3_bits(x)
    return None


def cache_as_numpy(cache: torch.Tensor) -> np.ndarray:
    """The cache's memory as numpy, without a copy: 16-bit and 8-bit floats as their bits."""
    if cache.dtype == torch.bfloat16:
        return cache.view(torch.int16).numpy()
    if cache.dtype == torch.float16:
        return cache.view(torch.uint16).numpy()
    if cache.dtype == torch.float8_e4m3fn:
        return cache.view(torch.uint8).numpy()
    if cache.dtype in (torch.float32, torch.int8):  # int8: q8_0 rows (kv_q8.py)
        return cache.numpy()
    raise ValueError(f"numba kernels: unsupported KV cache dtype {cache.dtype}")
