"""A GGUF row of blocks dotted with activations rounded to 16-bit integers, compiled with numba:
the decode GEMM's inner product (cpu/gguf_linear.py) for the types whose weights are small
integers under a block's scales (``INTEGER_TYPES``: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K), and for
int8 weights quantized at load (``INT8_ROWS``: Q8_0's layout without the scale, which is one per
output and applied after the sum, cpu/weight_only_linear.py).

**Why integers.** Decoding a block to fp32 costs more than the dot that follows: a Q4_K weight
is a shift, a mask, a conversion, a multiply and a subtract before its one FMA (about 7 G
weights a second per thread, the same from cache as from memory, so a 1B model's decode step
was arithmetic, not bandwidth). llama.cpp rounds each block of activations to 8-bit integers
and sums ``q * x`` products in integer registers; a block's scales then multiply a sum, not
every weight. Here the same, with choices of our own:

- **16-bit activations, not 8.** Each group of activations is rounded to ``round(x / dx)``
  with ``dx = max|x| / ACTIVATION_MAX``: an element's error is at most ``dx / 2``,
  ``1.5e-5`` of its group's largest (8 bits would be 256 times coarser). A group is a block's
  32 for the 32-weight types and a K-quant block's 256 (``activation_group``; llama.cpp rounds
  256 to 8 bits for these). Where a group holds one large activation its small ones round
  coarsely: SmolLM2's Q4_1 prompt log-probabilities move by up to 6e-4
  (tests/models/test_gguf.py); its greedy tokens stay those of transformers on the dequantized
  weights.
- **``vpmaddwd`` from portable IR.** A quant times a 16-bit activation, adjacent products
  added in pairs into 32 bits, is what ``vpmaddwd`` does (32 products an instruction on
  AVX-512; ``vpdpwssd`` with the add where VNNI is); cpu/block_ir.py writes it as plain LLVM
  vector operations, through numba intrinsics, and says why.
- **Layouts as data.** Each type's block is a list of ``Run`` s (where a run's quant bits
  live, which activations and which scale it meets); ``_block_dots`` and ``_k_block_dots``
  turn a list into an intrinsic. Calls take several blocks (``GROUPED`` 32-weight blocks,
  ``K_GROUPED`` K-quant blocks) while that many are left, so a row's fp32 or fp64 lanes are
  summed once a call.
- **The K-quants' scales folded into their quants.** A K-quant's sub-block scales are small
  integers, so each run's quants are multiplied by theirs in 16 bits and a block's products
  summed in 32-bit integer lanes: one conversion per 256 weights and row, not one per 32
  (``_k_block_dots`` says why nothing overflows). This is why their activations are rounded
  per 256.
- **Four rows a call.** A call unpacks its blocks' scales (vector code, in the intrinsic)
  and decodes each run's quants once, and dots them with four rows of activations (then one
  a call for the rest), so a decode step of 16 sequences does not decode its weights 16
  times.

**Exact, then rounded in a fixed order.** A pair of products is exact in 32 bits and in fp32
(at most ``2 * 2^7 * 2^15 < 2^24``); in the 32-weight types each run's pairs are scaled
(``scale * dx``) and added lane by lane in fp32, in the K-quants a block's integer lanes go to
fp64 under ``d * dx``; the lanes are summed in a fixed tree, the minimums' share subtracted
last. Every row meets the same operations whichever rows share its call and whichever thread
runs it, so a row's result does not depend on its batch (the batch-invariant mode's promise,
kept by the GEMM whatever the mode). No multiply and add are contracted into an FMA: LLVM
would contract some and not others depending on the surrounding code (a row alone and among
four differed in their last bit when it was allowed, by ``contract`` flags or by being inlined
into a fast-math function; cpu/gguf_linear.py calls this path from functions without
fast-math).

How far from the reference: for an output, at most ``sum |w| * dx / 2`` over its weights plus
fp32's rounding; and exactly the reference's product (to fp32's rounding) where the
activations are on the 16-bit grid (kernels/test_gguf_linear_numba.py holds both).

Measured (AMD EPYC VM with AVX-512, one thread, a 1B Llama's layers, `tools/bench_gguf_cpu.py
--model llama-1b --layers 2`; docs/benchmarks.md): 1.3-2.1x the fp32-decoding GEMM's speed
at one row; the K-quants' folded scales then made Q4_K, Q5_K and Q6_K 1.0-1.4x faster at one
row and 1.4-1.8x at sixteen; int8 at load, decoded before, made the 1B model's one-stream
decode step 1.9x faster (95.9 -> 51.2 ms, fp32 107 ms). Not measured on the Intel VM nor beside
a busy neighbour.

Why one file: the layouts, the intrinsic each compiles to, and the loops that choose one by
type id are one mechanism; numba compiles every layout into the loops.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from pagedserve.kernels.cpu import (
    block_ir,
    numba_cache,  # noqa: F401  (before any cached @njit)
)
from pagedserve.kernels.cpu.block_ir import Run
from pagedserve.kernels.cpu.gguf_blocks import INT8_ROWS
from pagedserve.kernels.gguf_dequant import GGUF_TYPE_IDS, GGUF_TYPES

Q4_0, Q4_1, Q8_0 = GGUF_TYPE_IDS["Q4_0"], GGUF_TYPE_IDS["Q4_1"], GGUF_TYPE_IDS["Q8_0"]
Q4_K, Q5_K, Q6_K = GGUF_TYPE_IDS["Q4_K"], GGUF_TYPE_IDS["Q5_K"], GGUF_TYPE_IDS["Q6_K"]
# The GGUF types whose weights are integers under a block's scales, and int8 weights quantized
# at load (``INT8_ROWS``: a signed byte a weight, its one scale per output applied after)
INTEGER_TYPES = (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, INT8_ROWS)
# Bytes per block, from the project's one table of GGUF types
Q4_0_BYTES, Q4_1_BYTES, Q8_0_BYTES = (GGUF_TYPES[t].block_bytes for t in (Q4_0, Q4_1, Q8_0))
Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES = (GGUF_TYPES[t].block_bytes for t in (Q4_K, Q5_K, Q6_K))
ACTIVATION_MAX = 32767  # the largest 16-bit integer an activation is rounded to
GROUP = 32  # activations rounded together under one step for the 32-weight types
K_GROUP = 256  # and for the K-quants (activation_group)
# Independent integer sums per row and block: one chain waits on each add's latency (two 1B
# Q4_K layers at one row: 9.3 -> 8.8 ms, within the VM's noise).
CHAINS = 4


def _floats(width):
    """The fp32 vector of a run's pairs: half its width."""
    return ir.VectorType(ir.FloatType(), width // 2)


def _k_scales(block, builder):
    """Q4_K's / Q5_K's ``d`` and ``dmin`` (fp16 at 0 and 2) and eight 6-bit scales and
    minimums (the 12 bytes at 4, unpacked as cpu/gguf_blocks.py's ``_k_scale_min``, eight
    lanes at once), the scales as 16-bit integers and the minimums as 32-bit. Sub-blocks 0-3
    keep six bits of bytes 0-3 (scales) and 4-7 (minimums); 4-7 take four bits of bytes 8-11
    and their top two from the top bits of bytes 0-3 and 4-7."""
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
    scales = builder.zext(scales, ir.VectorType(ir.IntType(16), 8))
    mins = builder.zext(mins, ir.VectorType(ir.IntType(32), 8))
    return block.half(0, ir.DoubleType()), scales, block.half(2, ir.DoubleType()), mins


def _q6_k_scales(block, builder):
    """Q6_K's ``d`` (fp16 at 208) and sixteen int8 scales (at 192) as 16-bit integers; no
    minimums."""
    scales = builder.sext(block.bytes(192, 16), ir.VectorType(ir.IntType(16), 16))
    return block.half(208, ir.DoubleType()), scales, None, None


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
    """The run's scale times its activations' step ``dx[row, g0 + run.group]``, in every
    lane."""
    step_at = builder.add(args[7], block_ir.i64(run.group))
    step = builder.load(
        block_ir.element_at(context, builder, signature.args[3], args[3], row, step_at)
    )
    return block_ir.splat(builder, builder.fmul(scales[run.scale], step), run.width // 2)


def _row_term(context, builder, signature, args, quants, run, row, total, scales):
    """``total +`` the run's products with one row, in pairs, under its scale. A multiply
    and an add, never contracted into one FMA: LLVM contracts where it can, and where it
    can depends on what surrounds a row (measured: a row alone and among four differed in
    its last bit)."""
    pairs = block_ir.pairs(context, builder, signature, args, quants, run, row)
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
        block_ir.element_at(context, builder, signature.args[3], args[3], row, g0, groups), align=4
    )
    counts = ir.VectorType(ir.IntType(32), count)
    sums = builder.load(
        block_ir.element_at(context, builder, signature.args[4], args[4], row, g0, counts), align=4
    )
    terms = builder.fmul(builder.fmul(mins, steps), builder.sitofp(sums, groups))
    return block_ir.lane_sum(builder, terms)


def _unit_scales(count):
    """The scales of ``count`` blocks of ``INT8_ROWS``: none in the bytes, so each is 1 (the
    output's scale is applied after the sum, cpu/weight_only_linear.py)."""

    def scales(block, builder):
        return [ir.Constant(ir.FloatType(), 1.0)] * count, []

    return scales


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
    run's scale; the lanes are summed once per call (``block_ir.lane_sum``), the minimums' share
    subtracted last. A row's operations do not depend on the other rows of the call."""
    width = runs[0].width
    assert all(run.width == width for run in runs)
    floats = _floats(width)

    @intrinsic
    def block_dots(typingctx, raw, base, xq, dx, sums, rows, xat, g0):
        count = rows.count

        def codegen(context, builder, signature, args):
            block = block_ir.BlockReader(context, builder, signature.args[0], args[0], args[1])
            scales, mins = block_scales(block, builder)
            row_values = [builder.extract_value(args[5], i) for i in range(count)]
            totals = [ir.Constant(floats, [0.0] * (width // 2))] * count
            for run in runs:
                quants = block_ir.quants(block, builder, run)
                for i, row in enumerate(row_values):
                    totals[i] = _row_term(
                        context, builder, signature, args, quants, run, row, totals[i], scales
                    )
            results = [block_ir.lane_sum(builder, total) for total in totals]
            if mins:
                vector = block_ir.as_vector(builder, mins)
                results = [
                    builder.fsub(result, _minimums(context, builder, signature, args, row, vector))
                    for result, row in zip(results, row_values)
                ]
            return context.make_tuple(builder, signature.return_type, results)

        result = types.UniTuple(types.float32, count)
        return result(raw, base, xq, dx, sums, rows, xat, g0), codegen

    return block_dots


def _run_scales(builder, scales, run):
    """The run's integer scale in each of its lanes (``second_scale``: in the second half's)."""
    second = run.scale if run.second_scale < 0 else run.second_scale
    return block_ir.lanes(
        builder, scales, [run.scale] * (run.width // 2) + [second] * (run.width // 2)
    )


def _k_terms(context, builder, signature, args, total, row, scales, k):
    """Block ``k`` of the call (activation step ``b = g0 + k``) with one row, from its integer
    lanes ``total``: the lanes in fp64 times ``d * dx[row, b]``, and the minimums' share
    ``dmin * dx[row, b] * sum_j mins[j] * sums[row, 8 b + j]`` (summed exactly in 32 bits;
    0.0 for Q6_K)."""
    d, _, dmin, mins = scales
    double = ir.DoubleType()
    b = builder.add(args[7], block_ir.i64(k))
    step = builder.load(block_ir.element_at(context, builder, signature.args[3], args[3], row, b))
    step = builder.fpext(step, double)
    lanes = ir.VectorType(double, total.type.count)
    scaled = builder.fmul(
        builder.sitofp(total, lanes), block_ir.splat(builder, builder.fmul(d, step), lanes.count)
    )
    if mins is None:
        return scaled, ir.Constant(double, 0.0)
    at = builder.mul(b, block_ir.i64(mins.type.count))
    sums = builder.load(
        block_ir.element_at(context, builder, signature.args[4], args[4], row, at, mins.type),
        align=4,
    )
    minimums = builder.sitofp(block_ir.lane_sum(builder, builder.mul(mins, sums)), double)
    return scaled, builder.fmul(builder.fmul(dmin, step), minimums)


def _k_integer_lanes(codegen_args, block, scales, runs, row_values):
    """Each row's 32-bit lanes of one K-quant block: its ``runs``' quants times their integer
    ``scales`` (once for all rows), dotted in pairs with each row's activations, the runs
    spread over ``CHAINS`` sums added last (integers: exact in any order)."""
    context, builder, signature, args = codegen_args
    lanes = runs[0].width // 2
    zero = ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes)
    chains = [[zero] * CHAINS for _ in row_values]
    for j, run in enumerate(runs):
        weighted = builder.mul(
            block_ir.quants(block, builder, run), _run_scales(builder, scales, run)
        )
        for i, row in enumerate(row_values):
            pairs = block_ir.pairs(context, builder, signature, args, weighted, run, row)
            chains[i][j % CHAINS] = builder.add(chains[i][j % CHAINS], pairs)
    totals = []
    for row_chains in chains:
        total = row_chains[0]
        for chain in row_chains[1:]:
            total = builder.add(total, chain)
        totals.append(total)
    return totals


def _k_block_dots(runs, read_scales, size, count=1):
    """An intrinsic for ``count`` K-quant blocks of ``size`` bytes side by side (256 weights
    each, in ``runs`` of 32) whose integer scales ``read_scales(block, builder)`` reads (``d``,
    the scales, ``dmin`` and the minimums; the last two None for Q6_K): ``block_dots(raw,
    base, xq, dx, sums, rows, xat, g0)`` is, for each row of the tuple ``rows``, the sum over
    blocks ``k`` (at byte ``base + size k``, activations from ``xat + 256 k``, one step ``dx[row,
    g0 + k]``: ``activation_group``) of ``dx * (d * sum_l scale_l * q_l * xq[row, l] - dmin *
    sum_j min_j * sums[row, 8 (g0 + k) + j])``.

    **The scales folded into the quants.** Per run, once for all the rows: its quants times
    their sub-block's integer scale, in 16 bits (at most 31 * 63 for Q5_K, 32 * 128 for Q6_K).
    Per row: those times the activations, in pairs into 32-bit lanes (``block_ir.pairs``),
    accumulated over the block's eight runs (``_k_integer_lanes``). A lane then holds 16
    products, at most ``16 * 4096 * 32767 < 2^31`` (Q6_K's, the largest): no overflow, and
    exact. Then per block the lanes go to fp64 (exact), are multiplied by ``d * dx`` (an fp16
    times an fp32: exact in fp64) with one rounding to 53 bits, and add into the row's fp64
    lanes, summed in a fixed tree once a call, the minimums' share subtracted, and rounded to
    fp32. A block costs a row one conversion, not one a run, and a row meets the same
    operations whatever rows share its call."""
    runs = [run._replace(x=run.x + 256 * k) for k in range(count) for run in runs]
    per_block = len(runs) // count
    lanes = runs[0].width // 2

    @intrinsic
    def block_dots(typingctx, raw, base, xq, dx, sums, rows, xat, g0):
        def codegen(context, builder, signature, args):
            row_values = [builder.extract_value(args[5], i) for i in range(rows.count)]
            wide = ir.VectorType(ir.DoubleType(), lanes)
            results = [(ir.Constant(wide, [0.0] * lanes), ir.Constant(ir.DoubleType(), 0.0))]
            results *= rows.count
            for k in range(count):
                at = builder.add(args[1], block_ir.i64(size * k))
                block = block_ir.BlockReader(context, builder, signature.args[0], args[0], at)
                scales = read_scales(block, builder)
                block_runs = runs[k * per_block : (k + 1) * per_block]
                totals = _k_integer_lanes(
                    (context, builder, signature, args), block, scales[1], block_runs, row_values
                )
                for i, row in enumerate(row_values):
                    terms = _k_terms(context, builder, signature, args, totals[i], row, scales, k)
                    results[i] = (
                        builder.fadd(results[i][0], terms[0]),
                        builder.fadd(results[i][1], terms[1]),
                    )
            values = [
                builder.fptrunc(
                    builder.fsub(block_ir.lane_sum(builder, vector), mins), ir.FloatType()
                )
                for vector, mins in results
            ]
            return context.make_tuple(builder, signature.return_type, values)

        result = types.UniTuple(types.float32, rows.count)
        return result(raw, base, xq, dx, sums, rows, xat, g0), codegen

    return block_dots


# The block layouts (gguf_dequant.py documents them) as runs of quants under one scale, each
# type one block a call and several a call (one reduction per call).
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


def _dots_of_32(size, runs, with_min=False, scaled=True):
    """A 32-weight type's two intrinsics: one block a call, and ``GROUPED`` blocks a call;
    ``scaled``: its blocks start with their scale ``d`` (all but ``INT8_ROWS``)."""

    def scales(count):
        return _block_d_scales(size, count, with_min) if scaled else _unit_scales(count)

    return (
        _block_dots(runs, scales(1)),
        _block_dots(_blocks(size, runs, GROUPED), scales(GROUPED)),
    )


GROUPED = 8  # 32-weight blocks per call when at least that many are left
_Q8_0, _Q8_0_GROUPED = _dots_of_32(Q8_0_BYTES, [Run(low=2, x=0, scale=0, signed=True)])
_Q4_0, _Q4_0_GROUPED = _dots_of_32(Q4_0_BYTES, [Run(2, 0, 0, offset=8, halves=True)])
_Q4_1, _Q4_1_GROUPED = _dots_of_32(Q4_1_BYTES, [Run(4, 0, 0, halves=True)], with_min=True)
_I8, _I8_GROUPED = _dots_of_32(GROUP, [Run(low=0, x=0, scale=0, signed=True)], scaled=False)
# Q4_K / Q5_K: run c's 32 bytes hold sub-block 2c in their low nibbles, 2c + 1 in their high
# ones; Q5_K's fifth bit of weight 32 j + l is bit j of byte 16 + l.
_Q4_K_RUNS = [Run(16 + 32 * (j // 2), 32 * j, j, shift=4 * (j % 2)) for j in range(8)]
_Q5_K_RUNS = [Run(48 + 32 * (j // 2), 32 * j, j, 4 * (j % 2), 16, j, 1) for j in range(8)]
# Q6_K, per 128-weight half h: ql bytes l and l + 32 and qh byte l give weights l, 32 + l,
# 64 + l, 96 + l (cpu/gguf_blocks.py's _q6_k); a run of 32 holds two 16-weight sub-blocks,
# under scales 8h + 2f and 8h + 2f + 1 (f the run of the half).
_Q6_K_RUNS = [
    Run(
        low=64 * h + 32 * (f % 2), x=128 * h + 32 * f, scale=8 * h + 2 * f,
        second_scale=8 * h + 2 * f + 1, shift=4 * (f // 2), high=128 + 32 * h,
        high_shift=2 * f, high_mask=3, offset=32,
    )
    for h in range(2)
    for f in range(4)
]  # fmt: skip
K_GROUPED = 4  # K-quant blocks per call when at least that many are left


def _k_dots(runs, read_scales, size):
    """A K-quant's two intrinsics: one block a call, and ``K_GROUPED`` blocks a call."""
    return _k_block_dots(runs, read_scales, size), _k_block_dots(runs, read_scales, size, K_GROUPED)


_Q4_K, _Q4_K_GROUPED = _k_dots(_Q4_K_RUNS, _k_scales, Q4_K_BYTES)
_Q5_K, _Q5_K_GROUPED = _k_dots(_Q5_K_RUNS, _k_scales, Q5_K_BYTES)
_Q6_K, _Q6_K_GROUPED = _k_dots(_Q6_K_RUNS, _q6_k_scales, Q6_K_BYTES)


@numba.njit(cache=True, inline="always")
def has_integer_dot(qtype, k):  # pragma: no cover - compiled
    """Whether rows of ``k`` weights of ``qtype`` take the integer dots: ``qtype`` one of
    ``INTEGER_TYPES``, and ``k`` whole blocks (a GGUF row always is; ``INT8_ROWS`` of another
    width are decoded)."""
    k_quant = qtype == Q4_K or qtype == Q5_K or qtype == Q6_K
    of_32 = qtype == Q4_0 or qtype == Q4_1 or qtype == Q8_0 or qtype == INT8_ROWS
    return k_quant or (of_32 and k % GROUP == 0)


@numba.njit(cache=True, inline="always")
def activation_group(qtype):  # pragma: no cover - compiled
    """How many activations ``qtype``'s dots round under one step: a K-quant block's 256
    (its integer scales fold into its quants, ``_k_block_dots``), else a block's 32."""
    return K_GROUP if qtype == Q4_K or qtype == Q5_K or qtype == Q6_K else GROUP


@numba.njit(cache=True)
def round_activations(x, group):  # pragma: no cover - compiled
    """Each row of fp32 ``x [M, K]`` as 16-bit integers per ``group`` elements (a multiple of
    ``GROUP``): ``xq`` (int16 ``[M, K]``), ``dx`` (the groups' steps, ``x ~ dx * xq``) and
    ``sums`` (the int32 sums of ``xq`` per ``GROUP``, for the types whose weights carry a
    minimum). A group of zeros has step 0."""
    m, k = x.shape
    xq = np.empty((m, k), np.int16)
    dx = np.empty((m, k // group), np.float32)
    sums = np.zeros((m, k // GROUP), np.int32)
    for r in range(m):
        for g in range(k // group):
            largest = np.float32(0.0)
            for j in range(g * group, g * group + group):
                largest = max(largest, abs(x[r, j]))
            dx[r, g] = largest / np.float32(ACTIVATION_MAX)
            inverse = np.float32(ACTIVATION_MAX) / largest if largest > 0 else np.float32(0.0)
            for j in range(g * group, g * group + group):
                q = min(max(np.round(x[r, j] * inverse), -ACTIVATION_MAX), ACTIVATION_MAX)
                xq[r, j] = np.int16(q)
                sums[r, j // GROUP] += xq[r, j]
    return xq, dx, sums


@numba.njit(cache=True, inline="always")
def _dots(qtype, grouped, raw, base, xq, dx, sums, rows, xat, g0):  # pragma: no cover - compiled
    """``qtype``'s layout at byte ``base`` (``grouped``: ``GROUPED`` or ``K_GROUPED`` blocks,
    else one), dotted with ``rows``."""
    args = (raw, base, xq, dx, sums, rows, xat, g0)
    if qtype == Q4_K:
        return _Q4_K_GROUPED(*args) if grouped else _Q4_K(*args)
    if qtype == Q5_K:
        return _Q5_K_GROUPED(*args) if grouped else _Q5_K(*args)
    if qtype == Q6_K:
        return _Q6_K_GROUPED(*args) if grouped else _Q6_K(*args)
    if qtype == Q8_0:
        return _Q8_0_GROUPED(*args) if grouped else _Q8_0(*args)
    if qtype == INT8_ROWS:
        return _I8_GROUPED(*args) if grouped else _I8(*args)
    if qtype == Q4_0:
        return _Q4_0_GROUPED(*args) if grouped else _Q4_0(*args)
    return _Q4_1_GROUPED(*args) if grouped else _Q4_1(*args)


@numba.njit(cache=True, inline="always")
def _add_dots(qtype, grouped, raw, base, xq, dx, sums, xat, g0, out, o):  # pragma: no cover
    """``out[r, o] +=`` the layout's dot (``_dots``) with row ``r``, for every row: four rows a
    call (the quants decoded once for the four), the last few one a call."""
    m = xq.shape[0]
    r = 0
    while r + 4 <= m:
        dots = _dots(qtype, grouped, raw, base, xq, dx, sums, (r, r + 1, r + 2, r + 3), xat, g0)
        for i in range(4):
            out[r + i, o] += dots[i]
        r += 4
    while r < m:
        out[r, o] += _dots(qtype, grouped, raw, base, xq, dx, sums, (r,), xat, g0)[0]
        r += 1


@numba.njit(cache=True, inline="always")
def _block_shape(qtype):  # pragma: no cover - compiled
    """A ``qtype`` block's bytes and weights, and how many blocks a grouped call takes."""
    if qtype == Q6_K:
        return Q6_K_BYTES, K_GROUP, K_GROUPED
    if qtype == Q5_K:
        return Q5_K_BYTES, K_GROUP, K_GROUPED
    if qtype == Q4_K:
        return Q4_K_BYTES, K_GROUP, K_GROUPED
    if qtype == Q8_0:
        return Q8_0_BYTES, GROUP, GROUPED
    if qtype == INT8_ROWS:
        return GROUP, GROUP, GROUPED
    return (Q4_1_BYTES if qtype == Q4_1 else Q4_0_BYTES), GROUP, GROUPED


@numba.njit(cache=True)
def integer_dot_rows(raw, qtype, xq, dx, sums, out, o):  # pragma: no cover - compiled
    """``out[r, o] =`` one weight row of blocks ``raw`` (a type of ``INTEGER_TYPES``) dotted
    with row ``r`` of the rounded activations (``round_activations``' ``xq``, ``dx``,
    ``sums``), for every row: ``GROUPED`` blocks a call (``K_GROUPED`` of a K-quant) while
    that many are left, then one a call. A row's arithmetic is the same whichever rows share
    the call."""
    for r in range(xq.shape[0]):
        out[r, o] = 0.0
    size, weights, grouped = _block_shape(qtype)
    blocks = xq.shape[1] // weights
    b = 0
    while b < blocks:
        whole = blocks - b >= grouped
        _add_dots(qtype, whole, raw, size * b, xq, dx, sums, weights * b, b, out, o)
        b += grouped if whole else 1
