"""A GGUF row of blocks dotted with activations rounded to 16-bit integers, compiled with numba:
the decode GEMM's inner product (cpu/gguf_linear.py) for the types whose weights are small
integers under a block's scales (``INTEGER_TYPES``: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K).

**Why integers.** Decoding a block to fp32 costs more than the dot that follows: a Q4_K weight
is a shift, a mask, a conversion, a multiply and a subtract before its one FMA (about 7 G
weights a second per thread, the same from cache as from memory, so a 1B model's decode step
was arithmetic, not bandwidth). llama.cpp rounds each block of activations to 8-bit integers
and sums ``q * x`` products in integer registers; a block's scales then multiply a sum, not
every weight. Here the same, with choices of our own:

- **16-bit activations, not 8.** Each group of ``GROUP`` (32) activations is rounded to
  ``round(x / dx)`` with ``dx = max|x| / ACTIVATION_MAX``: an element's error is at most
  ``dx / 2``, ``1.5e-5`` of its group's largest (8 bits would be 256 times coarser). Where a
  group holds one large activation its small ones round coarsely: SmolLM2's Q4_1 prompt
  log-probabilities move by up to 6e-4 (tests/models/test_gguf.py); its greedy tokens stay
  those of transformers on the dequantized weights.
- **``vpmaddwd`` from portable IR.** A 4- to 8-bit quant times a 16-bit activation, adjacent
  products added in pairs into 32 bits, is what ``vpmaddwd`` does (16 products an instruction
  on AVX2, 32 on AVX-512). The dots are written as plain LLVM vector operations (load, shift,
  mask, widen, multiply, pairwise add) through numba intrinsics, and LLVM picks the
  instruction itself; no x86 intrinsic is named, so another CPU still gets vector code.
  numba's own loops would widen every integer to 64 bits.
- **Layouts as data.** Each type's block is a list of ``Run`` s (where a run's quant bits
  live, which activations and which scale it meets); ``_block_dots`` turns a list into an
  intrinsic. The 32-weight types are dotted eight blocks a call, so every call sums one fp32
  vector once per 256 weights.
- **Four rows a call.** A call unpacks its blocks' scales (vector code, in the intrinsic)
  and decodes each run's quants once, and dots them with four rows of activations (then one
  a call for the rest), so a decode step of 16 sequences does not decode its weights 16
  times.

**Exact, then rounded in a fixed order.** A pair of products is exact in 32 bits and in fp32
(at most ``2 * 2^7 * 2^15 < 2^24``); each run's pairs are scaled (``scale * dx``) and added lane by
lane, and the lanes summed in a fixed tree, the minimums' share subtracted last. Every row
meets the same operations whichever rows share its call and whichever thread runs it, so a
row's result does not depend on its batch (the batch-invariant mode's promise, kept by the
GEMM whatever the mode). No multiply and add are contracted into an FMA: LLVM would contract
some and not others depending on the surrounding code (a row alone and among four differed
in their last bit when it was allowed, by ``contract`` flags or by being inlined into a
fast-math function; cpu/gguf_linear.py calls this path from functions without fast-math).

How far from the reference: for an output, at most ``sum |w| * dx / 2`` over its weights plus
fp32's rounding; and exactly the reference's product (to fp32's rounding) where the
activations are on the 16-bit grid (kernels/test_gguf_linear_numba.py holds both).

Measured (AMD EPYC VM with AVX-512, one thread, a 1B Llama's layers, `tools/bench_gguf_cpu.py
--model llama-1b --layers 2`; docs/benchmarks.md): 1.3-2.1x the fp32-decoding GEMM's speed
at one row, 0.9-1.2x at sixteen (not measured on the Intel VM nor beside a busy neighbour).

Why one file: the layouts, the intrinsic each compiles to, and the loops that choose one by
type id are one mechanism; numba compiles every layout into the loops.
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from pagedserve.kernels.cpu import numba_cache  # noqa: F401  (before any cached @njit)
from pagedserve.kernels.gguf_dequant import GGUF_TYPE_IDS

Q4_0, Q4_1, Q8_0 = GGUF_TYPE_IDS["Q4_0"], GGUF_TYPE_IDS["Q4_1"], GGUF_TYPE_IDS["Q8_0"]
Q4_K, Q5_K, Q6_K = GGUF_TYPE_IDS["Q4_K"], GGUF_TYPE_IDS["Q5_K"], GGUF_TYPE_IDS["Q6_K"]
INTEGER_TYPES = (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K)
ACTIVATION_MAX = 32767  # the largest 16-bit integer an activation is rounded to
GROUP = 32  # activations rounded together, under one step


class Run(NamedTuple):
    """``width`` consecutive quants of a block under one scale (or two, one per half): quant
    ``l`` is ``((raw[low + l] >> shift) & 15) | (((raw[high + l] >> high_shift) & high_mask)
    << 4)``, less
    ``offset`` (``signed``: the int8 ``raw[low + l]`` itself, Q8_0's), and multiplies activation
    ``x + l``; its scale is the layout's ``scale``-th (``second_scale``, when set: for the
    second half of the run) times the activations' step ``dx[row, g0 + group]``. Offsets are
    from the call's first byte and first activation."""

    low: int
    x: int
    scale: int
    shift: int = 0
    high: int = 0
    high_shift: int = 0
    high_mask: int = 0
    offset: int = 0
    width: int = 32
    signed: bool = False
    group: int = 0
    second_scale: int = -1


def _i64(value):
    return ir.Constant(ir.IntType(64), value)


def _element_at(context, builder, array_type, array, row, column, vector_type=None):
    """A pointer to ``array[row, column]`` of a C-contiguous 2-D array (``row`` None: the 1-D
    ``array[column]``), cast to ``vector_type``'s when given. Addressed here: a view of the
    row would be reference-counted on every call."""
    parts = context.make_array(array_type)(context, builder, array)
    at = column
    if row is not None:
        at = builder.add(builder.mul(row, builder.extract_value(parts.shape, 1)), column)
    pointer = builder.gep(parts.data, [at])
    return pointer if vector_type is None else builder.bitcast(pointer, ir.PointerType(vector_type))


def _lanes(builder, vector, picks):
    """The vector of ``vector``'s lanes ``picks``."""
    indices = ir.Constant(ir.VectorType(ir.IntType(32), len(picks)), list(picks))
    return builder.shuffle_vector(vector, vector, indices)


def _quants(block, builder, run):
    """A run's quants, as a vector of 32-bit integers."""
    width = run.width
    wide = ir.VectorType(ir.IntType(32), width)

    def splat(value):
        return ir.Constant(ir.VectorType(ir.IntType(8), width), [value] * width)

    low = block.bytes(run.low, width)
    if run.signed:
        return builder.sext(low, wide)
    quants = builder.and_(builder.lshr(low, splat(run.shift)), splat(15))
    if run.high_mask:
        high = builder.lshr(block.bytes(run.high, width), splat(run.high_shift))
        quants = builder.or_(
            quants, builder.shl(builder.and_(high, splat(run.high_mask)), splat(4))
        )
    quants = builder.zext(quants, wide)
    if run.offset:
        quants = builder.sub(quants, ir.Constant(wide, [run.offset] * width))
    return quants


def _row_sum(builder, total):
    """The lanes of ``total`` added in a fixed tree (so a row's result is the same bits
    whatever rows share the call)."""
    lanes = total.type.count
    while lanes > 1:
        lanes //= 2
        total = builder.fadd(
            _lanes(builder, total, range(lanes)), _lanes(builder, total, range(lanes, 2 * lanes))
        )
    return builder.extract_element(total, ir.Constant(ir.IntType(32), 0))


def _floats(width):
    """The fp32 vector of a run's pairs: half its width."""
    return ir.VectorType(ir.FloatType(), width // 2)


class _Block:
    """Reads the bytes of a call's blocks in LLVM IR, from byte ``base`` of the 1-D ``raw``."""

    def __init__(self, context, builder, raw_type, raw, base):
        self.context, self.builder = context, builder
        self.raw_type, self.raw, self.base = raw_type, raw, base

    def bytes(self, offset, count):
        """``count`` bytes from ``offset``, as a vector of ``i8``."""
        at = self.builder.add(self.base, _i64(offset))
        vector = ir.VectorType(ir.IntType(8), count)
        pointer = _element_at(self.context, self.builder, self.raw_type, self.raw, None, at, vector)
        return self.builder.load(pointer, align=1)

    def half(self, offset):
        """The fp16 at ``offset``, widened to fp32 (exact)."""
        at = self.builder.add(self.base, _i64(offset))
        pointer = _element_at(self.context, self.builder, self.raw_type, self.raw, None, at)
        pointer = self.builder.bitcast(pointer, ir.PointerType(ir.HalfType()))
        return self.builder.fpext(self.builder.load(pointer, align=1), ir.FloatType())


def _splat_float(builder, value, count):
    vector = ir.VectorType(ir.FloatType(), count)
    one = builder.insert_element(ir.Constant(vector, None), value, ir.Constant(ir.IntType(32), 0))
    return _lanes(builder, one, [0] * count)


def _lanes_of(builder, vector):
    """A vector's lanes, as a list of scalars."""
    i32 = ir.IntType(32)
    return [builder.extract_element(vector, ir.Constant(i32, i)) for i in range(vector.type.count)]


def _k_scales(block, builder):
    """Q4_K's / Q5_K's eight 6-bit scales and minimums (the 12 bytes at 4, unpacked as
    cpu/gguf_blocks.py's ``_k_scale_min``, eight lanes at once), times ``d`` and ``dmin``.
    Sub-blocks 0-3 keep six bits of bytes 0-3 (scales) and 4-7 (minimums); 4-7 take four bits
    of bytes 8-11 and their top two from the top bits of bytes 0-3 and 4-7."""
    i8x8 = ir.VectorType(ir.IntType(8), 8)
    raw = block.bytes(4, 16)  # 12 used; the block goes on past them
    zero = ir.Constant(ir.VectorType(ir.IntType(8), 16), [0] * 16)

    def pick(lanes):  # lane 16: a zero byte
        return builder.shuffle_vector(
            raw, zero, ir.Constant(ir.VectorType(ir.IntType(32), 8), lanes)
        )

    def const(values):
        return ir.Constant(i8x8, values)

    six_or_four = const([63] * 4 + [15] * 4)
    top_bits = [16] * 4
    scales = builder.or_(
        builder.and_(pick([0, 1, 2, 3, 8, 9, 10, 11]), six_or_four),
        builder.shl(builder.lshr(pick(top_bits + [0, 1, 2, 3]), const([6] * 8)), const([4] * 8)),
    )
    low_mins = builder.lshr(pick([4, 5, 6, 7, 8, 9, 10, 11]), const([0] * 4 + [4] * 4))
    mins = builder.or_(
        builder.and_(low_mins, six_or_four),
        builder.shl(builder.lshr(pick(top_bits + [4, 5, 6, 7]), const([6] * 8)), const([4] * 8)),
    )
    floats = ir.VectorType(ir.FloatType(), 8)
    d, dmin = _splat_float(builder, block.half(0), 8), _splat_float(builder, block.half(2), 8)
    scales = builder.fmul(d, builder.uitofp(scales, floats))
    mins = builder.fmul(dmin, builder.uitofp(mins, floats))
    return _lanes_of(builder, scales), _lanes_of(builder, mins)


def _q6_k_scales(block, builder):
    """Q6_K's sixteen int8 scales at 192, times ``d`` (at 208); no minimums."""
    floats = ir.VectorType(ir.FloatType(), 16)
    scales = builder.sitofp(block.bytes(192, 16), floats)
    return _lanes_of(builder, builder.fmul(_splat_float(builder, block.half(208), 16), scales)), []


def _block_d_scales(size, count, with_min):
    """Scales of ``count`` 32-weight blocks of ``size`` bytes: each block's ``d`` (its first two
    bytes); ``with_min`` (Q4_1): minimums ``-m`` (the next two), which the dots subtract."""

    def scales(block, builder):
        ds = [block.half(size * k) for k in range(count)]
        if not with_min:
            return ds, []
        return ds, [builder.fneg(block.half(size * k + 2)) for k in range(count)]

    return scales


def _scale_lanes(context, builder, signature, args, run, row, scales):
    """The run's scale times its activations' step ``dx[row, g0 + run.group]``, in every lane
    (``second_scale``: in the second half's lanes)."""
    lanes = run.width // 2
    step_at = builder.add(args[7], _i64(run.group))
    step = builder.load(_element_at(context, builder, signature.args[3], args[3], row, step_at))
    first = builder.fmul(scales[run.scale], step)
    vector = builder.insert_element(
        ir.Constant(_floats(run.width), None), first, ir.Constant(ir.IntType(32), 0)
    )
    if run.second_scale < 0:
        return _lanes(builder, vector, [0] * lanes)
    second = builder.fmul(scales[run.second_scale], step)
    vector = builder.insert_element(vector, second, ir.Constant(ir.IntType(32), 1))
    return _lanes(builder, vector, [0] * (lanes // 2) + [1] * (lanes // 2))


def _row_term(context, builder, signature, args, quants, run, row, total, scales):
    """``total +`` the run's products with one row, in pairs, under its scale. A multiply
    and an add, never contracted into one FMA: LLVM contracts where it can, and where it
    can depends on what surrounds a row (measured: a row alone and among four differed in
    its last bit)."""
    column = builder.add(args[6], _i64(run.x))
    vector = ir.VectorType(ir.IntType(16), run.width)
    x = builder.load(
        _element_at(context, builder, signature.args[2], args[2], row, column, vector), align=2
    )
    products = builder.mul(quants, builder.sext(x, quants.type))
    pairs = builder.add(
        _lanes(builder, products, range(0, run.width, 2)),
        _lanes(builder, products, range(1, run.width, 2)),
    )
    scaled = builder.fmul(
        builder.sitofp(pairs, _floats(run.width)),
        _scale_lanes(context, builder, signature, args, run, row, scales),
    )
    return builder.fadd(total, scaled)


def _minimums(context, builder, signature, args, row, mins):
    """``sum over g of mins[g] * dx[row, g0 + g] * sums[row, g0 + g]`` (``mins`` a vector),
    in a fixed tree."""
    count = mins.type.count
    groups = ir.VectorType(ir.FloatType(), count)
    g0 = args[7]
    steps = builder.load(
        _element_at(context, builder, signature.args[3], args[3], row, g0, groups), align=4
    )
    counts = ir.VectorType(ir.IntType(32), count)
    sums = builder.load(
        _element_at(context, builder, signature.args[4], args[4], row, g0, counts), align=4
    )
    terms = builder.fmul(builder.fmul(mins, steps), builder.sitofp(sums, groups))
    return _row_sum(builder, terms)


def _as_vector(builder, values):
    vector = ir.Constant(ir.VectorType(ir.FloatType(), len(values)), None)
    for i, value in enumerate(values):
        vector = builder.insert_element(vector, value, ir.Constant(ir.IntType(32), i))
    return vector


def _block_dots(runs, block_scales):
    """An intrinsic for one layout ``runs`` (one block, or several side by side) whose scales
    ``block_scales(block, builder)`` reads (a list of fp32 scales by ``run.scale``, and of
    minimums by activation group, empty for the types without):
    ``block_dots(raw, base, xq, dx, sums, rows, xat, g0)`` is, for each row of the tuple
    ``rows``, ``sum over runs of scale[run.scale] * dx[row, g0 + run.group] * sum_l q_l *
    xq[row, xat + run.x + l]`` in fp32, the blocks starting at byte ``base`` of ``raw``, less
    ``sum over g of mins[g] * dx[row, g0 + g] * sums[row, g0 + g]``.

    The scales and each run's quants are decoded once for all the rows. Per row: the quants
    and 16-bit activations widened to 32 bits and multiplied, adjacent products added in pairs
    (the shape LLVM turns into ``vpmaddwd``; exact, and exact in fp32: two products of at
    most ``2^7 * 2^15`` each), the pairs converted to fp32 and accumulated lane by lane under the
    run's scale; the lanes are summed once per call (``_row_sum``), the minimums' share
    subtracted last. A row's operations do not depend on the other rows of the call."""
    width = runs[0].width
    assert all(run.width == width for run in runs)
    floats = _floats(width)

    @intrinsic
    def block_dots(typingctx, raw, base, xq, dx, sums, rows, xat, g0):
        count = rows.count

        def codegen(context, builder, signature, args):
            block = _Block(context, builder, signature.args[0], args[0], args[1])
            scales, mins = block_scales(block, builder)
            row_values = [builder.extract_value(args[5], i) for i in range(count)]
            totals = [ir.Constant(floats, [0.0] * (width // 2))] * count
            for run in runs:
                quants = _quants(block, builder, run)
                for i, row in enumerate(row_values):
                    totals[i] = _row_term(
                        context, builder, signature, args, quants, run, row, totals[i], scales
                    )
            results = [_row_sum(builder, total) for total in totals]
            if mins:
                vector = _as_vector(builder, mins)
                results = [
                    builder.fsub(result, _minimums(context, builder, signature, args, row, vector))
                    for result, row in zip(results, row_values)
                ]
            return context.make_tuple(builder, signature.return_type, results)

        result = types.UniTuple(types.float32, count)
        return result(raw, base, xq, dx, sums, rows, xat, g0), codegen

    return block_dots


# The block layouts (gguf_dequant.py documents them) as runs of quants under one scale. The
# 32-weight types come one block a call and eight blocks a call (one reduction per 256).
def _blocks(size, runs, count):
    """``count`` blocks of ``size`` bytes side by side, block ``k``'s runs under scale and
    activation group ``k``."""
    return [
        run._replace(
            low=run.low + size * k, high=run.high + size * k, x=run.x + 32 * k, scale=k, group=k
        )
        for k in range(count)
        for run in runs
    ]


_Q8_0_RUNS = [Run(low=2, x=0, scale=0, signed=True)]
_Q4_0_RUNS = [Run(2, 0, 0, width=16, offset=8), Run(2, 16, 0, shift=4, width=16, offset=8)]
_Q4_1_RUNS = [Run(4, 0, 0, width=16), Run(4, 16, 0, shift=4, width=16)]
GROUPED = 8  # 32-weight blocks per call when at least that many are left
_Q8_0 = _block_dots(_Q8_0_RUNS, _block_d_scales(34, 1, False))
_Q8_0_GROUPED = _block_dots(_blocks(34, _Q8_0_RUNS, GROUPED), _block_d_scales(34, GROUPED, False))
_Q4_0 = _block_dots(_Q4_0_RUNS, _block_d_scales(18, 1, False))
_Q4_0_GROUPED = _block_dots(_blocks(18, _Q4_0_RUNS, GROUPED), _block_d_scales(18, GROUPED, False))
_Q4_1 = _block_dots(_Q4_1_RUNS, _block_d_scales(20, 1, True))
_Q4_1_GROUPED = _block_dots(_blocks(20, _Q4_1_RUNS, GROUPED), _block_d_scales(20, GROUPED, True))
# Q4_K / Q5_K: run c's 32 bytes hold sub-block 2c in their low nibbles, 2c + 1 in their high
# ones; Q5_K's fifth bit of weight 32 j + l is bit j of byte 16 + l.
_Q4_K = _block_dots(
    [Run(16 + 32 * (j // 2), 32 * j, j, shift=4 * (j % 2), group=j) for j in range(8)],
    _k_scales,
)
_Q5_K = _block_dots(
    [Run(48 + 32 * (j // 2), 32 * j, j, 4 * (j % 2), 16, j, 1, group=j) for j in range(8)],
    _k_scales,
)
# Q6_K, per 128-weight half h: ql bytes l and l + 32 and qh byte l give weights l, 32 + l,
# 64 + l, 96 + l (cpu/gguf_blocks.py's _q6_k); a run of 32 holds two 16-weight sub-blocks,
# under scales 8h + 2f and 8h + 2f + 1 (f the run of the half).
_Q6_K = _block_dots(
    [
        Run(
            low=64 * h + 32 * (f % 2), x=128 * h + 32 * f, scale=8 * h + 2 * f,
            second_scale=8 * h + 2 * f + 1, shift=4 * (f // 2), high=128 + 32 * h,
            high_shift=2 * f, high_mask=3, offset=32, group=4 * h + f,
        )
        for h in range(2)
        for f in range(4)
    ],
    _q6_k_scales,
)  # fmt: skip


@numba.njit(cache=True, inline="always")
def has_integer_dot(qtype):  # pragma: no cover - compiled
    """Whether ``qtype`` is one of ``INTEGER_TYPES``."""
    k_quant = qtype == Q4_K or qtype == Q5_K or qtype == Q6_K
    return k_quant or qtype == Q4_0 or qtype == Q4_1 or qtype == Q8_0


@numba.njit(cache=True)
def round_activations(x):  # pragma: no cover - compiled
    """Each row of fp32 ``x [M, K]`` as 16-bit integers per ``GROUP`` elements: ``xq`` (int16
    ``[M, K]``), ``dx`` (the groups' steps, ``x ~ dx * xq``) and ``sums`` (the groups' int32
    sums of ``xq``, for the types whose weights carry a minimum). A group of zeros has step
    0."""
    m, k = x.shape
    xq = np.empty((m, k), np.int16)
    dx = np.empty((m, k // GROUP), np.float32)
    sums = np.empty((m, k // GROUP), np.int32)
    for r in range(m):
        for g in range(k // GROUP):
            largest = np.float32(0.0)
            for j in range(g * GROUP, g * GROUP + GROUP):
                largest = max(largest, abs(x[r, j]))
            dx[r, g] = largest / np.float32(ACTIVATION_MAX)
            inverse = np.float32(ACTIVATION_MAX) / largest if largest > 0 else np.float32(0.0)
            total = 0
            for j in range(g * GROUP, g * GROUP + GROUP):
                q = min(max(np.round(x[r, j] * inverse), -ACTIVATION_MAX), ACTIVATION_MAX)
                xq[r, j] = np.int16(q)
                total += xq[r, j]
            sums[r, g] = total
    return xq, dx, sums


@numba.njit(cache=True, inline="always")
def _dots(kind, raw, base, xq, dx, sums, rows, xat, g0):  # pragma: no cover - compiled
    """Layout ``kind`` (a type id; negated: ``GROUPED`` blocks of a 32-weight type) at byte
    ``base``, dotted with ``rows``."""
    if kind == Q4_K:
        return _Q4_K(raw, base, xq, dx, sums, rows, xat, g0)
    if kind == Q5_K:
        return _Q5_K(raw, base, xq, dx, sums, rows, xat, g0)
    if kind == Q6_K:
        return _Q6_K(raw, base, xq, dx, sums, rows, xat, g0)
    if kind == Q8_0:
        return _Q8_0(raw, base, xq, dx, sums, rows, xat, g0)
    if kind == -Q8_0:
        return _Q8_0_GROUPED(raw, base, xq, dx, sums, rows, xat, g0)
    if kind == Q4_0:
        return _Q4_0(raw, base, xq, dx, sums, rows, xat, g0)
    if kind == -Q4_0:
        return _Q4_0_GROUPED(raw, base, xq, dx, sums, rows, xat, g0)
    if kind == Q4_1:
        return _Q4_1(raw, base, xq, dx, sums, rows, xat, g0)
    return _Q4_1_GROUPED(raw, base, xq, dx, sums, rows, xat, g0)


@numba.njit(cache=True, inline="always")
def _add_dots(kind, raw, base, xq, dx, sums, xat, g0, out, o):  # pragma: no cover - compiled
    """``out[r, o] +=`` layout ``kind``'s dot with row ``r``, for every row: four rows a call
    (the quants decoded once for the four), the last few one a call."""
    m = xq.shape[0]
    r = 0
    while r + 4 <= m:
        dots = _dots(kind, raw, base, xq, dx, sums, (r, r + 1, r + 2, r + 3), xat, g0)
        for i in range(4):
            out[r + i, o] += dots[i]
        r += 4
    while r < m:
        out[r, o] += _dots(kind, raw, base, xq, dx, sums, (r,), xat, g0)[0]
        r += 1


@numba.njit(cache=True)
def integer_dot_rows(raw, qtype, xq, dx, sums, out, o):  # pragma: no cover - compiled
    """``out[r, o] =`` one weight row of blocks ``raw`` (a type of ``INTEGER_TYPES``) dotted
    with row ``r`` of the rounded activations (``round_activations``' ``xq``, ``dx``,
    ``sums``), for every row: a K-quant block a call; the 32-weight types ``GROUPED`` blocks
    a call while that many are left, then one a call. A row's arithmetic is the same
    whichever rows share the call."""
    for r in range(xq.shape[0]):
        out[r, o] = 0.0
    if qtype == Q4_K or qtype == Q5_K or qtype == Q6_K:
        size = 210 if qtype == Q6_K else (176 if qtype == Q5_K else 144)
        for b in range(dx.shape[1] // 8):
            _add_dots(qtype, raw, size * b, xq, dx, sums, 256 * b, 8 * b, out, o)
        return
    size = 34 if qtype == Q8_0 else (20 if qtype == Q4_1 else 18)
    b = 0
    while b < dx.shape[1]:
        count = GROUPED if dx.shape[1] - b >= GROUPED else 1
        kind = -qtype if count == GROUPED else qtype
        _add_dots(kind, raw, size * b, xq, dx, sums, 32 * b, b, out, o)
        b += count
