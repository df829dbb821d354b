"""Quantized matmuls by integer dot products on x86 (ggml's way): the activations are quantized to int8 per
group of 32, and AVX2's `vpmaddubsw` / `vpmaddwd` multiply 32 weight bytes by 32 activation bytes and sum them in
pairs and quads: about a quarter of the instructions per weight of the float kernel (quant_matmul_cpu), which
widens every weight to float. Opt-in (--quantized-activations int8): the rounding changes answers slightly.

Layout ("quads"): a weight [N, K] in QuantRows form with group 32 (6 bits: 16) becomes
- data [ceil(N / TILE), K / 4, 128] int8 for 8 bits (the bytes, as int8 for every width: the dtype the float
  kernel's tiles do not have, so compiled code that takes a weight picks its path by type and compiles that one):
  for each run of 4 k, 4 vectors of 32 bytes, vector v holding columns 8v..8v+7 of the tile, each as its 4
  consecutive k (the operand order of vpmaddubsw then vpmaddwd); for 4 bits [.., K / 4, 64]: vectors 0 and 1
  share bytes 0-31 (0 low, 1 high nibble), 2 and 3 bytes 32-63; for 6 bits (groups of 16, Q6_K's)
  [.., K / 4, 96]: each weight + 32 (0..63), its low 4 bits as the 4-bit layout's and its top 2 in bytes 64-95,
  byte j holding those of byte j of vectors 0-3 at bits 0, 2, 4 and 6 (0.75 bytes a weight, as the float
  kernel's 6-bit tiles);
- scales, mins as quant_matmul_cpu's, of the same kinds: [tiles, K / 32, TILE] float32, or their fp16 bits as int16
  where every one is an fp16 value (half the bytes: the format's own, for Q8_0, Q4_0 and Q4_1), or the K-quants'
  super-block records (an fp16 factor per column and super-block, an int8 per group: Q4_K's own bytes).

The product: x[r, k] ~ d[r, g] * xq[r, k] with xq = round(x / d) in -127..127 and d = max |x| over the group
/ 127; each output is sum over groups of scale * d * (integer sum of q * xq) + min * d * (sum of xq), as in
llama.cpp's Q8_1 activations; 6-bit weights, read + 32, lose 32 x the sum of xq over their group of 16 from each
integer sum (`totals`, kept per 16 by quantize_activations), as ggml's Q6_K dot product does. The integer sums are
exact, so the product is the dequantized weight's times the rounded activations (each within d / 2 of x) to
float32 summation order. Decode's few rows take whole tiles (tile()), larger batches half tiles for more rows a
pass (half_tile(): prefill, twice as fast as dequantizing the weight for a float32 GEMM on AVX2); both compute
each output by the same operations, so a row's answer does not depend on the size of its batch.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from engine.model import kernel_cache  # numba's cache folder, set before any @njit below
from engine.model import simd
from engine.model.packed_matmul_cpu import PREFETCH_BYTES, TILE
from engine.model.quant_formats import QuantRows
from engine.model.simd import const

GROUP = 32  # k per activation scale; the weight's group must be the same, or SIX_BIT_GROUP for 6 bits
SIX_BIT_GROUP = 16  # Q6_K's: k per group of 6-bit weights, and per activation total (quantize_activations)
QUAD = 4  # k a vpmaddwd lane sums
COLUMNS = 8  # columns of one 32-byte vector (8 columns x 4 k)
BYTES_4BIT, BYTES_8BIT = TILE * QUAD // 2, TILE * QUAD  # bytes of one quad of a tile
BYTES_6BIT = BYTES_4BIT + TILE * QUAD // 4  # the 4-bit layout's low nibbles, then the weights' top bit pairs
SIX_BIT_OFFSET = 32  # what 6-bit weights (-32..31) are read plus, as unsigned bytes for vpmaddubsw / vpdpbusd
# both quantized kernels ask for a tile's integers PREFETCH_BYTES ahead, and for its scales and mins SCALES_AHEAD
# bytes ahead of each group: left to the hardware's prefetchers, one thread streamed a tile at half the memory's rate
SCALES_AHEAD = 1024  # 8 groups
SUPER_HEAD = 2 * TILE  # bytes of a super-block record's fp16 factors, one per column (quant_matmul_cpu's docstring)
X86 = kernel_cache.TARGET_ISA in ("avx2", "avx512")
# rows one pass over a tile serves: each keeps 4 integer accumulators beside the 4 weight vectors (AVX2: 16
# registers; AVX-512's 32 ymm registers hold 4 rows)
ROW_GROUP = 4 if kernel_cache.TARGET_ISA == "avx512" else 2
# rows a pass over half a tile serves (larger batches, half_tile): 2 accumulators a row beside 2 weight vectors; 8
# rows on AVX-512's 32 registers (the 1B shapes' Q4_K matmuls at 64 and 128 rows 0.90-0.94x the time of 4, Q8_0
# 0.96-0.98x, on Zen 5 with VNNI)
GEMM_ROWS = 8 if kernel_cache.TARGET_ISA == "avx512" else 4
# `vpdpbusd` (AVX-VNNI, or AVX512-VNNI on 256-bit vectors) multiplies the same bytes and adds each quad's 4
# products to a 32-bit sum in one instruction, where AVX2 takes `vpmaddubsw`, `vpmaddwd` and an add: the same
# exact integer sums (AVX2's pairs never saturate here, below), so the same answers
VNNI = kernel_cache.TARGET_VNNI
# with AVX512-VNNI, weights take two of their vectors of 32 bytes as one 512-bit vector (4 bits: a byte's two
# nibbles; 8 bits: two vectors side by side, each byte + 128 as AVX-512 has no `vpsignb` to pass a sign on): one
# `vpdpbusd` for 16 columns where 256-bit vectors take two (the same integer sums, so the same answers)
WIDE = kernel_cache.TARGET_WIDE_VNNI
# rows a whole-tile pass serves with WIDE, at any batch: 2 accumulators a row (a 512-bit one for each pair of
# vectors) beside 2 weight registers, of 32. The 1B shapes' Q4_K matmuls at 128 rows on Zen 5: 8 rows 348-353 ms,
# 12 rows 337-339, 14 rows 340-341 (half tiles of 8 rows on 256-bit vectors: 468-472)
WIDE_ROWS = 12
# rows one pass of tile() serves: WIDE_ROWS with WIDE (whole tiles at any batch), else ROW_GROUP (larger batches
# take half tiles)
TILE_ROWS = WIDE_ROWS if WIDE else ROW_GROUP

_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
_BYTES = ir.VectorType(_I8, 32)
_PAIRS = ir.VectorType(_I16, 16)
_SUMS = ir.VectorType(_I32, COLUMNS)
_FLOATS = ir.VectorType(ir.FloatType(), COLUMNS)
_WIDE_BYTES = ir.VectorType(_I8, 64)
_WIDE_SUMS = ir.VectorType(_I32, 2 * COLUMNS)


def fits(rows: QuantRows) -> bool:
    """Whether the weight can run on integer dot products: groups of 32 of 4 or 8 bits (Q8_0, Q4_0, Q4_1, Q4_K)
    or groups of 16 of 6 bits (Q6_K, and Q4_K stacked beside it); K a multiple of 32 (the activations' group)."""
    if rows.shape[1] % GROUP:
        return False
    return rows.group == (SIX_BIT_GROUP if rows.bits == 6 else GROUP) and rows.bits in (4, 6, 8)


def pack_data(rows: QuantRows) -> np.ndarray:
    """The weight's integers in the quad layout (its scales and mins: quant_matmul_cpu.pack, as for its own
    tiles)."""
    n, k = rows.shape
    tiles = -(-n // TILE)
    q = np.zeros((tiles * TILE, k), np.int16)
    q[:n] = rows.q
    # [tiles, TILE, K / 4, 4] -> [tiles, K / 4, 4 vectors, 8 columns x 4 k]
    q = q.reshape(tiles, TILE, k // QUAD, QUAD).transpose(0, 2, 1, 3).reshape(tiles, k // QUAD, 4, COLUMNS * QUAD)
    if rows.bits == 6:
        q = q + SIX_BIT_OFFSET
        top = sum((q[:, :, v] >> 4) << (2 * v) for v in range(4))  # [tiles, K / 4, 32]: vector v's at bits 2v
        low = q & 0x0F
        data = np.concatenate([low[:, :, 0] | (low[:, :, 1] << 4), low[:, :, 2] | (low[:, :, 3] << 4), top], axis=2)
        return np.ascontiguousarray(data.astype(np.uint8).view(np.int8))
    if rows.bits == 4:
        data = np.concatenate([q[:, :, 0] | (q[:, :, 1] << 4), q[:, :, 2] | (q[:, :, 3] << 4)], axis=2)
        return np.ascontiguousarray(data.astype(np.uint8).view(np.int8))
    return np.ascontiguousarray(q.reshape(tiles, k // QUAD, BYTES_8BIT).astype(np.int8))


def is_quads(data) -> bool:
    """Whether packed data (numpy) is in the quad layout: its bytes are int8, quant_matmul_cpu's own tiles'
    uint8. In compiled code a constant of data's type (quads_type)."""
    return data.dtype == np.int8


def quads_type(data) -> bool:
    """is_quads for data's numba type: what compiled code that takes a weight picks its path by."""
    return data.dtype == types.int8


@overload(is_quads)
def _is_quads(data):
    quads = quads_type(data)
    return lambda data: quads


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE)
def integer_at(data, row, k):
    """The integer of W[row, k] (its weight before scale and min) in the quad layout, as float32."""
    tile, column = row // TILE, row % TILE
    vector, within = column // COLUMNS, column % COLUMNS
    j, i = k // QUAD, k % QUAD
    if data.shape[2] == BYTES_4BIT or data.shape[2] == BYTES_6BIT:
        byte = np.int32(data[tile, j, (vector // 2) * 32 + within * QUAD + i]) & 0xFF
        low = byte & 0x0F if vector % 2 == 0 else byte >> 4
        if data.shape[2] == BYTES_4BIT:
            return np.float32(low)
        top = ((np.int32(data[tile, j, BYTES_4BIT + within * QUAD + i]) & 0xFF) >> (2 * vector)) & 3
        return np.float32((low | (top << 4)) - SIX_BIT_OFFSET)
    return np.float32(np.int8(data[tile, j, vector * 32 + within * QUAD + i]))


@njit(fastmath=False, nogil=True, cache=kernel_cache.CACHE)
def quantize_activations(x, xq, d, sums, totals):
    """xq[r, k] = round(x[r, k] / d[r, g]) with d[r, g] = max |x| over group g / 127 (0 for a zero group),
    sums[r, g] = d[r, g] x the group's sum of xq (what the mins multiply: the rounded activations' sum, so that the
    product is exactly the dequantized weight's times the rounded activations) and totals[r, h] = the sum of xq
    over the h-th SIX_BIT_GROUP k (int32, [rows, K / 16]: what weights read + 32 or + 128 added to each integer
    sum, 32 or 128 times). Not fastmath: the rounding must be the same wherever it runs."""
    halves = GROUP // SIX_BIT_GROUP
    for r in range(x.shape[0]):
        for g in range(x.shape[1] // GROUP):
            largest = np.float32(0.0)
            for k in range(g * GROUP, (g + 1) * GROUP):
                largest = max(largest, abs(x[r, k]))
            scale = largest / np.float32(127.0)
            inverse = np.float32(1.0) / scale if scale > 0 else np.float32(0.0)
            total = 0
            for h in range(g * halves, (g + 1) * halves):
                part = 0
                for k in range(h * SIX_BIT_GROUP, (h + 1) * SIX_BIT_GROUP):
                    xq[r, k] = np.int8(np.rint(x[r, k] * inverse))
                    part += xq[r, k]
                totals[r, h] = part
                total += part
            d[r, g] = scale
            sums[r, g] = scale * np.float32(total)


def group_pointers(builder: ir.IRBuilder, kind, ary, tile: ir.Value, g: ir.Value) -> tuple[ir.Value, ir.Value]:
    """(the TILE values of group g of a tile in packed scales or mins of any kind, the TILE fp16 factors of its
    super-block: records only, else None). Both layouts' scales and mins are laid out alike."""
    _, rows, width = cgutils.unpack_tuple(builder, ary.shape, 3)
    tile_start = builder.gep(ary.data, [builder.mul(tile, builder.mul(rows, width))])
    if kind != types.int8:
        return builder.gep(tile_start, [builder.mul(g, const(TILE))]), None
    # groups of a super-block: a power of two (pack() checks), so a shift and a mask where a division per group
    # cost the Q4_K matmuls a tenth of their time
    per_super = builder.udiv(builder.sub(width, const(SUPER_HEAD)), const(TILE))
    trailing_zeros = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(simd.I64, [simd.I64, ir.IntType(1)]), "llvm.cttz.i64")
    super_block = builder.lshr(g, builder.call(trailing_zeros, [per_super, ir.Constant(ir.IntType(1), 1)]))
    head = builder.gep(tile_start, [builder.mul(super_block, width)])
    within = builder.and_(g, builder.sub(per_super, const(1)))
    return builder.gep(head, [builder.add(const(SUPER_HEAD), builder.mul(within, const(TILE)))]), head


def group_columns(builder: ir.IRBuilder, kind, pointers: tuple[ir.Value, ir.Value], first: int | ir.Value,
                  count: int) -> ir.Value:
    """Columns first .. first + count - 1 of a group's scales (or mins) of any kind, found by group_pointers, as
    `count` float32 lanes: fp16 widened, super-block records' int8 sub-scales times their widened fp16 factors
    (exact in float32)."""
    at, head = pointers

    offset = const(first) if isinstance(first, int) else first

    def run(pointer, element: ir.Type, align: int) -> ir.Value:  # `count` elements from column `first` on
        here = builder.gep(builder.bitcast(pointer, element.as_pointer()), [offset])
        return builder.load(builder.bitcast(here, ir.VectorType(element, count).as_pointer()), align=align)

    def widened(pointer) -> ir.Value:  # fp16 bits, as float32
        return builder.fpext(builder.bitcast(run(pointer, _I16, 2), ir.VectorType(ir.HalfType(), count)),
                             ir.VectorType(ir.FloatType(), count))

    if kind == types.float32:
        return run(at, ir.FloatType(), 4)
    if kind == types.int16:
        return widened(at)
    return builder.fmul(builder.sitofp(run(at, _I8, 1), ir.VectorType(ir.FloatType(), count)), widened(head))


def _x86(builder: ir.IRBuilder, name: str, result: ir.Type, *args: ir.Value) -> ir.Value:
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(result, [a.type for a in args]),
                                        f"llvm.x86.avx2.{name}")
    return builder.call(fn, list(args))


def _dot_quads(builder: ir.IRBuilder, acc: ir.Value, unsigned: ir.Value, signed: ir.Value) -> ir.Value:
    """acc + the sum of each 32-bit lane's 4 products of unsigned by signed bytes (`vpdpbusd` on 256 or 512 bits,
    as acc's type; its operands as 32-bit lanes, the form every LLVM version takes)."""
    sums = acc.type
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(sums, [sums, sums, sums]),
                                        f"llvm.x86.avx512.vpdpbusd.{sums.count * 32}")
    return builder.call(fn, [acc, builder.bitcast(unsigned, sums), builder.bitcast(signed, sums)])


def _lanes(builder: ir.IRBuilder, vector: ir.Value, first: int, count: int) -> ir.Value:
    """Lanes first .. first + count - 1 of a vector, as a vector of their own."""
    return builder.shuffle_vector(vector, ir.Constant(vector.type, ir.Undefined),
                                  ir.Constant(ir.VectorType(_I32, count), list(range(first, first + count))))


def _splat(builder: ir.IRBuilder, scalar: ir.Value, vector_type: ir.VectorType) -> ir.Value:
    lane0 = builder.insert_element(ir.Constant(vector_type, ir.Undefined), scalar, ir.Constant(_I32, 0))
    return builder.shuffle_vector(lane0, ir.Constant(vector_type, ir.Undefined),
                                  ir.Constant(ir.VectorType(_I32, vector_type.count), [0] * vector_type.count))


def _product(builder: ir.IRBuilder, context, signature, args, vectors: int, row_counts: range,
             wide_row_counts: range | None) -> None:
    """The code of a pass of 1 to row_counts[-1] rows over `vectors` of a tile's 4 weight vectors, for an intrinsic
    whose arguments are tile()'s, with the part of the tile (of 4 / vectors) before `out` where vectors < 4. With
    WIDE and wide_row_counts, the weights take 512-bit vectors and 1 to wide_row_counts[-1] rows."""
    if not X86:  # pack() never makes quads off x86; this keeps the function compilable there
        builder.call(cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                    "llvm.trap"), [])
        return
    xq_ary, d_ary, sums_ary, totals_ary, data_ary, scales_ary, mins_ary, out_ary = (
        context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 1, 2, 3, 4, 5, 6, -1))
    index, part = args[7], args[8] if vectors < 4 else const(0)
    rows, k_len = cgutils.unpack_tuple(builder, xq_ary.shape, 2)
    xq_row = cgutils.unpack_tuple(builder, xq_ary.strides, 2)[0]  # in bytes, as xq's elements
    d_row = builder.udiv(cgutils.unpack_tuple(builder, d_ary.strides, 2)[0], const(4))
    sums_row = builder.udiv(cgutils.unpack_tuple(builder, sums_ary.strides, 2)[0], const(4))
    totals_row = builder.udiv(cgutils.unpack_tuple(builder, totals_ary.strides, 2)[0], const(4))
    out_row = builder.udiv(cgutils.unpack_tuple(builder, out_ary.strides, 2)[0], const(4))
    xq_bytes = builder.bitcast(xq_ary.data, _I8.as_pointer())
    ones = ir.Constant(_PAIRS, [1] * 16)
    nibble = ir.Constant(_BYTES, [0x0F] * 32)
    first_column = builder.mul(part, const(vectors * COLUMNS))

    def out_at(r, v):
        at = builder.gep(out_ary.data, [builder.add(builder.mul(const(r), out_row), const(v * COLUMNS))])
        return builder.bitcast(at, _FLOATS.as_pointer())

    def x_at(r, quad, lanes=_SUMS):  # xq[r, 4 quad .. 4 quad + 3] in every 32-bit lane (of 8, or of `lanes`)
        at = builder.gep(xq_bytes, [builder.add(builder.mul(const(r), xq_row), builder.mul(quad, const(QUAD)))])
        x4 = builder.load(builder.bitcast(at, _I32.as_pointer()), align=1)
        return builder.bitcast(_splat(builder, x4, lanes), ir.VectorType(_I8, 4 * lanes.count))

    def per_row(array, row_stride, r, g):  # array[r, g] of a [rows, K / 32] float32 array, in 8 lanes
        at = builder.gep(array.data, [builder.add(builder.mul(const(r), row_stride), g)])
        return _splat(builder, builder.load(at), _FLOATS)

    scale_kind = signature.args[5].dtype  # float32, fp16 as its bits (int16), or super-block records (int8)

    def kind(bits, with_min):
        width = {4: BYTES_4BIT, 6: BYTES_6BIT, 8: BYTES_8BIT}[bits]
        tile_data = builder.gep(data_ary.data, [builder.mul(index, builder.mul(builder.udiv(k_len, const(QUAD)),
                                                                              const(width)))])
        # a part's vectors lie together: 4 and 6 bits, a byte of each pair of vectors (0 low and 1 high nibble, 2
        # and 3; 6 bits: the top bit pairs of all 4 after them)
        part_bytes = (BYTES_4BIT if bits == 6 else width) * vectors // 4
        part_data = builder.gep(tile_data, [builder.mul(part, const(part_bytes))])
        # 4 bits: 8 quads' pair sums of up to 2 * 15 * 127 each fit in 16 bits, so a group sums its pairs in
        # 16 bits and widens them once; 6 and 8 bits (up to 2 * 63 * 127 and 2 * 128 * 127 a pair): each quad
        # widens its own. VNNI sums quads in 32 bits, and with WIDE a pair of vectors in one register (4 and 6
        # bits: a byte's two nibbles)
        wide = WIDE and wide_row_counts is not None
        acc_type = _WIDE_SUMS if wide else _PAIRS if bits == 4 and not VNNI else _SUMS
        registers = vectors // 2 if wide else vectors  # accumulators a row
        quads_per_group = (SIX_BIT_GROUP if bits == 6 else GROUP) // QUAD

        def shifted(pairs, amounts):  # 16-bit lanes shifted left by amounts[i] (right where negative)
            if not any(amounts):
                return pairs
            lanes = ir.VectorType(_I16, len(amounts))
            if all(a >= 0 for a in amounts):
                return builder.shl(pairs, ir.Constant(lanes, amounts))
            return builder.lshr(pairs, ir.Constant(lanes, [-a for a in amounts]))

        def top_bits(top, pair, amounts):  # vectors 2 pair and 2 pair + 1's top bit pairs at bits 4-5 of each byte
            lanes = len(amounts)
            if isinstance(pair, int):
                amounts = [a - 4 * pair for a in amounts]
            else:  # a half tile's pair, known at run time: its bits moved down to those of pair 0 first
                top = builder.lshr(top, _splat(builder, builder.trunc(builder.mul(pair, const(4)), _I16),
                                               top.type))
            moved = builder.bitcast(shifted(top, amounts), ir.VectorType(_I8, 2 * lanes))
            return builder.and_(moved, ir.Constant(moved.type, [0x30] * 2 * lanes))

        def vectors_at(quad):  # the part's weight vectors of a quad (unsigned bytes; 8 bits: as signed, or + 128 wide)
            quad_data = builder.gep(tile_data, [builder.mul(quad, const(width))])
            here = builder.gep(part_data, [builder.mul(quad, const(width))])
            if bits == 6:  # both halves' passes ask for the whole quad (the second finds it in L1)
                simd.prefetch_lines(builder, quad_data, PREFETCH_BYTES, width)
            else:
                simd.prefetch_lines(builder, here, PREFETCH_BYTES, part_bytes)
            if wide and bits == 8:  # vectors 2i and 2i + 1 side by side: lanes 0-7 and 8-15
                return [builder.xor(builder.load(builder.bitcast(builder.gep(here, [const(64 * i)]),
                                                                 _WIDE_BYTES.as_pointer()), align=1),
                                    ir.Constant(_WIDE_BYTES, [-128] * 64)) for i in range(part_bytes // 64)]
            loaded = [builder.load(builder.bitcast(builder.gep(here, [const(32 * v)]), _BYTES.as_pointer()),
                                   align=1) for v in range(part_bytes // 32)]
            if bits == 8:
                return loaded
            if bits == 6:
                top = builder.bitcast(builder.load(builder.bitcast(builder.gep(quad_data, [const(BYTES_4BIT)]),
                                                                   _BYTES.as_pointer()), align=1), _PAIRS)
                pairs = range(len(loaded)) if vectors == 4 else [part]
            out = []
            for i, raw in enumerate(loaded):
                high = builder.bitcast(builder.lshr(builder.bitcast(raw, _PAIRS), ir.Constant(_PAIRS, [4] * 16)),
                                       _BYTES)
                if wide:  # [low nibbles | high nibbles]: vector 2i in lanes 0-7, 2i + 1 in 8-15
                    both = builder.shuffle_vector(raw, high, ir.Constant(ir.VectorType(_I32, 64), list(range(64))))
                    both = builder.and_(both, ir.Constant(_WIDE_BYTES, [0x0F] * 64))
                    if bits == 6:  # vector 2i's top bits at 2 * 2i, 2i + 1's at 2 * 2i + 2: each moved to bit 4
                        twice = builder.shuffle_vector(top, top, ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
                        both = builder.or_(both, top_bits(twice, pairs[i], [4] * 16 + [2] * 16))
                    out.append(both)
                    continue
                low, high = builder.and_(raw, nibble), builder.and_(high, nibble)
                if bits == 6:
                    low = builder.or_(low, top_bits(top, pairs[i], [4] * 16))
                    high = builder.or_(high, top_bits(top, pairs[i], [2] * 16))
                out += [low, high]
            return out

        def sums_of(acc, r, v):  # row r's 8 integer sums of weight vector v
            if wide:
                return _lanes(builder, builder.load(acc[r][v // 2]), (v % 2) * COLUMNS, COLUMNS)
            held = builder.load(acc[r][v])
            return _x86(builder, "pmadd.wd", _SUMS, held, ones) if acc_type is _PAIRS else held

        def total_at(r, h):  # row r's sum of xq over SIX_BIT_GROUP k number h
            return builder.load(builder.gep(totals_ary.data, [builder.add(builder.mul(const(r), totals_row), h)]))

        def offset(r, g):  # what weights read + 128 (8 bits, wide) or + 32 (6 bits) added to row r's sums of group g
            if bits == 6:
                return builder.shl(total_at(r, g), ir.Constant(_I32, 5))
            halves = builder.mul(g, const(GROUP // SIX_BIT_GROUP))
            return builder.shl(builder.add(total_at(r, halves), total_at(r, builder.add(halves, const(1)))),
                               ir.Constant(_I32, 7))

        def group_end(num_rows, acc, g):  # the group's integer sums times its scales (and mins) into `out`
            scales_at, mins_at = [group_pointers(builder, scale_kind, ary, index, g)
                                  for ary in (scales_ary, mins_ary)]
            g_x = builder.lshr(g, const(1)) if bits == 6 else g  # the activations' group
            offsets = ([_splat(builder, offset(r, g), _SUMS) for r in range(num_rows)]
                       if bits == 6 or (wide and bits == 8) else None)
            # 6 bits: a group of 16's share of the rounded activations' sum, which its mins multiply
            x_sums = ([_splat(builder, builder.fmul(builder.load(builder.gep(d_ary.data, [
                builder.add(builder.mul(const(r), d_row), g_x)])), builder.sitofp(total_at(r, g), ir.FloatType())),
                _FLOATS) for r in range(num_rows)] if bits == 6 and with_min else None)
            for ahead in (scales_at, mins_at) if with_min else (scales_at,):
                simd.prefetch_lines(builder, ahead[0], SCALES_AHEAD, TILE * (scale_kind.bitwidth // 8))
            # each 8 columns' scales and mins widened once for all the rows (the stores to `out` keep LLVM from
            # reusing what a row before widened: per row, super-block records cost a pass of 2 rows a fifth more)
            for v in range(vectors):
                column = builder.add(first_column, const(v * COLUMNS))
                scale = group_columns(builder, scale_kind, scales_at, column, COLUMNS)
                low = group_columns(builder, scale_kind, mins_at, column, COLUMNS) if with_min else None
                for r in range(num_rows):
                    to = out_at(r, v)
                    sums = sums_of(acc, r, v)
                    if offsets:
                        sums = builder.sub(sums, offsets[r])
                    total = _fma(builder, builder.fmul(scale, per_row(d_ary, d_row, r, g_x)),
                                 builder.sitofp(sums, _FLOATS), builder.load(to, align=4))
                    if with_min:
                        total = _fma(builder, low, x_sums[r] if x_sums else per_row(sums_ary, sums_row, r, g), total)
                    builder.store(total, to, align=4)
            for row in acc[:num_rows]:
                for register in row:
                    builder.store(ir.Constant(acc_type, None), register)

        def product(num_rows):
            for r in range(num_rows):
                for v in range(vectors):
                    builder.store(ir.Constant(_FLOATS, None), out_at(r, v), align=4)
            acc = [[cgutils.alloca_once_value(builder, ir.Constant(acc_type, None)) for _ in range(registers)]
                   for _ in range(num_rows)]
            # one quad an iteration, a group's end behind a branch: a group's 8 quads unrolled had LLVM load
            # every activation of the group up front and spill most of them (a 4-row pass at half the speed)
            with cgutils.for_range(builder, builder.udiv(k_len, const(QUAD))) as loop:
                quad = loop.index
                w = vectors_at(quad)
                # vpmaddubsw and vpdpbusd take unsigned weights: 8-bit ones give their magnitude, their sign
                # moves to x (on 512-bit vectors they come + 128 instead: vectors_at, offset)
                magnitude = w if bits != 8 or wide else [_x86(builder, "psign.b", _BYTES, wv, wv) for wv in w]
                for r in range(num_rows):
                    if wide:
                        x_wide = x_at(r, quad, _WIDE_SUMS)
                        for i in range(registers):
                            builder.store(_dot_quads(builder, builder.load(acc[r][i]), w[i], x_wide), acc[r][i])
                        continue
                    x_bytes = x_at(r, quad)
                    for v in range(vectors):
                        signed_x = x_bytes if bits != 8 else _x86(builder, "psign.b", _BYTES, x_bytes, w[v])
                        if VNNI:
                            builder.store(_dot_quads(builder, builder.load(acc[r][v]), magnitude[v], signed_x),
                                          acc[r][v])
                            continue
                        pairs = _x86(builder, "pmadd.ub.sw", _PAIRS, magnitude[v], signed_x)
                        step = pairs if bits == 4 else _x86(builder, "pmadd.wd", _SUMS, pairs, ones)
                        builder.store(builder.add(builder.load(acc[r][v]), step), acc[r][v])
                last = const(quads_per_group - 1)
                group_last = builder.icmp_unsigned("==", builder.and_(quad, last), last)
                with builder.if_then(group_last, likely=False):
                    group_end(num_rows, acc, builder.udiv(quad, const(quads_per_group)))

        simd.cases(builder, rows, wide_row_counts if wide else row_counts, product)

    kinds = [(bits, with_min) for bits in (8, 4, 6) for with_min in (False, True)]
    width = cgutils.unpack_tuple(builder, data_ary.shape, 3)[2]
    bits_case = builder.add(builder.zext(builder.icmp_unsigned("==", width, const(BYTES_4BIT)), simd.I64),
                            builder.mul(builder.zext(builder.icmp_unsigned("==", width, const(BYTES_6BIT)), simd.I64),
                                        const(2)))
    with_min = builder.icmp_unsigned("!=", cgutils.unpack_tuple(builder, mins_ary.shape, 3)[1], const(0))
    which = builder.add(builder.mul(bits_case, const(2)), builder.zext(with_min, simd.I64))
    simd.cases(builder, which, range(len(kinds)), lambda k: kind(*kinds[k]))


@intrinsic
def tile(typingctx, xq, d, sums, totals, data, scales, mins, index, out):
    """out[r, :TILE] = xq[r] (as d * xq, sums, totals) @ W[tile `index`].T for each of xq's 1 to TILE_ROWS rows:
    xq [rows, K] int8 with unit stride along K, d / sums [rows, K / 32] float32 and totals [rows, K / 16] int32
    (as quantize_activations makes them), data / scales / mins contiguous as
    pack() makes them (scales and mins of any of quant_matmul_cpu.SCALE_KINDS), out [>= rows, >= TILE] float32
    with unit stride along its rows. One loop per kind of weight (4, 6 or 8 bits, with or without mins) and row
    count, picked at run time. x86 only (AVX2's integer ops)."""

    def codegen(context, builder, signature, args):
        _product(builder, context, signature, args, 4, range(1, ROW_GROUP + 1), range(1, WIDE_ROWS + 1))
        return context.get_dummy_value()

    return types.void(xq, d, sums, totals, data, scales, mins, index, out), codegen


@intrinsic
def half_tile(typingctx, xq, d, sums, totals, data, scales, mins, index, half, out):
    """out[r, :TILE / 2] = xq[r] @ W[columns of half `half` (0 or 1) of tile `index`].T for each of xq's 1 to
    GEMM_ROWS rows: tile()'s product, the same operations for each output (so the same floats), on half the
    columns for more rows a pass (large batches: each weight vector multiplies more rows while in a register)."""

    def codegen(context, builder, signature, args):
        # (with WIDE every weight takes whole tiles at any batch: _integer_run)
        _product(builder, context, signature, args, 2, range(1, GEMM_ROWS + 1), None)
        return context.get_dummy_value()

    return types.void(xq, d, sums, totals, data, scales, mins, index, half, out), codegen


def _fma(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
    """a * b + c over 8 float lanes, in one instruction."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_FLOATS, [_FLOATS] * 3), "llvm.fma.v8f32")
    return builder.call(fn, [a, b, c])
