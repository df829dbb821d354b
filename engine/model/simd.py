"""LLVM vector code for the CPU kernels' innermost loops (numba intrinsics build their IR with these).

numba vectorizes plain loops, but it cannot keep a vector in a register across iterations, broadcast a
scalar against a vector, sum 16 vectors lane-wise into one or transpose them: the kernels need all four.
Vectors are 16 float32 lanes: one AVX-512 register here; LLVM splits them in 2 on AVX2 and in 4 on NEON.
"""
from __future__ import annotations

from collections.abc import Sequence

from llvmlite import ir
from numba.core import cgutils

LANES = 16
CACHE_LINE = 64  # bytes
I32, I64 = ir.IntType(32), ir.IntType(64)
FLOATS = ir.VectorType(ir.FloatType(), LANES)
_BITS = ir.VectorType(ir.IntType(16), LANES)
_WORDS = ir.VectorType(I32, LANES)


def const(value: int) -> ir.Constant:
    return ir.Constant(I64, value)


def element_pointer(context, builder: ir.IRBuilder, array_type, array, indices: list[ir.Value]) -> ir.Value:
    """Pointer to array[indices] of a numba array argument (its own strides)."""
    view = context.make_array(array_type)(context, builder, array)
    return cgutils.get_item_pointer(context, builder, array_type, view, indices)


def load(builder: ir.IRBuilder, pointer, bits: bool) -> ir.Value:
    """16 float32 from `pointer` (float*), or 16 bfloat16 bits (uint16*) widened to float32."""
    if not bits:
        return builder.load(builder.bitcast(pointer, FLOATS.as_pointer()), align=4)
    raw = builder.load(builder.bitcast(pointer, _BITS.as_pointer()), align=2)
    # a bfloat16 is the top half of a float32
    return builder.bitcast(builder.shl(builder.zext(raw, _WORDS), ir.Constant(_WORDS, [16] * LANES)), FLOATS)


def load_pieces(builder: ir.IRBuilder, pointer, pieces: int, bits: bool) -> list[ir.Value]:
    """The 16 * pieces elements from `pointer` on as `pieces` vectors (load: float32, or bfloat16 bits)."""
    return [load(builder, builder.gep(pointer, [const(c * LANES)]), bits) for c in range(pieces)]


def store(builder: ir.IRBuilder, value: ir.Value, pointer) -> None:
    builder.store(value, builder.bitcast(pointer, FLOATS.as_pointer()), align=4)


def prefetch(builder: ir.IRBuilder, pointer, offset) -> None:
    """Asks for the cache line `offset` bytes (an int or an i64) past `pointer` ahead of its load, into every
    cache level."""
    byte = ir.IntType(8).as_pointer()
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [byte, I32, I32, I32]),
                                        "llvm.prefetch.p0")
    line = builder.gep(builder.bitcast(pointer, byte), [const(offset) if isinstance(offset, int) else offset])
    builder.call(fn, [line, ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])  # read, keep, data


def prefetch_lines(builder: ir.IRBuilder, pointer, offset: int, size: int) -> None:
    """prefetch() of every cache line of the `size` bytes that start `offset` bytes past `pointer`."""
    for line in range(0, size, CACHE_LINE):
        prefetch(builder, pointer, offset + line)


def broadcast(builder: ir.IRBuilder, scalar: ir.Value) -> ir.Value:
    lane0 = builder.insert_element(ir.Constant(FLOATS, ir.Undefined), scalar, ir.Constant(I32, 0))
    return builder.shuffle_vector(lane0, ir.Constant(FLOATS, ir.Undefined), ir.Constant(_WORDS, [0] * LANES))


def fma(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
    """a * b + c, lane-wise, in one instruction."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(FLOATS, [FLOATS] * 3), "llvm.fma.v16f32")
    return builder.call(fn, [a, b, c])


def cases(builder: ir.IRBuilder, value: ir.Value, counts: Sequence[int], emit) -> None:
    """emit(n) for the n in `counts` that `value` (an integer known at run time only) equals, as the arms of
    one switch: for code whose unrolled shape needs n as a constant (how many rows or heads a kernel's
    registers hold). A value outside `counts` takes the last arm."""
    done = builder.append_basic_block("cases.done")
    arms = {n: builder.append_basic_block(f"case.{n}") for n in counts}
    switch = builder.switch(value, arms[counts[-1]])
    for n, arm in arms.items():
        switch.add_case(ir.Constant(value.type, n), arm)
        builder.position_at_end(arm)
        emit(n)
        builder.branch(done)
    builder.position_at_end(done)


def maximum(builder: ir.IRBuilder, a: ir.Value, b: ir.Value) -> ir.Value:
    """The larger of a and b, lane-wise."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(FLOATS, [FLOATS] * 2), "llvm.maxnum.v16f32")
    return builder.call(fn, [a, b], fastmath=("fast",))


def largest_lane(builder: ir.IRBuilder, vector: ir.Value) -> ir.Value:
    """The largest of the vector's lanes, as a float."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.FloatType(), [FLOATS]),
                                        "llvm.vector.reduce.fmax.v16f32")
    return builder.call(fn, [vector], fastmath=("fast",))


def accumulate(builder: ir.IRBuilder, count: ir.Value, accumulators: int, body, start=None) -> list[ir.Value]:
    """Vector sums over i < count (an i64) that stay in registers for the whole loop: body(i, sums) returns
    the next `accumulators` sums; returns the last ones (start, zeros unless given, when count is 0)."""
    initial = ir.Constant(FLOATS, None) if start is None else start
    entry = builder.block
    loop = builder.append_basic_block("sum.loop")
    done = builder.append_basic_block("sum.done")
    builder.cbranch(builder.icmp_signed(">", count, const(0)), loop, done)
    builder.position_at_end(loop)
    i = builder.phi(I64)
    sums = [builder.phi(FLOATS) for _ in range(accumulators)]
    added = body(i, sums)
    following = builder.add(i, const(1))
    body_end = builder.block
    i.add_incoming(const(0), entry)
    i.add_incoming(following, body_end)
    for phi, value in zip(sums, added):
        phi.add_incoming(initial, entry)
        phi.add_incoming(value, body_end)
    builder.cbranch(builder.icmp_signed("<", following, count), loop, done)
    builder.position_at_end(done)
    results = []
    for value in added:
        result = builder.phi(FLOATS)
        result.add_incoming(initial, entry)
        result.add_incoming(value, body_end)
        results.append(result)
    return results


def transpose(builder: ir.IRBuilder, rows: list[ir.Value]) -> list[ir.Value]:
    """The 16 x 16 transpose of 16 vectors (lane j of row i becomes lane i of row j): four rounds, each
    swapping the off-diagonal blocks of a run of rows (8, 4, 2 then 1) with two-source lane shuffles."""
    rows = list(rows)
    run = LANES // 2
    while run:
        keep = ir.Constant(_WORDS, [j if not j & run else LANES + j - run for j in range(LANES)])
        swap = ir.Constant(_WORDS, [j + run if not j & run else LANES + j for j in range(LANES)])
        for i in range(LANES):
            if not i & run:
                a, b = rows[i], rows[i + run]
                rows[i], rows[i + run] = builder.shuffle_vector(a, b, keep), builder.shuffle_vector(a, b, swap)
        run //= 2
    return rows


def sum_lanes_of_each(builder: ir.IRBuilder, vectors) -> list[ir.Value]:
    """For vectors(i) -> [v_0(i), ..., v_n(i)], i < 16: the n vectors whose lane i is the sum of the lanes of
    v_h(i). A tree of lane swaps and adds, 45 instructions per result, where 16 horizontal sums would take
    about 8 each. vectors(i) is called in order, as the tree needs it, so that few vectors are alive at once."""

    def merge(x, y, run):  # x, y: lane runs of `run` partial sums per item -> x's items then y's, runs of run/2
        half = run // 2
        starts = [r * run for r in range(LANES // run)]
        low = [s + i for s in starts for i in range(half)]
        high = [s + half + i for s in starts for i in range(half)]
        pick_low = ir.Constant(_WORDS, low + [LANES + i for i in low])
        pick_high = ir.Constant(_WORDS, high + [LANES + i for i in high])
        return builder.fadd(builder.shuffle_vector(x, y, pick_low), builder.shuffle_vector(x, y, pick_high))

    def reduce(items):  # -> (vectors, run)
        if len(items) == 1:
            return vectors(items[0]), LANES
        (left, run), (right, _) = reduce(items[:len(items) // 2]), reduce(items[len(items) // 2:])
        return [merge(x, y, run) for x, y in zip(left, right)], run // 2

    return reduce([*range(LANES)])[0]
