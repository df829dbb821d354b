"""The vector kernels of the CPU decode attention (paged_decode_loops.py calls them): numba intrinsics that
emit LLVM vector code (simd.py) for the head sizes of HEAD_SIZES, each kernel a switch over them.
"""
from __future__ import annotations

import functools

from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from engine.model import kernel_cache  # numba's cache folder, set before any @njit below
from engine.model import simd
from engine.model.packed_matmul_cpu import TILE

KEYS = simd.LANES  # keys _key_scores scores at once
SCORE_HEADS = 4  # query heads _key_scores takes per pass over the keys (their sums must fit the registers)
VALUE_VECTORS = 16  # sums _weighted_values keeps in registers: 4 heads at head size 64, 2 at 128
HEAD_SIZES = (64, 128)  # the head sizes the vector kernels are compiled for (each a switch arm)


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE, inline="always")
def _vector_head_size(dim):
    """Whether the vector kernels (_key_scores, _weighted_values, _pack_keys) are compiled for head size dim."""
    return dim in HEAD_SIZES


@intrinsic
def _largest(typingctx, row, vectors):
    """The largest of row[:vectors * LANES] (vectors >= 1; row float32 with unit stride): numba leaves a
    maximum over a loop scalar, one compare after the other."""
    def codegen(context, builder, signature, args):
        row_arg, vectors_arg = args
        start = simd.element_pointer(context, builder, signature.args[0], row_arg, [simd.const(0)])
        first = simd.broadcast(builder, builder.load(start))
        [result] = simd.accumulate(builder, vectors_arg, 1, lambda i, acc: [simd.maximum(builder, acc[0], simd.load(
            builder, builder.gep(start, [builder.mul(i, simd.const(simd.LANES))]), False))], first)
        return simd.largest_lane(builder, result)

    return types.float32(row, vectors), codegen


def _prefetch_row_code(context, builder, cache_ty, cache_arg, slot) -> None:
    """The IR that asks for cache[slot] (every kv head's) into every cache level, a prefetch a cache line."""
    row = simd.element_pointer(context, builder, cache_ty, cache_arg, [slot, simd.const(0), simd.const(0)])
    shape = cgutils.unpack_tuple(builder, context.make_array(cache_ty)(context, builder, cache_arg).shape, 3)
    size = builder.mul(builder.mul(shape[1], shape[2]), simd.const(context.get_abi_sizeof(
        context.get_data_type(cache_ty.dtype))))
    lines = builder.udiv(builder.add(size, simd.const(simd.CACHE_LINE - 1)), simd.const(simd.CACHE_LINE))
    with cgutils.for_range(builder, lines) as loop:
        simd.prefetch(builder, row, builder.mul(loop.index, simd.const(simd.CACHE_LINE)))


@intrinsic
def _prefetch_row(typingctx, cache, slot):
    """Asks for cache[slot] (every kv head's) into every cache level, ahead of its use (measured faster than
    from L2 outward: docs/speed.md#paged-attention)."""
    def codegen(context, builder, signature, args):
        _prefetch_row_code(context, builder, signature.args[0], *args)
        return context.get_dummy_value()

    return types.void(cache, slot), codegen


@intrinsic
def _copy(typingctx, dst, src, n):
    """dst[:n] = src[:n] (float32, or bfloat16 bits widened) for n a constant multiple of LANES, both with unit
    stride: straight vector moves (numba's loop over computed indices does not vectorize, measured far slower)."""
    if not isinstance(n, types.IntegerLiteral):
        return None
    bits = src.dtype == types.uint16

    def codegen(context, builder, signature, args):
        dst_arg, src_arg, _ = args
        to = simd.element_pointer(context, builder, signature.args[0], dst_arg, [simd.const(0)])
        start = simd.element_pointer(context, builder, signature.args[1], src_arg, [simd.const(0)])
        for c, vector in enumerate(simd.load_pieces(builder, start, n.literal_value // simd.LANES, bits)):
            simd.store(builder, vector, builder.gep(to, [simd.const(c * simd.LANES)]))
        return context.get_dummy_value()

    return types.void(dst, src, n), codegen


@intrinsic
def _pack_keys(typingctx, k_cache, kvh, slots, t, dim, keys):
    """keys[t // TILE, d, t % TILE + j] = k_cache[slots[t + j], kvh, d] for j < KEYS (t a multiple of KEYS) and
    every d: KEYS keys into the layout of packed_matmul_cpu.pack, float32, by one 16 x 16 transpose per 16
    of their elements. dim: 64 or 128 (HEAD_SIZES)."""
    bits = k_cache.dtype == types.uint16

    def codegen(context, builder, signature, args):
        k_arg, kvh_arg, slots_arg, t_arg, dim_arg, keys_arg = args
        k_ty, _, slots_ty, _, _, keys_ty = signature.args
        at = functools.partial(simd.element_pointer, context, builder)  # at(array type, array, indices)
        rows = [at(k_ty, k_arg, [builder.load(at(slots_ty, slots_arg, [builder.add(t_arg, simd.const(j))])), kvh_arg,
                                  simd.const(0)]) for j in range(KEYS)]
        tile, column = builder.sdiv(t_arg, simd.const(TILE)), builder.srem(t_arg, simd.const(TILE))

        def pack(dim):
            for c in range(dim // simd.LANES):
                columns = simd.transpose(builder, [simd.load(builder, builder.gep(row, [simd.const(c * simd.LANES)]),
                                                             bits) for row in rows])
                for d, vector in enumerate(columns):
                    simd.store(builder, vector, at(keys_ty, keys_arg, [tile, simd.const(c * simd.LANES + d), column]))

        simd.cases(builder, dim_arg, HEAD_SIZES, pack)
        return context.get_dummy_value()

    return types.void(k_cache, kvh, slots, t, dim, keys), codegen


@intrinsic
def _key_scores(typingctx, q, m, h, group, k_cache, kvh, slots, t, dim, scores):
    """scores[h + i, t:t + KEYS] = q[m, h + i] . k_cache[slots[t + j], kvh] for i < group and j < KEYS: `group`
    (1 to SCORE_HEADS) query heads of one kv head (GQA), each key read once for all of them; dim: 64 or 128
    (HEAD_SIZES). Each key's products are summed lane-wise into one vector per head and the KEYS vectors then
    into one (simd.sum_lanes_of_each), so no key pays a horizontal sum of its own."""
    bits = k_cache.dtype == types.uint16

    def codegen(context, builder, signature, args):
        q_arg, m_arg, h_arg, group_arg, k_arg, kvh_arg, slots_arg, t_arg, dim_arg, scores_arg = args
        q_ty, _, _, _, k_ty, _, slots_ty, _, _, scores_ty = signature.args

        at = functools.partial(simd.element_pointer, context, builder)  # at(array type, array, indices)

        def head(i):
            return builder.add(h_arg, simd.const(i))

        def scores_of(heads, pieces):
            queries = [at(q_ty, q_arg, [m_arg, head(i), simd.const(0)]) for i in range(heads)]
            q_pieces = [simd.load_pieces(builder, query, pieces, False) for query in queries]

            def key_products(j):  # per head, lane-wise partial sums of q . key j
                slot = builder.load(at(slots_ty, slots_arg, [builder.add(t_arg, simd.const(j))]))
                key = at(k_ty, k_arg, [slot, kvh_arg, simd.const(0)])
                k_pieces = simd.load_pieces(builder, key, pieces, bits)
                products = []
                for query in q_pieces:
                    summed = builder.fmul(query[0], k_pieces[0])
                    for c in range(1, pieces):
                        summed = simd.fma(builder, query[c], k_pieces[c], summed)
                    products.append(summed)
                return products

            for i, result in enumerate(simd.sum_lanes_of_each(builder, key_products)):
                simd.store(builder, result, at(scores_ty, scores_arg, [head(i), t_arg]))

        simd.cases(builder, dim_arg, HEAD_SIZES, lambda dim: simd.cases(
            builder, group_arg, range(1, SCORE_HEADS + 1), lambda heads: scores_of(heads, dim // simd.LANES)))
        return context.get_dummy_value()

    return types.void(q, m, h, group, k_cache, kvh, slots, t, dim, scores), codegen


@intrinsic
def _weighted_values(typingctx, weights, h, group, k_cache, v_cache, kvh, slots, dim, acc, p, ahead):
    """acc[p, h + i] = sum over t of weights[h + i, t] * v_cache[slots[t], kvh] for i < group: `group` query
    heads of one kv head (up to VALUE_VECTORS vectors of sums: 4 heads at head size 64, 2 at 128), each value
    read once for all of them; dim: 64 or 128 (HEAD_SIZES). The sums stay in registers across the keys,
    each weight broadcast against its value's vectors. At key t < len(ahead) it asks for the K and V rows of
    slot ahead[t] (a share of the thread's next task), so that memory streams while it computes from cache."""
    bits = v_cache.dtype == types.uint16

    def codegen(context, builder, signature, args):
        w_arg, h_arg, group_arg, k_arg, v_arg, kvh_arg, slots_arg, dim_arg, acc_arg, p_arg, ahead_arg = args
        w_ty, _, _, k_ty, v_ty, _, slots_ty, _, acc_ty, _, ahead_ty = signature.args

        at = functools.partial(simd.element_pointer, context, builder)  # at(array type, array, indices)

        def head(i):
            return builder.add(h_arg, simd.const(i))

        def length(ty, arg):
            return cgutils.unpack_tuple(builder, context.make_array(ty)(context, builder, arg).shape, 1)[0]

        count, ahead_count = length(slots_ty, slots_arg), length(ahead_ty, ahead_arg)

        def weighted_values_of(heads, pieces):
            def step(t, sums):  # sums[i] += weights[h + i, t] * v_cache[slots[t], kvh]
                with builder.if_then(builder.icmp_signed("<", t, ahead_count)):
                    slot = builder.load(at(ahead_ty, ahead_arg, [t]))
                    _prefetch_row_code(context, builder, k_ty, k_arg, slot)
                    _prefetch_row_code(context, builder, v_ty, v_arg, slot)
                value = at(v_ty, v_arg, [builder.load(at(slots_ty, slots_arg, [t])), kvh_arg, simd.const(0)])
                v_pieces = simd.load_pieces(builder, value, pieces, bits)
                added = []
                for i in range(heads):
                    weight = simd.broadcast(builder, builder.load(at(w_ty, w_arg, [head(i), t])))
                    added += [simd.fma(builder, weight, piece, sums[i * pieces + c])
                              for c, piece in enumerate(v_pieces)]
                return added

            results = simd.accumulate(builder, count, heads * pieces, step)
            for i in range(heads):
                out = at(acc_ty, acc_arg, [p_arg, head(i), simd.const(0)])
                for c in range(pieces):
                    simd.store(builder, results[i * pieces + c], builder.gep(out, [simd.const(c * simd.LANES)]))

        simd.cases(builder, dim_arg, HEAD_SIZES, lambda dim: simd.cases(
            builder, group_arg, range(1, VALUE_VECTORS * simd.LANES // dim + 1),
            lambda heads: weighted_values_of(heads, dim // simd.LANES)))
        return context.get_dummy_value()

    return types.void(weights, h, group, k_cache, v_cache, kvh, slots, dim, acc, p, ahead), codegen
