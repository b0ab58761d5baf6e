"""One GGUF row of blocks -> its fp32 weights, compiled with numba: the decoders the CPU's GGUF
GEMM (cpu/gguf_linear.py) runs on every weight row it multiplies.

A row is the file's bytes, ``uint8 [row_bytes]`` (gguf_dequant.py has every layout); a
decoder writes the row's ``K`` weights into an fp32 buffer that stays in L1 or L2 while the
GEMM dots it against the activations. Each decoder's inner loop runs over the consecutive
bytes of one bit field with the block's or sub-block's scale fixed, so LLVM turns it into a
few vector shifts, masks, conversions and multiplies per 8 or 16 weights. Two things keep it
vectorized, both measured on Q4_0 on one core of the Intel VM (G weights decoded per second):

- **The inner loop's count comes in at run time** (``lanes``, always 16; the callers pass
  ``LANES``). LLVM fully unrolls a loop of 16 constant iterations into scalar code, and numba
  leaves LLVM's SLP vectorizer (which would put it back into vectors) off: 1.7 against 7.6.
- **32-bit bit fields** (``_bits``): numba widens every integer operation to 64 bits, and a
  loop of 64-bit lanes vectorizes at half the width: 7.6 against 9.6.

**Bit for bit the reference.** Every weight is computed with the reference's fp32 operations
in the reference's order (``d * scale`` first, then ``* q``, then ``- dmin * min``), and
these functions are compiled without fast-math: no ``contract`` that would fuse a multiply
and a subtract into one FMA, whose single rounding differs. So a decoded row equals
``gguf_dequantize_ref``'s row exactly, and gguf's own ``dequantize`` (the kernel suite checks
every type: kernels/test_gguf_linear_numba.py).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from pagedserve.kernels.cpu import numba_cache  # noqa: F401  (before any cached @njit)
from pagedserve.kernels.gguf_dequant import GGUF_TYPE_IDS, IQ4_LEVELS

F16, BF16 = GGUF_TYPE_IDS["F16"], GGUF_TYPE_IDS["BF16"]
Q4_0, Q4_1, Q8_0 = GGUF_TYPE_IDS["Q4_0"], GGUF_TYPE_IDS["Q4_1"], GGUF_TYPE_IDS["Q8_0"]
Q5_0, Q5_1, IQ4_NL = GGUF_TYPE_IDS["Q5_0"], GGUF_TYPE_IDS["Q5_1"], GGUF_TYPE_IDS["IQ4_NL"]
Q2_K, Q3_K, Q4_K = GGUF_TYPE_IDS["Q2_K"], GGUF_TYPE_IDS["Q3_K"], GGUF_TYPE_IDS["Q4_K"]
Q5_K, Q6_K, IQ4_XS = GGUF_TYPE_IDS["Q5_K"], GGUF_TYPE_IDS["Q6_K"], GGUF_TYPE_IDS["IQ4_XS"]
_LEVELS = np.array(IQ4_LEVELS, dtype=np.float32)


@intrinsic
def _fp16(typingctx, raw, i):
    """The little-endian fp16 at byte ``i`` of ``raw``, widened to fp32 (exact; one or two
    instructions where the CPU converts halves)."""

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        at = builder.bitcast(builder.gep(data, [args[1]]), ir.PointerType(ir.HalfType()))
        return builder.fpext(builder.load(at, align=1), ir.FloatType())

    return types.float32(raw, i), codegen


@intrinsic
def _bits(typingctx, value, shift, mask):
    """``(value >> shift) & mask`` in 32-bit arithmetic, as an int32 (module doc)."""

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        v, s, m = (
            builder.zext(a, i32) if a.type.width < 32 else builder.trunc(a, i32) for a in args
        )
        return builder.and_(builder.lshr(v, s), m)

    return types.int32(value, shift, mask), codegen


@numba.njit(cache=True, inline="always")
def _f(value, shift, mask):  # pragma: no cover - compiled
    """``_bits`` as an fp32 (exact: a few bits)."""
    return np.float32(_bits(value, shift, mask))


@numba.njit(cache=True, inline="always")
def _i(value, shift, mask):  # pragma: no cover - compiled
    return _bits(value, shift, mask)


@numba.njit(cache=True)
def _halves(raw, qtype, out, lanes):  # pragma: no cover - compiled
    """F16 and BF16 (the top half of an fp32), one weight per two bytes."""
    if qtype == F16:
        for k in range(out.shape[0]):
            out[k] = _fp16(raw, 2 * k)
    else:
        halves, bits = raw.view(np.uint16), out.view(np.uint32)
        for k in range(out.shape[0]):
            bits[k] = np.uint32(halves[k]) << np.uint32(16)


@numba.njit(cache=True)
def _q8_0(raw, out, lanes):  # pragma: no cover - compiled
    for b in range(out.shape[0] // 32):
        at, o = 34 * b + 2, 32 * b
        d = _fp16(raw, at - 2)
        for j in range(2 * lanes):
            out[o + j] = d * np.float32(np.int8(raw[at + j]))


@numba.njit(cache=True)
def _q4(raw, out, lanes, with_min):  # pragma: no cover - compiled
    """Q4_0 (``d * (q - 8)``) and Q4_1 (``with_min``: ``d * q + m``)."""
    size = 20 if with_min else 18
    for b in range(out.shape[0] // 32):
        base, o = size * b, 32 * b
        d, at = _fp16(raw, base), base + size - 16
        if with_min:
            m = _fp16(raw, base + 2)
            for j in range(lanes):
                out[o + j] = d * _f(raw[at + j], 0, 15) + m
                out[o + j + 16] = d * _f(raw[at + j], 4, 15) + m
        else:
            for j in range(lanes):
                out[o + j] = d * (_f(raw[at + j], 0, 15) - np.float32(8.0))
                out[o + j + 16] = d * (_f(raw[at + j], 4, 15) - np.float32(8.0))


@numba.njit(cache=True)
def _q5(raw, out, lanes, with_min):  # pragma: no cover - compiled
    """Q5_0 (``d * (q - 16)``) and Q5_1 (``with_min``: ``d * q + m``); the fifth bits come as
    ``16 * bit`` added in fp32 (exact)."""
    size = 24 if with_min else 22
    for b in range(out.shape[0] // 32):
        base, o = size * b, 32 * b
        d, qh = _fp16(raw, base), size - 20 + base
        at, high = qh + 4, np.uint32(0)
        for i in range(4):
            high |= np.uint32(raw[qh + i]) << np.uint32(8 * i)
        m = _fp16(raw, base + 2) if with_min else np.float32(0.0)
        bias = np.float32(0.0) if with_min else np.float32(16.0)
        for j in range(lanes):
            lo = _f(raw[at + j], 0, 15) + np.float32(16.0) * _f(high, j, 1) - bias
            hi = _f(raw[at + j], 4, 15) + np.float32(16.0) * _f(high, j + 16, 1) - bias
            out[o + j], out[o + j + 16] = d * lo + m, d * hi + m


@numba.njit(cache=True)
def _iq4_nl(raw, out, lanes):  # pragma: no cover - compiled
    for b in range(out.shape[0] // 32):
        at, o = 18 * b + 2, 32 * b
        d = _fp16(raw, at - 2)
        for j in range(lanes):
            out[o + j] = d * _LEVELS[_i(raw[at + j], 0, 15)]
            out[o + j + 16] = d * _LEVELS[_i(raw[at + j], 4, 15)]


@numba.njit(cache=True, inline="always")
def _pick(first_half, a, b):  # pragma: no cover - compiled
    """``a`` for the first 16 lanes of a 32-byte run, ``b`` for the second (a vector blend)."""
    return a if first_half else b


@numba.njit(cache=True, inline="always")
def _q2_k_scales(raw, at, d, dmin):  # pragma: no cover - compiled
    """Q2_K's two 16-weight sub-blocks from bytes ``at``, ``at + 1``: their ``d * scale`` and
    ``dmin * min``."""
    a, b = raw[at], raw[at + 1]
    return d * _f(a, 0, 15), dmin * _f(a, 4, 15), d * _f(b, 0, 15), dmin * _f(b, 4, 15)


@numba.njit(cache=True)
def _q2_k(raw, out, lanes):  # pragma: no cover - compiled
    """Per 128-weight half ``h``: byte ``l`` of its 32 holds weight ``32 s + l`` in bits
    ``2s, 2s + 1``, one loop over the 32 bytes writes all four; sub-block ``8 h + 2 s + t``
    (``t``: which 16 of the run)."""
    for b in range(out.shape[0] // 256):
        base, o = 84 * b, 256 * b
        d, dmin = _fp16(raw, base + 80), _fp16(raw, base + 82)
        for h in range(2):
            at, to, sc = base + 16 + 32 * h, o + 128 * h, base + 8 * h
            d0a, m0a, d0b, m0b = _q2_k_scales(raw, sc, d, dmin)
            d1a, m1a, d1b, m1b = _q2_k_scales(raw, sc + 2, d, dmin)
            d2a, m2a, d2b, m2b = _q2_k_scales(raw, sc + 4, d, dmin)
            d3a, m3a, d3b, m3b = _q2_k_scales(raw, sc + 6, d, dmin)
            for j in range(2 * lanes):
                first, q = j < lanes, raw[at + j]
                out[to + j] = _pick(first, d0a, d0b) * _f(q, 0, 3) - _pick(first, m0a, m0b)
                out[to + 32 + j] = _pick(first, d1a, d1b) * _f(q, 2, 3) - _pick(first, m1a, m1b)
                out[to + 64 + j] = _pick(first, d2a, d2b) * _f(q, 4, 3) - _pick(first, m2a, m2b)
                out[to + 96 + j] = _pick(first, d3a, d3b) * _f(q, 6, 3) - _pick(first, m3a, m3b)


@numba.njit(cache=True, inline="always")
def _q3_k_scale(raw, base, j, d):  # pragma: no cover - compiled
    """``d *`` Q3_K's signed 6-bit scale ``j`` (0..15) of the block at ``base``."""
    low = _i(raw[base + 96 + j % 8], 4 * (j // 8), 15)
    high = _i(raw[base + 104 + j % 4], 2 * (j // 4), 3)
    return d * np.float32(low + 16 * high - 32)


@numba.njit(cache=True, inline="always")
def _q3_k_quant(low, high):  # pragma: no cover - compiled
    """``q = low - 4 + 4 * high`` (exact in fp32)."""
    return low + np.float32(4.0) * (high - np.float32(1.0))


@numba.njit(cache=True)
def _q3_k(raw, out, lanes):  # pragma: no cover - compiled
    """As Q2_K's halves; weight ``e``'s high bit is bit ``e / 32`` of ``hmask[e % 32]``."""
    for b in range(out.shape[0] // 256):
        base, o = 110 * b, 256 * b
        d = _fp16(raw, base + 108)
        for h in range(2):
            at, to, j = base + 32 + 32 * h, o + 128 * h, 8 * h
            d0a, d0b = _q3_k_scale(raw, base, j, d), _q3_k_scale(raw, base, j + 1, d)
            d1a, d1b = _q3_k_scale(raw, base, j + 2, d), _q3_k_scale(raw, base, j + 3, d)
            d2a, d2b = _q3_k_scale(raw, base, j + 4, d), _q3_k_scale(raw, base, j + 5, d)
            d3a, d3b = _q3_k_scale(raw, base, j + 6, d), _q3_k_scale(raw, base, j + 7, d)
            for i in range(2 * lanes):
                first, q, m = i < lanes, raw[at + i], raw[base + i]
                s = 4 * h
                out[to + i] = _pick(first, d0a, d0b) * _q3_k_quant(_f(q, 0, 3), _f(m, s, 1))
                out[to + 32 + i] = _pick(first, d1a, d1b) * _q3_k_quant(
                    _f(q, 2, 3), _f(m, s + 1, 1)
                )
                out[to + 64 + i] = _pick(first, d2a, d2b) * _q3_k_quant(
                    _f(q, 4, 3), _f(m, s + 2, 1)
                )
                out[to + 96 + i] = _pick(first, d3a, d3b) * _q3_k_quant(
                    _f(q, 6, 3), _f(m, s + 3, 1)
                )


@numba.njit(cache=True, inline="always")
def _k_scale_min(raw, at, j):  # pragma: no cover - compiled
    """Q4_K's / Q5_K's 6-bit scale and min of sub-block ``j`` from the 12 bytes at ``at``."""
    if j < 4:
        return _f(raw[at + j], 0, 63), _f(raw[at + j + 4], 0, 63)
    scale = _i(raw[at + j + 4], 0, 15) + 16 * _i(raw[at + j - 4], 6, 3)
    minimum = _i(raw[at + j + 4], 4, 15) + 16 * _i(raw[at + j], 6, 3)
    return np.float32(scale), np.float32(minimum)


@numba.njit(cache=True)
def _q45_k(raw, out, lanes, fifth_bit):  # pragma: no cover - compiled
    """Q4_K, and Q5_K (``fifth_bit``: weight ``32 j + l``'s fifth bit is bit ``j`` of
    ``qh[l]``): run ``c``'s 32 bytes hold sub-block ``2c`` in their low nibbles and ``2c + 1``
    in their high ones, one loop writes both."""
    size, qs = (176, 48) if fifth_bit else (144, 16)
    for b in range(out.shape[0] // 256):
        base, o = size * b, 256 * b
        d, dmin = _fp16(raw, base), _fp16(raw, base + 2)
        for c in range(4):
            s0, m0 = _k_scale_min(raw, base + 4, 2 * c)
            s1, m1 = _k_scale_min(raw, base + 4, 2 * c + 1)
            d0, d1, m0, m1 = d * s0, d * s1, dmin * m0, dmin * m1
            at, to = base + qs + 32 * c, o + 64 * c
            for j in range(2 * lanes):
                lo, hi = _f(raw[at + j], 0, 15), _f(raw[at + j], 4, 15)
                if fifth_bit:
                    lo += np.float32(16.0) * _f(raw[base + 16 + j], 2 * c, 1)
                    hi += np.float32(16.0) * _f(raw[base + 16 + j], 2 * c + 1, 1)
                out[to + j] = d0 * lo - m0
                out[to + 32 + j] = d1 * hi - m1


@numba.njit(cache=True, inline="always")
def _q6_k_scales(raw, at, d):  # pragma: no cover - compiled
    return d * np.float32(np.int8(raw[at])), d * np.float32(np.int8(raw[at + 1]))


@numba.njit(cache=True, inline="always")
def _q6_k_quant(low, high):  # pragma: no cover - compiled
    """``q - 32`` from its low four and high two bits (exact in fp32)."""
    return low + np.float32(16.0) * high - np.float32(32.0)


@numba.njit(cache=True)
def _q6_k(raw, out, lanes):  # pragma: no cover - compiled
    """Per 128-weight half ``h``, byte ``l`` of its 32 ``qh`` bytes and bytes ``l``, ``l + 32``
    of its 64 ``ql`` bytes give weights ``l``, ``32 + l``, ``64 + l``, ``96 + l``: one loop
    over the 32 writes all four; scale ``8 h + 2 g + t`` per 16 weights."""
    for b in range(out.shape[0] // 256):
        base, o = 210 * b, 256 * b
        d = _fp16(raw, base + 208)
        for h in range(2):
            lo_at, hi_at, to, sc = base + 64 * h, base + 128 + 32 * h, o + 128 * h, base + 192
            d0a, d0b = _q6_k_scales(raw, sc + 8 * h, d)
            d1a, d1b = _q6_k_scales(raw, sc + 8 * h + 2, d)
            d2a, d2b = _q6_k_scales(raw, sc + 8 * h + 4, d)
            d3a, d3b = _q6_k_scales(raw, sc + 8 * h + 6, d)
            for j in range(2 * lanes):
                first, a, c, q = j < lanes, raw[lo_at + j], raw[lo_at + 32 + j], raw[hi_at + j]
                out[to + j] = _pick(first, d0a, d0b) * _q6_k_quant(_f(a, 0, 15), _f(q, 0, 3))
                out[to + 32 + j] = _pick(first, d1a, d1b) * _q6_k_quant(_f(c, 0, 15), _f(q, 2, 3))
                out[to + 64 + j] = _pick(first, d2a, d2b) * _q6_k_quant(_f(a, 4, 15), _f(q, 4, 3))
                out[to + 96 + j] = _pick(first, d3a, d3b) * _q6_k_quant(_f(c, 4, 15), _f(q, 6, 3))


@numba.njit(cache=True)
def _iq4_xs(raw, out, lanes):  # pragma: no cover - compiled
    for b in range(out.shape[0] // 256):
        base, o = 136 * b, 256 * b
        d = _fp16(raw, base)
        high_bits = np.uint32(raw[base + 2]) | (np.uint32(raw[base + 3]) << np.uint32(8))
        for j in range(8):
            scale = _i(raw[base + 4 + j // 2], 4 * (j % 2), 15) + 16 * _i(high_bits, 2 * j, 3)
            dl = d * np.float32(scale - 32)
            at, to = base + 8 + 16 * j, o + 32 * j
            for i in range(lanes):
                out[to + i] = dl * _LEVELS[_i(raw[at + i], 0, 15)]
                out[to + i + 16] = dl * _LEVELS[_i(raw[at + i], 4, 15)]


@numba.njit(cache=True)
def decode_row(raw, qtype, out, lanes):  # pragma: no cover - compiled
    """``out[:] =`` the fp32 weights of one row of GGUF blocks ``raw`` of type ``qtype``
    (``len(out)`` weights; every type but F32, which the GEMM reads as it is). ``lanes``: 16
    (module doc)."""
    if qtype == Q8_0:
        _q8_0(raw, out, lanes)
    elif qtype == Q4_0 or qtype == Q4_1:
        _q4(raw, out, lanes, qtype == Q4_1)
    elif qtype == Q5_0 or qtype == Q5_1:
        _q5(raw, out, lanes, qtype == Q5_1)
    elif qtype == IQ4_NL:
        _iq4_nl(raw, out, lanes)
    elif qtype == Q2_K:
        _q2_k(raw, out, lanes)
    elif qtype == Q3_K:
        _q3_k(raw, out, lanes)
    elif qtype == Q4_K or qtype == Q5_K:
        _q45_k(raw, out, lanes, qtype == Q5_K)
    elif qtype == Q6_K:
        _q6_k(raw, out, lanes)
    elif qtype == IQ4_XS:
        _iq4_xs(raw, out, lanes)
    else:
        _halves(raw, qtype, out, lanes)
