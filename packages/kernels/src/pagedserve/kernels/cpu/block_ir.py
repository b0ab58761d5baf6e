"""GGUF blocks read and multiplied in LLVM IR, the pieces cpu/integer_dot.py builds its numba
intrinsics from: where a run of quants lies in a block (``Run``), how its bytes become a
vector of 16-bit quants (``quants``), and how quants meet 16-bit activations (``pairs``).

**Why IR, not numba loops.** numba widens every integer operation to 64 bits and leaves
LLVM's SLP vectorizer off, so an integer dot written as a loop runs scalar. Written as LLVM
vector operations (load, shift, mask, widen, multiply, add adjacent lanes) the same dot is
what ``vpmaddwd`` does (``vpdpwssd`` where VNNI is): a quant times an activation, adjacent
products added in pairs into 32 bits. LLVM picks the instruction; no x86 intrinsic is named,
so another CPU still gets vector code.

**Fixed order where it matters.** Integer lanes are exact in any order; floating-point lanes
are summed by ``lane_sum`` in a fixed tree, so a row's result is the same bits whichever rows
share its call.
"""

from __future__ import annotations

from typing import NamedTuple

from llvmlite import ir


def i64(value):
    return ir.Constant(ir.IntType(64), value)


class Run(NamedTuple):
    """``width`` consecutive quants of a block under one scale (or two, one per half): quant
    ``l`` is ``((raw[low + l] >> shift) & 15) | (((raw[high + l] >> high_shift) & high_mask)
    << 4)`` (``halves``: the low nibbles of the 16 bytes at ``low``, then their high nibbles,
    as Q4_0 and Q4_1 hold them), less ``offset`` (``signed``: the int8 ``raw[low + l]``
    itself, Q8_0's), and multiplies activation ``x + l``; its scale is the
    layout's ``scale``-th (``second_scale``, when set: for the second half of the run) times
    the activations' step (the 32-weight types': ``dx[row, g0 + group]``; a K-quant block has
    one). Offsets are from the call's first byte and first activation."""

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
    halves: bool = False


def element_at(context, builder, array_type, array, row, column, vector_type=None):
    """A pointer to ``array[row, column]`` of a C-contiguous 2-D array (``row`` None: the 1-D
    ``array[column]``), cast to ``vector_type``'s when given. Addressed here: a view of the
    row would be reference-counted on every call."""
    parts = context.make_array(array_type)(context, builder, array)
    at = column
    if row is not None:
        at = builder.add(builder.mul(row, builder.extract_value(parts.shape, 1)), column)
    pointer = builder.gep(parts.data, [at])
    return pointer if vector_type is None else builder.bitcast(pointer, ir.PointerType(vector_type))


def lanes(builder, vector, picks):
    """The vector of ``vector``'s lanes ``picks``."""
    indices = ir.Constant(ir.VectorType(ir.IntType(32), len(picks)), list(picks))
    return builder.shuffle_vector(vector, vector, indices)


def splat(builder, value, count):
    """``value`` in each of ``count`` lanes."""
    vector = ir.VectorType(value.type, count)
    one = builder.insert_element(ir.Constant(vector, None), value, ir.Constant(ir.IntType(32), 0))
    return lanes(builder, one, [0] * count)


def as_vector(builder, values):
    """The fp32 scalars ``values`` as one vector."""
    vector = ir.Constant(ir.VectorType(ir.FloatType(), len(values)), None)
    for i, value in enumerate(values):
        vector = builder.insert_element(vector, value, ir.Constant(ir.IntType(32), i))
    return vector


def lane_sum(builder, total):
    """The lanes of ``total`` added in a fixed tree (so a row's floats are the same bits
    whatever rows share the call; integers are exact in any order)."""
    count = total.type.count
    add = builder.add if isinstance(total.type.element, ir.IntType) else builder.fadd
    while count > 1:
        count //= 2
        total = add(
            lanes(builder, total, range(count)), lanes(builder, total, range(count, 2 * count))
        )
    return builder.extract_element(total, ir.Constant(ir.IntType(32), 0))


class BlockReader:
    """Reads the bytes of a call's blocks in LLVM IR, from byte ``base`` of the 1-D ``raw``."""

    def __init__(self, context, builder, raw_type, raw, base):
        self.context, self.builder = context, builder
        self.raw_type, self.raw, self.base = raw_type, raw, base

    def bytes(self, offset, count):
        """``count`` bytes from ``offset``, as a vector of ``i8``."""
        at = self.builder.add(self.base, i64(offset))
        vector = ir.VectorType(ir.IntType(8), count)
        pointer = element_at(self.context, self.builder, self.raw_type, self.raw, None, at, vector)
        return self.builder.load(pointer, align=1)

    def half(self, offset, to=None):
        """The fp16 at ``offset``, widened to fp32 (or ``to``; exact)."""
        at = self.builder.add(self.base, i64(offset))
        pointer = element_at(self.context, self.builder, self.raw_type, self.raw, None, at)
        pointer = self.builder.bitcast(pointer, ir.PointerType(ir.HalfType()))
        return self.builder.fpext(self.builder.load(pointer, align=1), to or ir.FloatType())


def quants(block, builder, run):
    """A run's quants, as a vector of 16-bit integers."""
    width = run.width
    wide = ir.VectorType(ir.IntType(16), width)

    def bytes_of(value):
        return ir.Constant(ir.VectorType(ir.IntType(8), width), [value] * width)

    if run.halves:  # each byte twice: its low nibble in the first half, its high in the second
        low = lanes(builder, block.bytes(run.low, width // 2), list(range(width // 2)) * 2)
        shifts = ir.Constant(low.type, [0] * (width // 2) + [4] * (width // 2))
    else:
        low, shifts = block.bytes(run.low, width), bytes_of(run.shift)
    if run.signed:
        return builder.sext(low, wide)
    values = builder.and_(builder.lshr(low, shifts), bytes_of(15))
    if run.high_mask:
        high = builder.lshr(block.bytes(run.high, width), bytes_of(run.high_shift))
        values = builder.or_(
            values, builder.shl(builder.and_(high, bytes_of(run.high_mask)), bytes_of(4))
        )
    values = builder.zext(values, wide)
    if run.offset:
        values = builder.sub(values, ir.Constant(wide, [run.offset] * width))
    return values


def pairs(context, builder, signature, args, quants, run, row):
    """The run's 16-bit ``quants`` times row ``row``'s 16-bit activations, adjacent products
    added in pairs into 32-bit lanes: the shape LLVM turns into ``vpmaddwd``."""
    column = builder.add(args[6], i64(run.x))
    vector = ir.VectorType(ir.IntType(16), run.width)
    x = builder.load(
        element_at(context, builder, signature.args[2], args[2], row, column, vector), align=2
    )
    wide = ir.VectorType(ir.IntType(32), run.width)
    products = builder.mul(builder.sext(quants, wide), builder.sext(x, wide))
    return builder.add(
        lanes(builder, products, range(0, run.width, 2)),
        lanes(builder, products, range(1, run.width, 2)),
    )
