"""Small-batch matmuls on CPU that stream quantized weights as they are (4-bit or 8-bit integers, a scale and
min per group of k): the bytes read per decode step are the file's, not fp32's.

Layout (packed_matmul_cpu's tiles, with integers): a weight [N, K] in QuantRows form becomes
- data [ceil(N / TILE), K, width] uint8, each thread reading its tiles as one sequential stream; per k of a tile:
  - 4 bits, width TILE / 2: byte j holds column j (low nibble) and column j + 16 (high nibble);
  - 6 bits, width 3 TILE / 4: 8 lanes of 3 bytes, lane l (bytes 3l .. 3l + 2, little-endian) holding columns
    l, l + 8, l + 16, l + 24 at bits 0, 6, 12, 18, each q as 6-bit two's complement;
  - 8 bits, width TILE: column j's int8 in byte j;
- scales, mins in one of three kinds, the same for a whole model (its compiled step has one signature):
  - float32 [tiles, K / group, TILE];
  - fp16 bits as int16, the same shape, where every one is an fp16 value (`QuantRows.half_exact`);
  - super-block records (int8) [tiles, K / size, SUPER_HEAD + size / group * TILE] for the K-quants' two levels
    (`QuantRows.super_blocks`): the fp16 factor of each column (SUPER_HEAD bytes), then for each group of the
    super-block a run of TILE int8 sub-scales; the kernels widen both and multiply, which is exact;
  mins [tiles, 0, ..] when the format has none.

The microkernel keeps, for each of up to ROW_GROUP rows, two 16-float accumulators of the group's
sum of x[k] * q[k] (q widened to float in registers; on AVX-512 the even k's and the odd ones apart, then added:
SPLIT_K); at each group's end it adds scale * group sum and
min * (the group's sum of x) to the row's product, which waits in `out` (L1) between groups. So the arithmetic
is float32 throughout, and the integer products never round: the result is the dequantized weight's product to
fp32 summation order. Where registers hold twice the rows for half a tile (AVX2: 4 against 2), steps with more rows
than ROW_GROUP take 6- and 8-bit tiles by halves: each group's passes, one for each half and block of rows, read
its bytes from memory once and from L1 after, and widen each weight once for 4 rows.
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
from engine.model import cpu_gemm, quant_dot_cpu, simd
from engine.model.bfloat16_bits import as_float32
from engine.model.cpu_threads import launch_lock, use_threads
from engine.model.packed_matmul_cpu import PREFETCH_BYTES, REGISTERS, TILE, tile_run
from engine.model.quant_dot_cpu import SCALES_AHEAD, SUPER_HEAD
from engine.model.quant_formats import QuantRows
from engine.model.simd import LANES, const

HALF = TILE // 2  # bytes of a k of 4-bit tiles
SIX_BIT = 3 * TILE // 4  # bytes of a k of 6-bit tiles: 8 lanes of 3 bytes, 4 columns of 6 bits each
SCALE_KINDS = ("float32", "fp16", "super-blocks")
_BYTES = ir.VectorType(ir.IntType(8), LANES)
_WORDS = ir.VectorType(simd.I32, LANES)


def words(value: int) -> ir.Constant:
    """`value` in each of LANES 32-bit lanes."""
    return ir.Constant(_WORDS, [value] * LANES)


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


def half_rows(isa: str) -> int:
    """Rows one pass over half a tile serves, for steps with more rows than row_group(isa): each row keeps one
    group-sum vector beside the half's weight vector and a broadcast, so each weight is widened once for twice
    the rows; 0 where that is no more than a whole tile's pass serves (AVX-512). At most 4: on AVX2 the 4 rows'
    sums take 8 of the 16 registers (8 FMA chains, as many as both FMA pipes need at their latency), the half's
    weights 2, the broadcast 1, the widening the rest."""
    registers, per_vector = REGISTERS[isa]
    rows = min(4, registers // per_vector - 2)
    return rows if rows > row_group(isa) else 0


HALF_ROWS = half_rows(kernel_cache.TARGET_ISA)
# steps of up to this many rows run this kernel, by a weight's bits (linear.Linear); larger ones dequantize the
# weight for a GEMM (prefill_linear). On the 2-core AVX2 EPYC (2 rows a pass) the kernel took 0.5-0.8x the GEMM's
# time for a layer's matmuls at 33-64 rows on 4- and 6-bit files and 0.4-0.9x at 33-128 on Q8_0, and more beyond;
# on the Zen 5 EPYC (AVX-512: 8 rows a pass) 0.6-0.8x at 128 rows on every format, at 256 0.9x on 4 bits, 0.8-0.9x
# on Q8_0 and 1.07x on Q6_K, at 512 1.1-1.2x (docs/speed.md#rows-per-quantized-kernel)
KERNEL_ROWS = {4: 256, 6: 128, 8: 256} if kernel_cache.TARGET_ISA == "avx512" else {4: 64, 6: 64, 8: 128}
# each group's even and odd k's summed apart, then added: two FMA chains a sum, on AVX-512, where a tile's pass at
# 1 row has 2 sums and both FMA pipes waited on their latency (Q4_1, 1 row, from memory: 0.78-0.83 -> 0.71 ns a k
# of a tile; the default model's batch-1 step 6% faster). AVX2's passes are bound by widening the weights: 5%
# faster at 1 row, 5% slower at 2, where the two runs' sums do not fit in its registers together
# (docs/speed.md#split-k-sums)
SPLIT_K = kernel_cache.TARGET_ISA == "avx512"


@dataclass(frozen=True)
class QuantTiles:
    """A quantized weight packed for the kernels (torch tensors, so a module can hold them), its scales and mins
    of one of SCALE_KINDS (the module docstring)."""
    data: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    group: int
    out_features: int

    @property
    def bits(self) -> int:
        width = self.data.shape[2]
        if width in (HALF, quant_dot_cpu.BYTES_4BIT):
            return 4
        return 6 if width in (SIX_BIT, quant_dot_cpu.BYTES_6BIT) else 8

    @property
    def integer(self) -> bool:
        """Whether the matmuls run on integer dot products (quant_dot_cpu's layout), not float arithmetic."""
        return quant_dot_cpu.is_quads(self.data.numpy())

    @property
    def in_features(self) -> int:
        return self.data.shape[1] * (quant_dot_cpu.QUAD if self.integer else 1)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scales, self.mins))

    def arrays(self) -> tuple:
        """The numba view: (data, scales, mins, group)."""
        return self.data.numpy(), self.scales.numpy(), self.mins.numpy(), self.group


def scale_kind(weights: list[QuantRows]) -> str:
    """The fewest bytes every one of a model's weights can hold its scales in exactly (one kind a model, for
    either layout): fp16 where all are fp16 values (Q8_0, Q4_0, Q4_1), super-block records where all have two
    levels that fit them (the K-quants, with those), else float32."""
    if all(rows.half_exact for rows in weights):
        return "fp16"
    return "super-blocks" if all(_records_fit(rows.super_blocks(), rows.group) for rows in weights) else "float32"


def _records_fit(levels, group: int) -> bool:
    """Whether super-block records hold these levels: groups per super-block a power of two (the kernels find a
    group's record by a shift)."""
    if levels is None:
        return False
    per_super = levels.size // group
    return per_super & (per_super - 1) == 0


def pack(rows: QuantRows, integer: bool = False, scales: str = "float32") -> QuantTiles:
    """The weight's tiles: for integer dot products (quant_dot_cpu, x86 only) where `integer` and the format
    allows, else for the float kernel here, its scales and mins of the kind `scales` (one of SCALE_KINDS; the
    rows must hold it exactly: scale_kind())."""
    if scales not in SCALE_KINDS:
        raise ValueError(f"scales must be one of {SCALE_KINDS}, not {scales!r}")
    as_tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    n, k = rows.shape
    tiles = -(-n // TILE)

    def columns(values: np.ndarray, dtype) -> np.ndarray:  # [N, X] -> [tiles, X, TILE], padded with zeros
        padded = np.zeros((tiles * TILE, values.shape[1]), dtype)
        padded[:n] = values
        return np.ascontiguousarray(padded.reshape(tiles, TILE, -1).transpose(0, 2, 1))

    def per_group(values: np.ndarray | None) -> np.ndarray:  # float32 or fp16 scales (or mins)
        grouped = columns(np.zeros((n, 0), np.float32) if values is None else values, np.float32)
        return grouped.astype(np.float16).view(np.int16) if scales == "fp16" else grouped

    if scales == "super-blocks":
        levels = rows.super_blocks()
        if not _records_fit(levels, rows.group):
            raise ValueError("these scales do not fit super-block records: see scale_kind()")
        per_super = levels.size // rows.group

        def records(d: np.ndarray | None, sub: np.ndarray | None) -> np.ndarray:
            if d is None:
                return np.zeros((tiles, 0, SUPER_HEAD + per_super * TILE), np.int8)
            head = columns(d.astype(np.float16), np.float16).view(np.int8)  # [tiles, K / size, SUPER_HEAD]
            subs = columns(sub, np.int8).reshape(tiles, -1, per_super * TILE)
            return np.concatenate([head, subs], axis=2)
        packed_scales, packed_mins = records(levels.d, levels.sub_scales), records(levels.dmin, levels.sub_mins)
    else:
        packed_scales, packed_mins = per_group(rows.scales), per_group(rows.mins)
    if integer and quant_dot_cpu.X86 and quant_dot_cpu.fits(rows):
        data = quant_dot_cpu.pack_data(rows)  # (int8: the quad layout's type)
    else:
        data = _float_layout(columns(rows.q, rows.q.dtype), rows.bits).astype(np.uint8, copy=False)
    return QuantTiles(as_tensor(data), as_tensor(packed_scales), as_tensor(packed_mins), rows.group, n)


def _float_layout(q: np.ndarray, bits: int) -> np.ndarray:
    """The float kernel's tiles of integers q [tiles, K, TILE]: 4 bits two to a byte, 6 bits as 4 and 2, else
    a byte each."""
    if bits == 4:
        return q[..., :HALF] | (q[..., HALF:] << 4)
    if bits == 6:
        # each lane's 24 bits put together byte by byte (in wider integers a large embedding took GBs at load)
        u = (q.astype(np.uint8) & 63).reshape(*q.shape[:-1], 4, 8)  # [.., field f, lane l]: column 8 f + l
        f = [u[..., i, :] for i in range(4)]
        lanes = [f[0] | (f[1] << 6), (f[1] >> 2) | (f[2] << 4), (f[2] >> 4) | (f[3] << 2)]
        return np.stack(lanes, axis=-1).reshape(*q.shape[:-1], SIX_BIT)
    return q.astype(np.int8).view(np.uint8)


def linear(x: torch.Tensor, weight: QuantTiles, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T + bias for x [rows, K], W the quantized weight; in x's dtype."""
    out = torch.empty(x.shape[0], weight.out_features)
    b = bias.detach().float().numpy() if bias is not None else np.zeros(0, np.float32)
    with launch_lock:
        threads = use_threads()
        quant_matmul(x.float().contiguous().numpy(), *weight.arrays(), b, out.numpy(), False, threads)
    return out.to(x.dtype)


def dequantize_rows(weight: QuantTiles, first: int, out: torch.Tensor) -> torch.Tensor:
    """out[r] = W[first + r] in float32, for every row of out [rows, K]."""
    with launch_lock:
        _dequantize(*weight.arrays(), first, use_threads(), out.numpy())
    return out


def prefill_linear(x: torch.Tensor, weight: QuantTiles, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T + bias for many rows of float32 x (prefill: compute-bound): W dequantized a block of its rows at a
    time into one reused scratch, each block multiplied by a float GEMM (cpu_gemm: OpenBLAS on AMD, else oneMKL).
    A fresh float32 copy of the whole W per call spent much of its time in page faults, and a large model's copy
    is hundreds of MB."""
    n, k = weight.out_features, weight.in_features
    block_rows = max(TILE, PREFILL_BLOCK_BYTES // (4 * k) // TILE * TILE)
    scratch = _prefill_scratch(min(block_rows, n) * k)
    out, x = torch.empty(x.shape[0], n), x.contiguous()
    for first in range(0, n, block_rows):
        rows = min(block_rows, n - first)
        block = dequantize_rows(weight, first, scratch[:rows * k].view(rows, k))
        cpu_gemm.matmul_nt(x, block, out[:, first:first + rows])
    return out.add_(bias) if bias is not None else out  # (in place: out is this call's own)


PREFILL_BLOCK_BYTES = 16 << 20  # much smaller blocks leave the GEMM too few output columns to run at speed
_local = threading.local()  # a scratch per thread: two engines in one process may prefill at once


def _prefill_scratch(numel: int) -> torch.Tensor:
    scratch = getattr(_local, "scratch", None)
    if scratch is None or scratch.numel() < numel:
        scratch = _local.scratch = torch.empty(numel)
    return scratch


def release_prefill_scratch() -> None:
    """Drops this thread's scratch (an engine going idle: its PREFILL_BLOCK_BYTES need not count at idle; the
    next prefill allocates it again, a few milliseconds of page faults against its hundreds)."""
    _local.scratch = None


def embedding_rows(weight: QuantTiles, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the weight (an embedding table read from its tied lm_head) in float32."""
    out = torch.empty(len(ids), weight.in_features)
    _rows(*weight.arrays(), ids.numpy(), out.numpy())
    return out


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE)
def _row(data, scales, mins, group, row, out):
    """out[k] = W[row, k] for one row of the packed weight, each weight q * scale + min rounded once (a fused
    multiply-add, as _dequantize_block computes whole tiles): exactly as QuantRows.dequantize has it."""
    # a group at a time, its scale and min hoisted: a division and two branches per weight made prefill's
    # dequantization several times slower than its memory traffic (and an fp16 scale widened per weight, 1.6x)
    tile, j = row // TILE, row % TILE
    has_min = mins.shape[1] > 0
    quads, width = quant_dot_cpu.is_quads(data), data.shape[2]
    byte, shift = j % HALF, (j // HALF) * 4  # 4 bits: column j's nibble in byte j % 16
    lane, field = j % 8, j // 8  # 6 bits: 3 bytes a lane, a field of 6 bits each of its 4 columns
    for g in range(out.shape[0] // group):
        scale = _group_value(scales, tile, g, j)
        low = _group_value(mins, tile, g, j) if has_min else np.float32(0.0)
        # (quads: groups of a constant size, GROUP or 6 bits' SIX_BIT_GROUP: with `group` this loop took twice as
        # long)
        if quads and width == quant_dot_cpu.BYTES_6BIT:
            for k in range(g * quant_dot_cpu.SIX_BIT_GROUP, (g + 1) * quant_dot_cpu.SIX_BIT_GROUP):
                out[k] = _fused(quant_dot_cpu.integer_at(data, row, k), scale, low)
        elif quads:
            for k in range(g * quant_dot_cpu.GROUP, (g + 1) * quant_dot_cpu.GROUP):
                out[k] = _fused(quant_dot_cpu.integer_at(data, row, k), scale, low)
        elif width == HALF:
            for k in range(g * group, (g + 1) * group):
                out[k] = _fused(np.float32((data[tile, k, byte] >> shift) & 0x0F), scale, low)
        elif width == SIX_BIT:
            for k in range(g * group, (g + 1) * group):
                word = (np.int32(data[tile, k, 3 * lane]) | (np.int32(data[tile, k, 3 * lane + 1]) << 8)
                        | (np.int32(data[tile, k, 3 * lane + 2]) << 16))
                u = (word >> (6 * field)) & 63
                out[k] = _fused(np.float32(u - 64 if u >= 32 else u), scale, low)
        else:
            for k in range(g * group, (g + 1) * group):
                out[k] = _fused(np.float32(np.int8(data[tile, k, j])), scale, low)


@intrinsic
def _fused(typingctx, a, b, c):
    """a * b + c for float32 scalars, rounded once (llvm.fma: left to fastmath, the contraction came and went
    with the code around it)."""
    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.FloatType(), [ir.FloatType()] * 3),
                                            "llvm.fma.f32")
        return builder.call(fn, list(args))
    return types.float32(types.float32, types.float32, types.float32), codegen


def _group_value(values, tile, g, j):
    """Group g's scale (or min) of column j of a tile as float32, from packed scales of any kind."""


@overload(_group_value, inline="always")
def _group_value_of(values, tile, g, j):
    if values.dtype == types.int8:  # super-block records
        def from_records(values, tile, g, j):
            per_super = (values.shape[2] - SUPER_HEAD) // TILE
            record = values[tile, g // per_super]
            bits = (np.int32(record[2 * j]) & 0xFF) | (np.int32(record[2 * j + 1]) << 8)
            return np.float32(record[SUPER_HEAD + (g % per_super) * TILE + j]) * _half_to_float(np.int16(bits))
        return from_records
    if values.dtype == types.int16:
        return lambda values, tile, g, j: _half_to_float(values[tile, g, j])
    return lambda values, tile, g, j: values[tile, g, j]


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
    inside group g: the LANES k's of the tile's integers (LANES bytes each, twice for 8 bits, 24 for 6 bits)
    transposed in registers, so that a row's LANES weights are one store where row by row each weight was a load
    of its own byte (prefill dequantizes every weight once a step). Each weight is q * scale + min in one rounding,
    as _row computes it."""
    def codegen(context, builder, signature, args):
        _, _, _, tile_arg, g_arg, k_arg, _, row_arg = args
        data_ary, scales_ary, mins_ary, out_ary = [context.make_array(signature.args[i])(context, builder, args[i])
                                                    for i in (0, 1, 2, 6)]
        kind = signature.args[1].dtype
        _, k_len, width = cgutils.unpack_tuple(builder, data_ary.shape, 3)
        has_min = builder.icmp_signed(">", cgutils.unpack_tuple(builder, mins_ary.shape, 3)[1], const(0))
        out_row = builder.udiv(cgutils.unpack_tuple(builder, out_ary.strides, 2)[0], const(4))  # in elements
        byte = ir.IntType(8).as_pointer()
        first_k = builder.gep(builder.bitcast(data_ary.data, byte),
                              [builder.mul(builder.add(builder.mul(tile_arg, k_len), k_arg), width)])
        group_of = [quant_dot_cpu.group_pointers(builder, kind, ary, tile_arg, g_arg) for ary in (scales_ary, mins_ary)]

        def scalar(which, column):  # a scale or min of this group for one column, as float32
            at, head = group_of[which]
            value = builder.load(builder.gep(at, [const(column)]))
            if kind == types.int8:
                factor = builder.load(builder.gep(builder.bitcast(head, ir.IntType(16).as_pointer()), [const(column)]))
                return builder.fmul(builder.sitofp(value, ir.FloatType()), _float_of_half_bits(builder, factor))
            return _float_of_half_bits(builder, value) if kind == types.int16 else value

        def store_column(column, weights):
            scale = simd.broadcast(builder, scalar(0, column))
            with builder.if_else(has_min) as (with_min, without):
                with with_min:
                    low = simd.broadcast(builder, scalar(1, column))
                    block = builder.block
                with without:
                    block_none = builder.block
            low_or_zero = builder.phi(simd.FLOATS)
            low_or_zero.add_incoming(low, block)
            low_or_zero.add_incoming(ir.Constant(simd.FLOATS, None), block_none)
            to = builder.gep(out_ary.data, [builder.add(builder.mul(builder.add(row_arg, const(column)), out_row),
                                                        k_arg)])
            simd.store(builder, simd.fma(builder, weights, scale, low_or_zero), to)

        def transposed(offset, widen, count=LANES):  # LANES k's of `count` bytes from `offset`: byte j in vector j
            k_rows = []
            for i in range(LANES):
                here = builder.gep(first_k, [builder.add(builder.mul(const(i), width), const(offset))])
                raw = builder.load(builder.bitcast(here, ir.VectorType(ir.IntType(8), count).as_pointer()), align=1)
                if count < LANES:  # (the rest of the vector zeros: a load past the k's bytes could leave the array)
                    raw = builder.shuffle_vector(raw, ir.Constant(raw.type, None), ir.Constant(
                        ir.VectorType(simd.I32, LANES), list(range(count)) + [count] * (LANES - count)))
                k_rows.append(builder.bitcast(widen(raw, _WORDS), simd.FLOATS))
            return [builder.bitcast(v, _WORDS) for v in simd.transpose(builder, k_rows)]

        def store_six_bit():  # lane l's 3 bytes as one word, each of its 4 fields shifted up to the top and back
            by_byte = transposed(0, builder.zext) + transposed(HALF, builder.zext, 8)
            for lane in range(8):
                b0, b1, b2 = by_byte[3 * lane:3 * lane + 3]
                word = builder.or_(b0, builder.or_(builder.shl(b1, words(8)), builder.shl(b2, words(16))))
                for field in range(4):
                    q = builder.ashr(builder.shl(word, words(26 - 6 * field)), words(26))
                    store_column(lane + 8 * field, builder.sitofp(q, simd.FLOATS))

        four = builder.icmp_signed("==", width, const(HALF))
        six = builder.icmp_signed("==", width, const(SIX_BIT))
        with builder.if_else(four) as (four_bit, wider):
            with four_bit:  # byte j: column j in its low nibble, column j + HALF in its high one
                for j, lanes in enumerate(transposed(0, builder.zext)):
                    store_column(j, builder.sitofp(builder.and_(lanes, words(0x0F)), simd.FLOATS))
                    store_column(j + HALF, builder.sitofp(builder.lshr(lanes, words(4)), simd.FLOATS))
            with wider:
                with builder.if_else(six) as (six_bit, eight_bit):
                    with six_bit:
                        store_six_bit()
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


def quant_matmul(x, data, scales, mins, group, bias, out, accumulate, threads):
    """out (+)= x @ W.T + bias (none if empty) for x [rows, K] float32 and W packed by pack(): on integer dot
    products for the quad layout (int8 data), else on the float kernel. Each of the `threads` takes an equal run
    of tiles: one sequential stream of the weight."""
    if quant_dot_cpu.is_quads(data):
        _integer_matmul(x, data, scales, mins, bias, out, accumulate, threads)
    else:
        _float_matmul(x, data, scales, mins, group, bias, out, accumulate, threads)


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE, parallel=True)
def _float_matmul(x, data, scales, mins, group, bias, out, accumulate, threads):
    tiles = data.shape[0]
    parts = min(threads, tiles)
    sums = _group_sums(x, group, mins.shape[1] > 0)
    for part in prange(parts):
        _tile_run(x, sums, data, scales, mins, group, bias, out, accumulate, part * tiles // parts,
                  (part + 1) * tiles // parts)


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE)
def _tile_run(x, sums, data, scales, mins, group, bias, out, accumulate, first_tile, end_tile):
    """quant_matmul's product for the output columns of tiles first_tile to end_tile - 1 (sums: _group_sums of
    x), on the calling thread."""
    # 4-bit tiles stay whole: by halves they came out no faster (bench.matmul's 65 matmuls of the 1B shapes at 4
    # rows, AVX2: Q4_0 118 ms twice against 106 and 127 whole), where a Q8_0 file's batch-4 decode step went
    # from 113-133 to 95-101 ms (bench.decode)
    by_halves = HALF_ROWS > 0 and x.shape[0] > ROW_GROUP and data.shape[2] != HALF
    step = 2 * HALF_ROWS if by_halves else ROW_GROUP
    scratch = np.empty((step, TILE), np.float32)
    for tile in range(first_tile, end_tile):
        for first in range(0, x.shape[0], step):
            _tile_rows(x[first:first + step], data, scales, mins, sums[first:first + step], tile, group, scratch,
                       by_halves)
            _add_out(scratch, min(step, x.shape[0] - first), bias, out, first, tile * TILE, accumulate)


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE, parallel=True)
def _integer_matmul(x, data, scales, mins, bias, out, accumulate, threads):
    """quant_matmul on integer dot products: x quantized to int8 per group of 32 once, then the tiles as there."""
    xq, d, sums, totals = _quantized_activations(x)
    tiles = data.shape[0]
    parts = min(threads, tiles)
    for part in prange(parts):
        _integer_run(xq, d, sums, totals, data, scales, mins, bias, out, accumulate, part * tiles // parts,
                     (part + 1) * tiles // parts)


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE)
def _quantized_activations(x):
    """x rounded to int8 per group of quant_dot_cpu.GROUP: (the integers, each group's step, its step times the sum
    of its integers, their sums per SIX_BIT_GROUP), as quant_dot_cpu.quantize_activations makes them."""
    rows, groups = x.shape[0], x.shape[1] // quant_dot_cpu.GROUP
    xq = np.empty(x.shape, np.int8)
    d, sums = np.empty((rows, groups), np.float32), np.empty((rows, groups), np.float32)
    totals = np.empty((rows, x.shape[1] // quant_dot_cpu.SIX_BIT_GROUP), np.int32)
    quant_dot_cpu.quantize_activations(x, xq, d, sums, totals)
    return xq, d, sums, totals


@njit(fastmath=False, nogil=True, cache=kernel_cache.CACHE)
def _integer_run(xq, d, sums, totals, data, scales, mins, bias, out, accumulate, first_tile, end_tile):
    """_integer_matmul's product for the output columns of tiles first_tile to end_tile - 1: whole tiles for up to
    ROW_GROUP rows (a decode step's: each byte of the weight read once), half tiles GEMM_ROWS rows at a time for
    more (compute-bound: more rows for each weight vector in a register); on 512-bit VNNI whole tiles WIDE_ROWS
    rows at a time at any batch. Not fastmath: numba would mark the kernels' float operations
    reassociable, and the two passes then round a super-block's scale times d apart."""
    rows = xq.shape[0]
    if rows == 0:  # (the kernels take a row count outside their cases for their largest)
        return
    step = quant_dot_cpu.TILE_ROWS
    if rows <= quant_dot_cpu.ROW_GROUP or step > quant_dot_cpu.ROW_GROUP:
        scratch = np.empty((min(rows, step), TILE), np.float32)
        for tile in range(first_tile, end_tile):
            for first in range(0, rows, step):
                quant_dot_cpu.tile(xq[first:first + step], d[first:first + step], sums[first:first + step],
                                   totals[first:first + step], data, scales, mins, tile, scratch)
                _add_out(scratch, min(step, rows - first), bias, out, first, tile * TILE, accumulate)
        return
    step = quant_dot_cpu.GEMM_ROWS
    scratch = np.empty((step, TILE), np.float32)
    for tile in range(first_tile, end_tile):
        for first in range(0, rows, step):
            for half in range(2):
                quant_dot_cpu.half_tile(xq[first:first + step], d[first:first + step], sums[first:first + step],
                                        totals[first:first + step], data, scales, mins, tile, half,
                                        scratch[:, half * TILE // 2:])
            _add_out(scratch, min(step, rows - first), bias, out, first, tile * TILE, accumulate)


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE)
def _tile_rows(x, data, scales, mins, sums, tile, group, out, by_halves):
    """_tile with the literal bits, has_min and by_halves of this weight and call (each its own compiled loop;
    4-bit tiles always whole)."""
    if by_halves:
        _tile_kind(x, data, scales, mins, sums, tile, group, out, True)
    else:
        _tile_kind(x, data, scales, mins, sums, tile, group, out, False)


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE)
def _tile_kind(x, data, scales, mins, sums, tile, group, out, by_halves):
    if data.shape[2] == HALF:
        if mins.shape[1]:
            _tile(x, data, scales, mins, sums, tile, group, out, 4, True, False)
        else:
            _tile(x, data, scales, mins, sums, tile, group, out, 4, False, False)
    elif data.shape[2] == SIX_BIT:
        if mins.shape[1]:
            _tile(x, data, scales, mins, sums, tile, group, out, 6, True, by_halves)
        else:
            _tile(x, data, scales, mins, sums, tile, group, out, 6, False, by_halves)
    elif mins.shape[1]:
        _tile(x, data, scales, mins, sums, tile, group, out, 8, True, by_halves)
    else:
        _tile(x, data, scales, mins, sums, tile, group, out, 8, False, by_halves)


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
def _tile(typingctx, x, data, scales, mins, sums, tile, group, out, bits, has_min, by_halves):
    """out[r, :TILE] = x[r, :] @ W[tile].T for each of x's 1 to ROW_GROUP rows, or with by_halves 1 to
    2 * HALF_ROWS rows, each group of K in a pass for each half of the tile's columns and each block of HALF_ROWS
    rows (the literal `bits`, `has_min` and `by_halves` pick the code): x [rows, K] float32 with unit stride
    along K, data / scales / mins contiguous as pack() makes them (scales and mins of any of SCALE_KINDS), sums
    [rows, K / group] the group sums of x (read only with mins), out [>= rows, >= TILE] float32 with unit stride
    along its rows."""
    if not all(isinstance(flag, types.BooleanLiteral) for flag in (has_min, by_halves)) \
            or not isinstance(bits, types.IntegerLiteral):
        return None  # numba then retries with the literal values of the constants the caller passes

    def codegen(context, builder, signature, args):
        tile_arg, group_arg = args[5], args[6]
        arrays = [context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 1, 2, 3, 4, 7)]
        x_ary, data_ary, scales_ary, mins_ary, sums_ary, out_ary = arrays
        with_min = has_min.literal_value
        kind = signature.args[2].dtype
        registers, per_vector = REGISTERS[kernel_cache.TARGET_ISA]

        def per_group_vectors(pointers):  # the 32 scales (or mins) of one group as 2 float vectors
            return [quant_dot_cpu.group_columns(builder, kind, pointers, v * LANES, LANES) for v in range(2)]

        rows, k_len = cgutils.unpack_tuple(builder, x_ary.shape, 2)
        x_row = builder.udiv(cgutils.unpack_tuple(builder, x_ary.strides, 2)[0], const(4))  # in elements
        out_row = builder.udiv(cgutils.unpack_tuple(builder, out_ary.strides, 2)[0], const(4))
        sums_row = builder.udiv(cgutils.unpack_tuple(builder, sums_ary.strides, 2)[0], const(4))
        width = {4: HALF, 6: SIX_BIT, 8: TILE}[bits.literal_value]  # bytes of one k of a tile
        groups = builder.udiv(k_len, group_arg)
        tile_data = builder.gep(data_ary.data, [builder.mul(tile_arg, builder.mul(k_len, const(width)))])

        def weights_at(here):  # the tile's 32 weights of one k, at `here`, as 2 float vectors (columns 0-15, 16-31)
            if width == SIX_BIT:
                return _six_bit_lanes(builder, here)
            if width == HALF:
                raw = builder.load(builder.bitcast(here, _BYTES.as_pointer()), align=1)
                wide = builder.zext(raw, _WORDS)
                low = builder.and_(wide, words(0x0F))  # (unused, and dropped, on AVX-512)
                high = builder.lshr(wide, words(4))
                if NIBBLE_LOOKUP:
                    return [_nibble_floats(builder, wide), _nibble_floats(builder, high)]
                return [builder.sitofp(low, simd.FLOATS), builder.sitofp(high, simd.FLOATS)]
            return [builder.sitofp(builder.load(builder.bitcast(builder.gep(here, [const(v * LANES)]),
                                                               _BYTES.as_pointer()), align=1), simd.FLOATS)
                    for v in range(2)]

        def out_at(r, v):
            return builder.gep(out_ary.data, [builder.add(builder.mul(const(r), out_row), const(v * LANES))])

        def product(num_rows, passes):
            """The tile's product for num_rows rows, each group of K in `passes` (rows, halves) one after the
            other (halves of 0: columns 0-15, 1: 16-31), each pass's group sums in registers: a group's bytes
            come from memory in the first pass and from L1 in the others, while the prefetches run ahead."""
            zero = ir.Constant(simd.FLOATS, None)
            for r in range(num_rows):
                for v in range(2):
                    simd.store(builder, zero, out_at(r, v))

            def group_step(g, _):
                first_k = builder.mul(g, group_arg)
                scales_at, mins_at = [quant_dot_cpu.group_pointers(builder, kind, ary, tile_arg, g)
                                      for ary in (scales_ary, mins_ary)]
                for ahead in (scales_at, mins_at) if with_min else (scales_at,):
                    simd.prefetch_lines(builder, ahead[0], SCALES_AHEAD, TILE * (kind.bitwidth // 8))
                scale = per_group_vectors(scales_at)
                low = per_group_vectors(mins_at) if with_min else None
                for number, (pass_rows, halves) in enumerate(passes):
                    pairs = [(r, v) for r in pass_rows for v in halves]

                    def k_step(i, partial, stride=1, parity=0):  # partial[p] += x[r, k] * q[k, half v] for
                        # (r, v) = pairs[p], k the group's k number stride * i + parity
                        k = builder.add(first_k, builder.add(builder.mul(i, const(stride)), const(parity)))
                        here = builder.gep(tile_data, [builder.mul(k, const(width))])
                        if number == 0:  # (a line holds 2 or 4 k's: asked as often)
                            simd.prefetch(builder, here, PREFETCH_BYTES)
                        w = weights_at(here)  # (a half's pass drops the other half's widening)
                        x_rk = {r: simd.broadcast(builder, builder.load(
                            builder.gep(x_ary.data, [builder.add(builder.mul(const(r), x_row), k)])))
                            for r in pass_rows}
                        return [simd.fma(builder, w[v], x_rk[r], partial[p]) for p, (r, v) in enumerate(pairs)]

                    if SPLIT_K:  # even k's and odd k's apart: in one loop where registers hold both sums, else
                        # the even k's and then the odd ones from L1 (every row count's sums alike)
                        pairs_of_k = builder.udiv(group_arg, const(2))  # (every format's groups are even)
                        if 2 * len(pairs) * per_vector <= registers // 2:
                            both = simd.accumulate(builder, pairs_of_k, 2 * len(pairs), lambda i, partial: k_step(
                                i, partial[:len(pairs)], 2) + k_step(i, partial[len(pairs):], 2, 1))
                            runs = [both[:len(pairs)], both[len(pairs):]]
                        else:
                            runs = [simd.accumulate(builder, pairs_of_k, len(pairs),
                                                    lambda i, partial, parity=parity: k_step(i, partial, 2, parity))
                                    for parity in (0, 1)]
                        group_sums = [builder.fadd(even, odd) for even, odd in zip(*runs)]  # (an FADD pipe's)
                    else:
                        group_sums = simd.accumulate(builder, group_arg, len(pairs), k_step)
                    for p, (r, v) in enumerate(pairs):
                        to = out_at(r, v)
                        total = simd.fma(builder, scale[v], group_sums[p], simd.load(builder, to, False))
                        if with_min:
                            x_sum = simd.broadcast(builder, builder.load(builder.gep(
                                sums_ary.data, [builder.add(builder.mul(const(r), sums_row), g)])))
                            total = simd.fma(builder, low[v], x_sum, total)
                        simd.store(builder, total, to)
                return []

            simd.accumulate(builder, groups, 0, group_step)

        if by_halves.literal_value:  # up to 2 blocks of HALF_ROWS rows, a pass over each half for each block
            per_pass = max(1, HALF_ROWS)  # (compiled, never run, where HALF_ROWS is 0)
            simd.cases(builder, rows, range(1, 2 * per_pass + 1), lambda n: product(n, [
                (range(first, min(n, first + per_pass)), (v,)) for first in range(0, n, per_pass) for v in range(2)]))
        else:
            simd.cases(builder, rows, range(1, ROW_GROUP + 1), lambda n: product(n, [(range(n), (0, 1))]))
        return context.get_dummy_value()

    return types.void(x, data, scales, mins, sums, tile, group, out, bits, has_min, by_halves), codegen


def _six_bit_lanes(builder: ir.IRBuilder, here: ir.Value) -> list[ir.Value]:
    """A 6-bit tile's 32 weights of one k at `here` (uint8*) as 2 float vectors (columns 0-15, 16-31): each lane's
    3 bytes moved to the top 3 bytes of a 32-bit lane (a byte shuffle within each 128-bit half), then each field
    shifted up to the lane's top and arithmetically down again, which extends its sign: 10 vector ops for 32
    weights where 6 bits kept as 4 and 2 took 19 to put together and widen (AVX2, one row from L2: 7.7 -> 3.7 ns a
    k of a tile, Q8_0's 8-bit tiles 3.4)."""
    half = ir.VectorType(ir.IntType(8), 16)
    first = builder.load(builder.bitcast(here, half.as_pointer()), align=1)  # lanes 0-3: bytes 0-11
    second = builder.load(builder.bitcast(builder.gep(here, [const(8)]), half.as_pointer()), align=1)  # 4-7: 8-23
    # lane l's bytes 3l .. 3l + 2 at bytes 1-3 of its 32-bit lane (byte 0: any; the shifts drop it)
    order = []
    for lane in range(8):
        at = [3 * lane + i if lane < 4 else 16 + 3 * lane + i - 8 for i in range(3)]
        order += [at[0]] + at
    words8 = builder.bitcast(builder.shuffle_vector(first, second, ir.Constant(ir.VectorType(simd.I32, 32), order)),
                             ir.VectorType(simd.I32, 8))
    both = builder.shuffle_vector(words8, words8, ir.Constant(ir.VectorType(simd.I32, LANES), list(range(8)) * 2))
    vectors = []
    for v in range(2):  # fields 2v (columns 16v ..) and 2v + 1 (columns 16v + 8 ..), at bits 8 + 6 f of the lane
        up = builder.shl(both, ir.Constant(_WORDS, [18 - 6 * (2 * v)] * 8 + [18 - 6 * (2 * v + 1)] * 8))
        vectors.append(builder.sitofp(builder.ashr(up, words(26)), simd.FLOATS))
    return vectors


def _nibble_floats(builder: ir.IRBuilder, lanes: ir.Value) -> ir.Value:
    """The float of each 32-bit lane's low 4 bits (AVX-512's vpermps over the table 0.0 .. 15.0)."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(simd.FLOATS, [simd.FLOATS, _WORDS]),
                                        "llvm.x86.avx512.permvar.sf.512")
    return builder.call(fn, [ir.Constant(simd.FLOATS, [float(i) for i in range(LANES)]), lanes])


def linear_tiles(x, weight, bias, out, accumulate, first_tile, end_tile):
    """out (+)= x @ weight.T + bias inside compiled code, for a weight packed either way (float tiles of
    packed_matmul_cpu, or the (data, scales, mins, group) of quantized ones), for the output columns of tiles
    first_tile to end_tile - 1 only, on the calling thread: a share of a matmul inside a parallel region of the
    caller's (decode_step_cpu)."""


@overload(linear_tiles, inline="always")  # (inlined: decode_step_cpu._lm_head_phase says why)
def _linear_tiles(x, weight, bias, out, accumulate, first_tile, end_tile):
    if isinstance(weight, types.Array):
        return lambda x, weight, bias, out, accumulate, first_tile, end_tile: tile_run(
            x, weight, bias, out, accumulate, first_tile, end_tile)

    def integer(x, weight, bias, out, accumulate, first_tile, end_tile):
        data, scales, mins, _ = weight
        xq, d, sums, totals = _quantized_activations(x)
        _integer_run(xq, d, sums, totals, data, scales, mins, bias, out, accumulate, first_tile, end_tile)

    def float_tiles(x, weight, bias, out, accumulate, first_tile, end_tile):
        data, scales, mins, group = weight
        _tile_run(x, _group_sums(x, group, mins.shape[1] > 0), data, scales, mins, group, bias, out,
                  accumulate, first_tile, end_tile)
    # the layout by type (quads: int8 data): a step compiles only the path its weights take
    return integer if quant_dot_cpu.quads_type(weight[0]) else float_tiles


def tile_count(weight):
    """The tiles of a weight packed either way, inside compiled code."""


@overload(tile_count)
def _tile_count(weight):
    if isinstance(weight, types.Array):
        return lambda weight: weight.shape[0]
    return lambda weight: weight[0].shape[0]


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
