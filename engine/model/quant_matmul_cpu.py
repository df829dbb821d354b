"""Small-batch matmuls on CPU that stream quantized weights as they are (4-bit or 8-bit integers, a scale and
min per group of k): the bytes read per decode step are the file's, not fp32's.

Layout (packed_matmul_cpu's tiles, with integers): a weight [N, K] in QuantRows form becomes
- data [ceil(N / TILE), K, TILE / 2] uint8 for 4 bits (byte j of a k: column j low, column j + 16 high) or
  [.., K, TILE] (int8 bits) for 8 bits: each thread reads its tiles as one sequential stream;
- scales, mins [tiles, K / group, TILE] float32, or their fp16 bits as int16 where all are fp16 values (mins
  [tiles, 0, TILE] when the format has none).

The microkernel keeps, for each of up to ROW_GROUP rows, two 16-float accumulators of the group's
sum of x[k] * q[k] (q widened to float in registers); at each group's end it adds scale * group sum and
min * (the group's sum of x) to the row's product, which waits in `out` (L1) between groups. So the arithmetic is float32 throughout, and the
integer products never round: the result is the dequantized weight's product to fp32 summation order.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from engine.model import kernel_cache  # numba's cache folder, set before any @njit below
from engine.model import quant_dot_cpu, simd
from engine.model.bfloat16_bits import as_float32
from engine.model.cpu_threads import launch_lock, use_threads
from engine.model.packed_matmul_cpu import PREFETCH_BYTES, REGISTERS, TILE, matmul
from engine.model.quant_dot_cpu import SCALES_AHEAD
from engine.model.quant_formats import QuantRows
from engine.model.simd import LANES, const

HALF = TILE // 2
_BYTES = ir.VectorType(ir.IntType(8), LANES)
_WORDS = ir.VectorType(simd.I32, LANES)
_HALVES = ir.VectorType(ir.HalfType(), LANES)
# AVX-512's vpermps looks a float up by the low 4 bits of each 32-bit lane: a nibble's float in one instruction
# where masking and converting took two (a pass of 8 rows is bound by its vector instructions)
NIBBLE_LOOKUP = kernel_cache.TARGET_ISA == "avx512"


def row_group(isa: str) -> int:
    """Rows one pass over a tile serves: each row keeps its 2 group-sum vectors in registers beside the
    tile's 2 weight vectors and a broadcast (the running product lives in `out`, in L1, updated once a
    group); AVX2: 2, AVX-512: 8."""
    registers, per_vector = REGISTERS[isa]
    return max(1, min(8, (registers // per_vector - 3) // 2))


ROW_GROUP = row_group(kernel_cache.TARGET_ISA)


@dataclass(frozen=True)
class QuantTiles:
    """A quantized weight packed for the kernels (torch tensors, so a module can hold them). Scales and mins are
    float32, or their fp16 bits as int16 where every one is an fp16 value (`QuantRows.half_exact`)."""
    data: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    group: int
    out_features: int

    @property
    def bits(self) -> int:
        return 4 if self.data.shape[2] in (HALF, quant_dot_cpu.BYTES_4BIT) else 8

    @property
    def integer(self) -> bool:
        """Whether the matmuls run on integer dot products (quant_dot_cpu's layout), not float arithmetic."""
        return quant_dot_cpu.is_quads(self.data.numpy())

    @property
    def in_features(self) -> int:
        return self.scales.shape[1] * self.group

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scales, self.mins))

    def arrays(self) -> tuple:
        """The numba view: (data, scales, mins, group)."""
        return self.data.numpy(), self.scales.numpy(), self.mins.numpy(), self.group


def pack(rows: QuantRows, integer: bool = False, half: bool = False) -> QuantTiles:
    """The weight's tiles: for integer dot products (quant_dot_cpu, x86 only) where `integer` and the format
    allows, else for the float kernel here, its scales and mins as fp16 bits where `half` (exact only where
    `rows.half_exact`: a model's weights all take one kind, so that its compiled step has one signature)."""
    as_tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    if integer and quant_dot_cpu.X86 and quant_dot_cpu.fits(rows):
        return QuantTiles(*map(as_tensor, quant_dot_cpu.pack(rows)), rows.group, rows.shape[0])
    n, k = rows.shape
    tiles = -(-n // TILE)
    q = np.zeros((tiles * TILE, k), rows.q.dtype)
    q[:n] = rows.q
    q = q.reshape(tiles, TILE, k).transpose(0, 2, 1)  # [tiles, K, TILE]
    if rows.bits == 4:
        data = (q[..., :HALF] | (q[..., HALF:] << 4)).astype(np.uint8)
    else:
        data = q.astype(np.int8).view(np.uint8)

    def per_group(values: np.ndarray | None) -> np.ndarray:
        padded = np.zeros((tiles * TILE, 0 if values is None else values.shape[1]), np.float32)
        if values is not None:
            padded[:n] = values
        grouped = padded.reshape(tiles, TILE, -1).transpose(0, 2, 1)
        return grouped.astype(np.float16).view(np.int16) if half else grouped

    return QuantTiles(as_tensor(data), as_tensor(per_group(rows.scales)), as_tensor(per_group(rows.mins)),
                      rows.group, n)


def linear(x: torch.Tensor, weight: QuantTiles, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T + bias for x [rows, K], W the quantized weight; in x's dtype."""
    out = torch.empty(x.shape[0], weight.out_features)
    b = bias.detach().float().numpy() if bias is not None else np.zeros(0, np.float32)
    with launch_lock:
        threads = use_threads()
        quant_matmul(x.float().contiguous().numpy(), *weight.arrays(), b, out.numpy(), False, threads)
    return out.to(x.dtype)


def activations_of(x: torch.Tensor, weight: QuantTiles) -> torch.Tensor:
    """x as the weight's kernel multiplies it (float32 [rows, K]): rounded to int8 steps for integer dot products
    (each value d * round(x / d) of its group), else as it is."""
    if not weight.integer:
        return x
    out = torch.empty(x.shape)
    quant_dot_cpu.round_activations(x.contiguous().numpy(), out.numpy())
    return out


def dequantize_rows(weight: QuantTiles, first: int, out: torch.Tensor) -> torch.Tensor:
    """out[r] = W[first + r] in float32, for every row of out [rows, K]."""
    with launch_lock:
        _dequantize(*weight.arrays(), first, use_threads(), out.numpy())
    return out


def prefill_linear(x: torch.Tensor, weight: QuantTiles, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T + bias for many rows of float32 x (prefill: compute-bound): W dequantized a block of its rows at a
    time into one reused scratch, each block multiplied by oneDNN's GEMM. A fresh float32 copy of the whole W per
    call spent much of its time in page faults, and a large model's copy is hundreds of MB."""
    n, k = weight.out_features, weight.in_features
    block_rows = max(TILE, PREFILL_BLOCK_BYTES // (4 * k) // TILE * TILE)
    scratch = _prefill_scratch(min(block_rows, n) * k)
    out = torch.empty(x.shape[0], n)
    for first in range(0, n, block_rows):
        rows = min(block_rows, n - first)
        block = dequantize_rows(weight, first, scratch[:rows * k].view(rows, k))
        out[:, first:first + rows] = torch.mm(x, block.T)
    return out.add_(bias) if bias is not None else out  # (in place: out is this call's own)


PREFILL_BLOCK_BYTES = 16 << 20  # much smaller blocks leave the GEMM too few output columns to run at speed
_local = threading.local()  # a scratch per thread: two engines in one process may prefill at once


def _prefill_scratch(numel: int) -> torch.Tensor:
    scratch = getattr(_local, "scratch", None)
    if scratch is None or scratch.numel() < numel:
        scratch = _local.scratch = torch.empty(numel)
    return scratch


def embedding_rows(weight: QuantTiles, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the weight (an embedding table read from its tied lm_head) in float32."""
    out = torch.empty(len(ids), weight.in_features)
    _rows(*weight.arrays(), ids.numpy(), out.numpy())
    return out


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE)
def _row(data, scales, mins, group, row, out):
    """out[k] = W[row, k] for one row of the packed weight."""
    if quant_dot_cpu.is_quads(data):
        quant_dot_cpu.row(data, scales, mins, row, out)
        return
    # a group at a time, its scale and min hoisted: a division and two branches per weight made prefill's
    # dequantization several times slower than its memory traffic
    tile, j = row // TILE, row % TILE
    has_min = mins.shape[1] > 0
    byte, shift = j % HALF, (j // HALF) * 4  # 4 bits: column j is the low nibble of byte j, j - 16 the high one
    for g in range(scales.shape[1]):
        scale = _as_float(scales[tile, g, j])
        low = _as_float(mins[tile, g, j]) if has_min else np.float32(0.0)
        if data.shape[2] == HALF:
            for k in range(g * group, (g + 1) * group):
                out[k] = np.float32((data[tile, k, byte] >> shift) & 0x0F) * scale + low
        else:
            for k in range(g * group, (g + 1) * group):
                out[k] = np.float32(np.int8(data[tile, k, j])) * scale + low


def _as_float(value):
    """A scale or min as float32: itself, or its fp16 bits (int16) widened."""


@overload(_as_float, inline="always")
def _as_float_for(value):
    if value == types.int16:
        return lambda value: _half_to_float(value)
    return lambda value: value


@intrinsic
def _half_to_float(typingctx, bits):
    def codegen(context, builder, signature, args):
        return _float_of_half_bits(builder, args[0])
    return types.float32(types.int16), codegen


def _float_of_half_bits(builder: ir.IRBuilder, bits: ir.Value) -> ir.Value:
    """The float32 of an fp16 held as its bits (an i16)."""
    return builder.fpext(builder.bitcast(bits, ir.HalfType()), ir.FloatType())


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE)
def _rows(data, scales, mins, group, ids, out):
    for r in range(len(ids)):
        _row(data, scales, mins, group, ids[r], out[r])


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE, parallel=True)
def _dequantize(data, scales, mins, group, first, threads, out):
    """out[r] = W[first + r] for every row of out: whole tiles LANES k's at a time by _dequantize_block, the rest
    (a last partial tile, a start inside a tile, other layouts) row by row."""
    rows, k_len = out.shape
    blocks = (first % TILE == 0 and group % LANES == 0 and k_len % LANES == 0
              and not quant_dot_cpu.is_quads(data))
    whole = rows // TILE if blocks else 0
    parts = min(threads, max(whole, 1))
    for part in prange(parts):
        for t in range(part * whole // parts, (part + 1) * whole // parts):
            for k in range(0, k_len, LANES):
                _dequantize_block(data, scales, mins, first // TILE + t, k // group, k, out, t * TILE)
    rest = rows - whole * TILE
    parts = min(threads, max(rest, 1))
    for part in prange(parts):
        for row in range(whole * TILE + part * rest // parts, whole * TILE + (part + 1) * rest // parts):
            _row(data, scales, mins, group, first + row, out[row])


@intrinsic
def _dequantize_block(typingctx, data, scales, mins, tile, g, k, out, row):
    """out[row + j, k:k + LANES] = W[tile * TILE + j, k:k + LANES] for the tile's TILE rows j, k a multiple of LANES
    inside group g: the LANES k's of the tile's integers (LANES bytes each, twice for 8 bits) transposed in
    registers, so that a row's LANES weights are one store where row by row each weight was a load of its
    own byte (prefill dequantizes every weight once a step). Each weight is q * scale + min in one rounding,
    as _row computes it."""
    def codegen(context, builder, signature, args):
        data_arg, scales_arg, mins_arg, tile_arg, g_arg, k_arg, out_arg, row_arg = args
        data_ary, scales_ary, mins_ary, out_ary = [context.make_array(signature.args[i])(context, builder, args[i])
                                                    for i in (0, 1, 2, 6)]
        half = signature.args[1].dtype == types.int16  # scales and mins as fp16 bits
        _, k_len, width = cgutils.unpack_tuple(builder, data_ary.shape, 3)
        groups = cgutils.unpack_tuple(builder, scales_ary.shape, 3)[1]
        has_min = builder.icmp_signed(">", cgutils.unpack_tuple(builder, mins_ary.shape, 3)[1], const(0))
        out_row = builder.udiv(cgutils.unpack_tuple(builder, out_ary.strides, 2)[0], const(4))  # in elements
        byte = ir.IntType(8).as_pointer()
        first_k = builder.gep(builder.bitcast(data_ary.data, byte),
                              [builder.mul(builder.add(builder.mul(tile_arg, k_len), k_arg), width)])
        at_group = builder.mul(builder.add(builder.mul(tile_arg, groups), g_arg), const(TILE))

        def scalar(ary, column):  # a scale or min of this group for one column, as float32
            value = builder.load(builder.gep(ary.data, [builder.add(at_group, const(column))]))
            return _float_of_half_bits(builder, value) if half else value

        def store_column(column, weights):
            scale = simd.broadcast(builder, scalar(scales_ary, column))
            with builder.if_else(has_min) as (with_min, without):
                with with_min:
                    low = simd.broadcast(builder, scalar(mins_ary, column))
                    block = builder.block
                with without:
                    block_none = builder.block
            low_or_zero = builder.phi(simd.FLOATS)
            low_or_zero.add_incoming(low, block)
            low_or_zero.add_incoming(ir.Constant(simd.FLOATS, None), block_none)
            to = builder.gep(out_ary.data, [builder.add(builder.mul(builder.add(row_arg, const(column)), out_row),
                                                        k_arg)])
            simd.store(builder, simd.fma(builder, weights, scale, low_or_zero), to)

        def transposed(offset, widen):  # LANES k's of LANES bytes from `offset` on, byte j of each k in vector j
            k_rows = []
            for i in range(LANES):
                here = builder.gep(first_k, [builder.add(builder.mul(const(i), width), const(offset))])
                raw = builder.load(builder.bitcast(here, _BYTES.as_pointer()), align=1)
                k_rows.append(builder.bitcast(widen(raw, _WORDS), simd.FLOATS))
            return [builder.bitcast(v, _WORDS) for v in simd.transpose(builder, k_rows)]

        with builder.if_else(builder.icmp_signed("==", width, const(HALF))) as (four_bit, eight_bit):
            with four_bit:  # byte j: column j in its low nibble, column j + HALF in its high one
                for j, lanes in enumerate(transposed(0, builder.zext)):
                    store_column(j, builder.sitofp(builder.and_(lanes, ir.Constant(_WORDS, [0x0F] * LANES)),
                                                   simd.FLOATS))
                    store_column(j + HALF, builder.sitofp(builder.lshr(lanes, ir.Constant(_WORDS, [4] * LANES)),
                                                          simd.FLOATS))
            with eight_bit:  # byte j of the c-th half: column c * LANES + j, an int8
                for c in range(TILE // LANES):
                    for j, lanes in enumerate(transposed(c * LANES, builder.sext)):
                        store_column(c * LANES + j, builder.sitofp(lanes, simd.FLOATS))
        return context.get_dummy_value()

    return types.void(data, scales, mins, tile, g, k, out, row), codegen


# (fastmath=False, said: a callee left unset inherits its first caller's fastmath, under which the sums were
# reordered differently in each caller compiled, so that fp16 and float32 scales gave different last bits)
@njit(fastmath=False, nogil=True, cache=kernel_cache.CACHE)
def _group_sums(x, group, has_min):
    """sums[r, g] = x[r, g * group:(g + 1) * group].sum() added in order: what the mins multiply (none without
    mins). One group after the other: an index k // group per k cost a one-row matmul as much as its launch."""
    if not has_min:
        return np.zeros((x.shape[0], 0), np.float32)
    sums = np.empty((x.shape[0], x.shape[1] // group), np.float32)
    for r in range(x.shape[0]):
        for g in range(sums.shape[1]):
            total = np.float32(0.0)
            for k in range(g * group, (g + 1) * group):
                total += x[r, k]
            sums[r, g] = total
    return sums


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE, parallel=True)
def quant_matmul(x, data, scales, mins, group, bias, out, accumulate, threads):
    """out (+)= x @ W.T + bias (none if empty) for x [rows, K] float32 and W packed by pack(). Each of the
    `threads` takes an equal run of tiles: one sequential stream of the weight."""
    if quant_dot_cpu.is_quads(data):
        _integer_matmul(x, data, scales, mins, bias, out, accumulate, threads)
        return
    tiles = data.shape[0]
    parts = min(threads, tiles)
    sums = _group_sums(x, group, mins.shape[1] > 0)
    for part in prange(parts):
        scratch = np.empty((ROW_GROUP, TILE), np.float32)
        for tile in range(part * tiles // parts, (part + 1) * tiles // parts):
            for first in range(0, x.shape[0], ROW_GROUP):
                _tile_rows(x[first:first + ROW_GROUP], data, scales, mins, sums[first:first + ROW_GROUP], tile,
                           group, scratch)
                _add_out(scratch, min(ROW_GROUP, x.shape[0] - first), bias, out, first, tile * TILE, accumulate)


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE, parallel=True)
def _integer_matmul(x, data, scales, mins, bias, out, accumulate, threads):
    """quant_matmul on integer dot products: x quantized to int8 per group of 32 once, then the tiles as there."""
    rows, groups = x.shape[0], x.shape[1] // quant_dot_cpu.GROUP
    xq = np.empty(x.shape, np.int8)
    d, sums = np.empty((rows, groups), np.float32), np.empty((rows, groups), np.float32)
    quant_dot_cpu.quantize_activations(x, xq, d, sums)
    tiles = data.shape[0]
    parts = min(threads, tiles)
    step = quant_dot_cpu.ROW_GROUP
    for part in prange(parts):
        scratch = np.empty((step, TILE), np.float32)
        for tile in range(part * tiles // parts, (part + 1) * tiles // parts):
            for first in range(0, rows, step):
                quant_dot_cpu.tile(xq[first:first + step], d[first:first + step], sums[first:first + step],
                                   data, scales, mins, tile, scratch)
                _add_out(scratch, min(step, rows - first), bias, out, first, tile * TILE, accumulate)


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE)
def _tile_rows(x, data, scales, mins, sums, tile, group, out):
    """_tile with the literal bits and has_min of this weight (each pair its own compiled loop)."""
    if data.shape[2] == HALF:
        if mins.shape[1]:
            _tile(x, data, scales, mins, sums, tile, group, out, 4, True)
        else:
            _tile(x, data, scales, mins, sums, tile, group, out, 4, False)
    elif mins.shape[1]:
        _tile(x, data, scales, mins, sums, tile, group, out, 8, True)
    else:
        _tile(x, data, scales, mins, sums, tile, group, out, 8, False)


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE)
def _add_out(scratch, rows, bias, out, first, start, accumulate):
    """out[first + m, start + j] (+)= scratch[m, j] + bias[start + j] for m < rows and the columns out has."""
    for m in range(rows):
        for j in range(min(TILE, out.shape[1] - start)):
            value = scratch[m, j] + (bias[start + j] if len(bias) else np.float32(0.0))
            if accumulate:
                out[first + m, start + j] += value
            else:
                out[first + m, start + j] = value


@intrinsic
def _tile(typingctx, x, data, scales, mins, sums, tile, group, out, bits, has_min):
    """out[r, :TILE] = x[r, :] @ W[tile].T for each of x's 1 to ROW_GROUP rows (the literal `bits` and
    `has_min` pick the code): x [rows, K] float32 with unit stride along K, data / scales / mins contiguous
    as pack() makes them (scales and mins float32 or fp16 bits), sums [rows, K / group] the group sums of x (read only with mins), out [>= rows,
    >= TILE] float32 with unit stride along its rows."""
    if not isinstance(bits, types.IntegerLiteral) or not isinstance(has_min, types.BooleanLiteral):
        return None  # numba then retries with the literal values of the constants the caller passes

    def codegen(context, builder, signature, args):
        x_arg, data_arg, scales_arg, mins_arg, sums_arg, tile_arg, group_arg, out_arg, _, _ = args
        arrays = [context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 1, 2, 3, 4, 7)]
        x_ary, data_ary, scales_ary, mins_ary, sums_ary, out_ary = arrays
        four_bit, with_min = bits.literal_value == 4, has_min.literal_value
        half = signature.args[2].dtype == types.int16  # scales and mins as fp16 bits

        def per_group_vectors(base):  # the 32 scales (or mins) of one group from `base` as 2 float vectors
            if not half:
                return simd.load_pieces(builder, base, 2, False)
            return [builder.fpext(builder.load(builder.bitcast(builder.gep(base, [const(v * LANES)]),
                                                               _HALVES.as_pointer()), align=2), simd.FLOATS)
                    for v in range(2)]
        rows, k_len = cgutils.unpack_tuple(builder, x_ary.shape, 2)
        x_row = builder.udiv(cgutils.unpack_tuple(builder, x_ary.strides, 2)[0], const(4))  # in elements
        out_row = builder.udiv(cgutils.unpack_tuple(builder, out_ary.strides, 2)[0], const(4))
        sums_row = builder.udiv(cgutils.unpack_tuple(builder, sums_ary.strides, 2)[0], const(4))
        width = HALF if four_bit else TILE  # bytes of one k of a tile
        groups = builder.udiv(k_len, group_arg)
        tile_data = builder.gep(data_ary.data, [builder.mul(tile_arg, builder.mul(k_len, const(width)))])
        tile_scales = builder.gep(scales_ary.data, [builder.mul(tile_arg, builder.mul(groups, const(TILE)))])
        tile_mins = builder.gep(mins_ary.data, [builder.mul(tile_arg, builder.mul(groups, const(TILE)))])

        def weights_at(here):  # the tile's 32 weights of one k, at `here`, as 2 float vectors (columns 0-15, 16-31)
            if four_bit:
                raw = builder.load(builder.bitcast(here, _BYTES.as_pointer()), align=1)
                wide = builder.zext(raw, _WORDS)
                low = builder.and_(wide, ir.Constant(_WORDS, [0x0F] * LANES))  # (unused, and dropped, on AVX-512)
                high = builder.lshr(wide, ir.Constant(_WORDS, [4] * LANES))
                if NIBBLE_LOOKUP:
                    return [_nibble_floats(builder, wide), _nibble_floats(builder, high)]
                return [builder.sitofp(low, simd.FLOATS), builder.sitofp(high, simd.FLOATS)]
            return [builder.sitofp(builder.load(builder.bitcast(builder.gep(here, [const(v * LANES)]),
                                                               _BYTES.as_pointer()), align=1), simd.FLOATS)
                    for v in range(2)]

        def out_at(r, v):
            return builder.gep(out_ary.data, [builder.add(builder.mul(const(r), out_row), const(v * LANES))])

        def product(num_rows):
            zero = ir.Constant(simd.FLOATS, None)
            for r in range(num_rows):
                for v in range(2):
                    simd.store(builder, zero, out_at(r, v))

            def group_step(g, _):
                first_k = builder.mul(g, group_arg)
                at = builder.mul(g, const(TILE))
                for ahead in (tile_scales, tile_mins) if with_min else (tile_scales,):
                    simd.prefetch_lines(builder, builder.gep(ahead, [at]), SCALES_AHEAD, TILE * (2 if half else 4))

                def k_step(i, partial):  # partial[r * 2 + v] += x[r, k] * q[k, v-th half of the tile]
                    k = builder.add(first_k, i)
                    here = builder.gep(tile_data, [builder.mul(k, const(width))])
                    simd.prefetch(builder, here, PREFETCH_BYTES)  # (a line holds 2 or 4 k's: asked as often)
                    w = weights_at(here)
                    summed = []
                    for r in range(num_rows):
                        x_rk = simd.broadcast(builder, builder.load(
                            builder.gep(x_ary.data, [builder.add(builder.mul(const(r), x_row), k)])))
                        summed += [simd.fma(builder, w[v], x_rk, partial[r * 2 + v]) for v in range(2)]
                    return summed

                partial = simd.accumulate(builder, group_arg, num_rows * 2, k_step)
                scale = per_group_vectors(builder.gep(tile_scales, [at]))
                low = per_group_vectors(builder.gep(tile_mins, [at])) if with_min else None
                for r in range(num_rows):
                    x_sum = simd.broadcast(builder, builder.load(builder.gep(
                        sums_ary.data, [builder.add(builder.mul(const(r), sums_row), g)]))) if with_min else None
                    for v in range(2):
                        to = out_at(r, v)
                        total = simd.fma(builder, scale[v], partial[r * 2 + v], simd.load(builder, to, False))
                        simd.store(builder, simd.fma(builder, low[v], x_sum, total) if with_min else total, to)
                return []

            simd.accumulate(builder, groups, 0, group_step)

        simd.cases(builder, rows, range(1, ROW_GROUP + 1), product)
        return context.get_dummy_value()

    return types.void(x, data, scales, mins, sums, tile, group, out, bits, has_min), codegen


def _nibble_floats(builder: ir.IRBuilder, lanes: ir.Value) -> ir.Value:
    """The float of each 32-bit lane's low 4 bits (AVX-512's vpermps over the table 0.0 .. 15.0)."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(simd.FLOATS, [simd.FLOATS, _WORDS]),
                                        "llvm.x86.avx512.permvar.sf.512")
    return builder.call(fn, [ir.Constant(simd.FLOATS, [float(i) for i in range(LANES)]), lanes])


def linear_into(x, weight, bias, out, accumulate, threads):
    """out (+)= x @ weight.T + bias inside compiled code, for a weight packed either way: float tiles
    (packed_matmul_cpu) or the (data, scales, mins, group) of quantized ones."""


@overload(linear_into)
def _linear_into(x, weight, bias, out, accumulate, threads):
    if isinstance(weight, types.Array):
        return lambda x, weight, bias, out, accumulate, threads: matmul(x, weight, bias, out, accumulate, threads)

    def quantized(x, weight, bias, out, accumulate, threads):
        quant_matmul(x, weight[0], weight[1], weight[2], weight[3], bias, out, accumulate, threads)
    return quantized


def embed_row(table, token, out):
    """out[:] = row `token` of an embedding table inside compiled code: float tiles [V / T, H, T] or the
    (data, scales, mins, group) of quantized ones."""


@overload(embed_row)
def _embed_row(table, token, out):
    if isinstance(table, types.Array):
        def from_tiles(table, token, out):
            tile = table.shape[2]
            for i in range(out.shape[0]):
                out[i] = as_float32(table[token // tile, i, token % tile])
        return from_tiles
    return lambda table, token, out: _row(table[0], table[1], table[2], table[3], token, out)
