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

Why one file: ``decode_row`` picks a decoder by type id inside compiled code, so every
decoder it can pick (the file's types and the rows pagedserve writes at load for 8-bit and
4-bit group weights) is compiled beside it, with the bit-field helpers they share.
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
# Not ggml types (theirs are >= 0): rows of one byte a weight, the 8-bit weights pagedserve
# quantizes at load (kernels/weight_only_linear.py; their per-channel scale is applied after
# the dot, cpu/weight_only_linear.py), decoded by the same GEMM as the file's blocks.
INT8_ROWS, E4M3_ROWS = -1, -2
# Not a ggml type either: a row of 4-bit groups, AWQ / GPTQ weights as a CPU holds them
# (cpu/int4_linear.py writes the rows at load; ``_int4_groups`` has the layout).
INT4_GROUPS = -3
_E4M3_BIAS = np.float32(2.0**120)  # fp32's exponent bias (127) less e4m3's (7)


def _load(context, builder, signature, args, kind):
    """The little-endian ``kind`` (an LLVM type) at byte ``args[1]`` of the array ``args[0]``,
    wherever it is aligned."""
    data = context.make_array(signature.args[0])(context, builder, args[0]).data
    at = builder.bitcast(builder.gep(data, [args[1]]), ir.PointerType(kind))
    return builder.load(at, align=1)


@intrinsic
def _fp16(typingctx, raw, i):
    """The fp16 at byte ``i`` of ``raw``, widened to fp32 (exact; one or two instructions
    where the CPU converts halves)."""

    def codegen(context, builder, signature, args):
        return builder.fpext(
            _load(context, builder, signature, args, ir.HalfType()), ir.FloatType()
        )

    return types.float32(raw, i), codegen


@intrinsic
def _fp32(typingctx, raw, i):
    """The fp32 at byte ``i`` of ``raw``."""

    def codegen(context, builder, signature, args):
        return _load(context, builder, signature, args, ir.FloatType())

    return types.float32(raw, i), codegen


@intrinsic
def _int32(typingctx, raw, i):
    """The int32 at byte ``i`` of ``raw``."""

    def codegen(context, builder, signature, args):
        return _load(context, builder, signature, args, ir.IntType(32))

    return types.int32(raw, i), codegen


@intrinsic
def _fp32_of_bits(typingctx, bits):
    """The fp32 whose bits are the low 32 of the integer ``bits`` (a register move, no
    memory: so a decoder can scale what it built in the same loop)."""

    def codegen(context, builder, signature, args):
        value = args[0]
        if value.type.width != 32:
            value = builder.trunc(value, ir.IntType(32))
        return builder.bitcast(value, ir.FloatType())

    return types.float32(bits), codegen


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


@intrinsic
def _two_fields(typingctx, low, low_shift, low_mask, high, high_shift, high_mask, at):
    """``((low >> low_shift) & low_mask) | (((high >> high_shift) & high_mask) << at)`` in
    32-bit arithmetic, as an int32: a quant from its low bits and its high bits."""

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        lo, ls, lm, hi, hs, hm, at = (
            builder.zext(a, i32) if a.type.width < 32 else builder.trunc(a, i32) for a in args
        )
        bits = builder.and_(builder.lshr(lo, ls), lm)
        return builder.or_(bits, builder.shl(builder.and_(builder.lshr(hi, hs), hm), at))

    signature = types.int32(low, low_shift, low_mask, high, high_shift, high_mask, at)
    return signature, codegen


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
def _bytes(raw, qtype, out, lanes):  # pragma: no cover - compiled
    """``INT8_ROWS`` (a signed byte a weight) and ``E4M3_ROWS`` (an fp8 e4m3fn byte). An e4m3
    byte's exponent and mantissa bits, moved to fp32's places (``<< 20``) with its sign, are
    an fp32 whose exponent is biased by 127 instead of 7: times 2^120 it is the byte's value,
    exactly, subnormals included (there fp32's subnormal scaled up). A table lookup instead
    is a gather per weight: with it SmolLM2's fp8 decode step took 2.4x int8's (29.7 against
    12.4 ms, 2-core AMD EPYC VM, quiet; not measured on the Intel VM); one pass, the bits built
    and scaled in a register (``_fp32_of_bits``), takes 12.0 against int8's 12.1 ms where two
    passes over the buffer took 15.2 against 12.4 (the same VM, quiet; no busy neighbour). Finite bytes only:
    0x7f / 0xff (NaN) are never written (weight_only_linear.py)."""
    if qtype == INT8_ROWS:
        for k in range(out.shape[0]):
            out[k] = np.float32(np.int8(raw[k]))
    else:
        for k in range(out.shape[0]):
            bits = (_bits(raw[k], 0, 127) << 20) | (_bits(raw[k], 7, 1) << 31)
            out[k] = _fp32_of_bits(bits) * _E4M3_BIAS


@numba.njit(cache=True)
def _int4_groups(raw, out, lanes):  # pragma: no cover - compiled
    """``INT4_GROUPS``: the group size ``S`` (int32), the ``G = ceil(K / S)`` groups' fp32
    scales, their zero points (a byte each, 0..16), then each group's weights two to a byte:
    byte ``j`` of a group of ``n`` weights holds weight ``j`` in its low nibble and ``j + n / 2``
    in its high one (as Q4_0 holds its 32), so one loop over the group's bytes writes both
    halves under one scale. ``(q - zero) * scale``, in that order: the reference's
    (kernels/int4_linear.py ``dequantize_int4``), bit for bit. The loop runs over slices, not
    offsets into the row: indexed from offsets it was not vectorized (8x slower on the AMD
    VM, one thread, quiet; not measured on the Intel VM)."""
    k = out.shape[0]
    size = np.int64(_int32(raw, 0))
    groups = (k + size - 1) // size
    zeros_at, nibbles_at = 4 + 4 * groups, 4 + 5 * groups
    for g in range(groups):
        first = g * size
        half = min(size, k - first) // 2
        scale, zero = _fp32(raw, 4 + 4 * g), np.float32(raw[zeros_at + g])
        at = nibbles_at + first // 2
        low, high, src = (
            out[first : first + half],
            out[first + half : first + 2 * half],
            raw[at : at + half],
        )
        for j in range(half):
            low[j] = (_f(src[j], 0, 15) - zero) * scale
            high[j] = (_f(src[j], 4, 15) - zero) * scale


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
    """Q5_0 (``d * (q - 16)``) and Q5_1 (``with_min``: ``d * q + m``)."""
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
            lo = np.float32(_two_fields(raw[at + j], 0, 15, high, j, 1, 4)) - bias
            hi = np.float32(_two_fields(raw[at + j], 4, 15, high, j + 16, 1, 4)) - bias
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
def _q2_k_scale(raw, at, d, dmin):  # pragma: no cover - compiled
    """Q2_K's 16-weight sub-block from its byte at ``at``: ``d * scale`` and ``dmin * min``."""
    return d * _f(raw[at], 0, 15), dmin * _f(raw[at], 4, 15)


@numba.njit(cache=True)
def _q2_k(raw, out, lanes):  # pragma: no cover - compiled
    """Per 128-weight half ``h`` and 16-byte quarter ``t`` of its 32 bytes: byte ``l`` holds
    weight ``32 s + l`` in bits ``2s, 2s + 1``; one loop writes all four, each under its own
    sub-block's scale and min (``8 h + 2 s + t``, fixed for the loop, as in ``_q6_k``)."""
    for b in range(out.shape[0] // 256):
        base, o = 84 * b, 256 * b
        d, dmin = _fp16(raw, base + 80), _fp16(raw, base + 82)
        for h in range(2):
            for t in range(2):
                at, to, sc = base + 16 + 32 * h + 16 * t, o + 128 * h + 16 * t, base + 8 * h + t
                d0, m0 = _q2_k_scale(raw, sc, d, dmin)
                d1, m1 = _q2_k_scale(raw, sc + 2, d, dmin)
                d2, m2 = _q2_k_scale(raw, sc + 4, d, dmin)
                d3, m3 = _q2_k_scale(raw, sc + 6, d, dmin)
                for j in range(lanes):
                    q = raw[at + j]
                    out[to + j] = d0 * _f(q, 0, 3) - m0
                    out[to + 32 + j] = d1 * _f(q, 2, 3) - m1
                    out[to + 64 + j] = d2 * _f(q, 4, 3) - m2
                    out[to + 96 + j] = d3 * _f(q, 6, 3) - m3


@numba.njit(cache=True, inline="always")
def _q3_k_scale(raw, base, j, d):  # pragma: no cover - compiled
    """``d *`` Q3_K's signed 6-bit scale ``j`` (0..15) of the block at ``base``."""
    low = _i(raw[base + 96 + j % 8], 4 * (j // 8), 15)
    high = _i(raw[base + 104 + j % 4], 2 * (j // 4), 3)
    return d * np.float32(low + 16 * high - 32)


@numba.njit(cache=True, inline="always")
def _q3_k_quant(q, shift, mask, bit):  # pragma: no cover - compiled
    """``low - 4 + 4 * high`` (exact in fp32): two low bits of ``q`` from ``shift``, the high
    one bit ``bit`` of the hmask byte ``mask``."""
    return np.float32(_two_fields(q, shift, 3, mask, bit, 1, 2)) - np.float32(4.0)


@numba.njit(cache=True)
def _q3_k(raw, out, lanes):  # pragma: no cover - compiled
    """As Q2_K's quarters; weight ``e``'s high bit is bit ``e / 32`` of ``hmask[e % 32]``."""
    for b in range(out.shape[0] // 256):
        base, o = 110 * b, 256 * b
        d = _fp16(raw, base + 108)
        for h in range(2):
            for t in range(2):
                at, to, j, s = base + 32 + 32 * h + 16 * t, o + 128 * h + 16 * t, 8 * h + t, 4 * h
                d0, d1 = _q3_k_scale(raw, base, j, d), _q3_k_scale(raw, base, j + 2, d)
                d2, d3 = _q3_k_scale(raw, base, j + 4, d), _q3_k_scale(raw, base, j + 6, d)
                for i in range(lanes):
                    q, m = raw[at + i], raw[base + 16 * t + i]
                    out[to + i] = d0 * _q3_k_quant(q, 0, m, s)
                    out[to + 32 + i] = d1 * _q3_k_quant(q, 2, m, s + 1)
                    out[to + 64 + i] = d2 * _q3_k_quant(q, 4, m, s + 2)
                    out[to + 96 + i] = d3 * _q3_k_quant(q, 6, m, s + 3)


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
            if fifth_bit:
                for j in range(2 * lanes):
                    qh = raw[base + 16 + j]
                    lo = np.float32(_two_fields(raw[at + j], 0, 15, qh, 2 * c, 1, 4))
                    hi = np.float32(_two_fields(raw[at + j], 4, 15, qh, 2 * c + 1, 1, 4))
                    out[to + j], out[to + 32 + j] = d0 * lo - m0, d1 * hi - m1
            else:
                for j in range(2 * lanes):
                    lo, hi = _f(raw[at + j], 0, 15), _f(raw[at + j], 4, 15)
                    out[to + j], out[to + 32 + j] = d0 * lo - m0, d1 * hi - m1


@numba.njit(cache=True, inline="always")
def _q6_k_scale(raw, at, d):  # pragma: no cover - compiled
    return d * np.float32(np.int8(raw[at]))


@numba.njit(cache=True, inline="always")
def _q6_k_quant(low, low_shift, high, high_shift):  # pragma: no cover - compiled
    """``q - 32`` from its low four and high two bits (exact in fp32)."""
    return np.float32(_two_fields(low, low_shift, 15, high, high_shift, 3, 4)) - np.float32(32.0)


@numba.njit(cache=True)
def _q6_k(raw, out, lanes):  # pragma: no cover - compiled
    """Per 128-weight half ``h`` and 16-weight quarter ``t`` of its runs: byte ``l`` of the
    half's ``qh`` and bytes ``l``, ``l + 32`` of its ``ql`` give weights ``l``, ``32 + l``,
    ``64 + l``, ``96 + l`` (``l = 16 t + j``), one loop writes all four, each under its own
    scale (``8 h + 2 g + t``, fixed for the loop: a select inside it would be sunk by LLVM
    below the scale's conversion, redone per weight)."""
    for b in range(out.shape[0] // 256):
        base, o = 210 * b, 256 * b
        d = _fp16(raw, base + 208)
        for h in range(2):
            for t in range(2):
                at, sc = 16 * t, base + 192 + 8 * h + t
                lo_at, hi_at, to = base + 64 * h + at, base + 128 + 32 * h + at, o + 128 * h + at
                d0, d1 = _q6_k_scale(raw, sc, d), _q6_k_scale(raw, sc + 2, d)
                d2, d3 = _q6_k_scale(raw, sc + 4, d), _q6_k_scale(raw, sc + 6, d)
                for j in range(lanes):
                    a, c, q = raw[lo_at + j], raw[lo_at + 32 + j], raw[hi_at + j]
                    out[to + j] = d0 * _q6_k_quant(a, 0, q, 0)
                    out[to + 32 + j] = d1 * _q6_k_quant(c, 0, q, 2)
                    out[to + 64 + j] = d2 * _q6_k_quant(a, 4, q, 4)
                    out[to + 96 + j] = d3 * _q6_k_quant(c, 4, q, 6)


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
    (``len(out)`` weights; every type but F32, which the GEMM reads as it is; or one of the
    rows pagedserve writes at load: ``INT8_ROWS``, ``E4M3_ROWS``, ``INT4_GROUPS``). ``lanes``:
    16 (module doc)."""
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
    elif qtype == INT4_GROUPS:
        _int4_groups(raw, out, lanes)
    elif qtype < 0:
        _bytes(raw, qtype, out, lanes)
    else:
        _halves(raw, qtype, out, lanes)
