"""Small-batch matmuls on CPU over weights packed for them, at the memory-bandwidth limit.

A decode step multiplies a few rows by every weight once, so its speed is how fast the weights stream
from memory, provided the arithmetic keeps pace. Plain loops over the row-major weight (a dot product per
output, vectorized along k) could not: at 8 rows they spent as long computing as streaming, one after the
other. This is the layout and microkernel of oneDNN-style GEMMs, written as LLVM vector code:

- the weight [N, K] is packed once into tiles of TILE output columns, [N / TILE, K, TILE], so a thread
  reads its tiles as one sequential stream;
- for each k the microkernel loads the tile's TILE weights (two 16-float vectors) and, for each of up to
  ROW_GROUP input rows, broadcasts x[row, k] and adds the product into that row's two accumulators:
  16 accumulators that stay in registers for the whole of K, and no horizontal sums at all.

numba cannot express vector registers, so the microkernel is a numba intrinsic that emits the loop as LLVM IR
(<16 x float> and llvm.fma); LLVM lowers it to AVX-512 here, and splits each vector in 2 on AVX2 and in 4 on
NEON, where fewer rows fit in the registers (row_group). It beats oneDNN's packed weights at 1 to 32 rows
(docs/speed.md#packed-matmul). bfloat16 weights are packed as their bits and widened to float32 in the loop
(the arithmetic is float32), which beat oneDNN's native bf16 dot products too.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from engine.model import kernel_cache  # numba's cache folder, set before any @njit below
from engine.model import simd
from engine.model.bfloat16_bits import as_float32, numpy_view
from engine.model.cpu_threads import launch_lock, use_threads
from engine.model.simd import LANES, const

TILE = 2 * LANES  # output columns of a packed tile
# vector registers, and how many of them one 16-float vector takes, per instruction set
REGISTERS = {"avx512": (32, 1), "avx2": (16, 2), "neon": (32, 4), "generic": (16, 4)}
MAX_ROW_GROUP = 8  # on AVX-512 more rows fit, but more were no faster (docs/speed.md#packed-matmul)


def row_group(isa: str) -> int:
    """Input rows one pass over a tile serves: as many as keep 2 accumulators a row, the tile's 2 weight
    vectors and a broadcast in registers (a spilled accumulator costs a load and a store per k). AVX-512: 8;
    AVX2 and NEON: 2 (compiled for AVX2, 8 rows spilled hundreds of registers and 2 measured fastest:
    docs/speed.md#packed-matmul)."""
    registers, per_vector = REGISTERS[isa]
    return max(1, min(MAX_ROW_GROUP, (registers // per_vector - 3) // 2))


ROW_GROUP = row_group(kernel_cache.TARGET_ISA)
# from 4 rows on the arithmetic keeps the core from asking for the next weights in time: each step of the
# microkernel prefetches the tile's lines 6 KB ahead (no faster at one row; the distance was chosen over paired
# rounds against 4 and 8 KB: docs/speed.md#packed-matmul)
PREFETCH_ROWS = min(4, ROW_GROUP)  # AVX2's 2-row passes gained from it as well (row_group)
PREFETCH_BYTES = 6144


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / TILE), K, TILE]: packed[t, k, j] = weight[t * TILE + j, k], zeros past N."""
    n, k = weight.shape
    tiles = -(-n // TILE)
    padded = weight.new_zeros(tiles * TILE, k)
    padded[:n] = weight
    return padded.view(tiles, TILE, k).transpose(1, 2).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x @ weight.T + bias for x [rows, K] (float32 or bfloat16), from the packed weight; in x's dtype."""
    out = torch.empty(x.shape[0], out_features)
    b = numpy_view(bias) if bias is not None else np.zeros(0, np.float32)
    with launch_lock:
        threads = use_threads()
        matmul(x.float().contiguous().numpy(), numpy_view(packed), b, out.numpy(), False, threads)
    return out.to(x.dtype)


def linear_batched(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                   out_features: int) -> torch.Tensor:
    """The same product for many rows (prefill) from the packed weight alone: one [rows, K] @ [K, TILE]
    product per tile, batched (oneDNN), then the tiles side by side."""
    tiles = torch.matmul(x.to(packed.dtype), packed)  # [tiles, rows, TILE]
    out = tiles.permute(1, 0, 2).reshape(x.shape[0], -1)[:, :out_features]
    return (out + bias if bias is not None else out).to(x.dtype)


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE, parallel=True)
def matmul(x, packed, bias, out, accumulate, threads):
    """out (+)= x @ weight.T + bias (none if empty) for x [rows, K] float32 and packed = pack(weight) (float32
    or bfloat16 bits). Each of the `threads` (use_threads()) takes an equal run of tiles: one sequential
    stream of the weight."""
    tiles = packed.shape[0]
    parts = min(threads, tiles)
    for part in prange(parts):
        tile_run(x, packed, bias, out, accumulate, part * tiles // parts, (part + 1) * tiles // parts)


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE)
def tile_run(x, packed, bias, out, accumulate, first_tile, end_tile):
    """matmul's product for the output columns of tiles first_tile to end_tile - 1, on the calling thread."""
    scratch = np.empty((ROW_GROUP, TILE), np.float32)
    for tile in range(first_tile, end_tile):
        start = tile * TILE
        width = min(TILE, out.shape[1] - start)
        for first in range(0, x.shape[0], ROW_GROUP):
            group = x[first:first + ROW_GROUP]
            # a whole tile with no bias goes straight from the registers to out (the scalar pass through
            # scratch measured slower: docs/speed.md#packed-matmul)
            if width == TILE and not len(bias):
                if accumulate:
                    tile_product(group, packed, tile, out[first:first + ROW_GROUP, start:], True)
                else:
                    tile_product(group, packed, tile, out[first:first + ROW_GROUP, start:], False)
                continue
            tile_product(group, packed, tile, scratch, False)
            for m in range(group.shape[0]):
                for j in range(width):
                    value = scratch[m, j] + (as_float32(bias[start + j]) if len(bias) else np.float32(0.0))
                    if accumulate:
                        out[first + m, start + j] += value
                    else:
                        out[first + m, start + j] = value


@intrinsic
def tile_product(typingctx, x, packed, tile, out, accumulate):
    """out[r, :TILE] = x[r, :] @ packed[tile] (+= if the constant `accumulate`) for each of x's 1 to ROW_GROUP
    rows: x [rows, K] float32 with unit stride along K, packed [tiles, K, TILE] contiguous, out [>= rows,
    >= TILE] float32 with unit stride along its rows. Each row count has its own unrolled loop (simd.cases).
    Also the two matmuls of a cascade attention task (paged_decode_loops._cascade)."""
    if not isinstance(accumulate, types.BooleanLiteral):
        return None  # numba then retries with the literal value of the constant the caller passes
    vectors = TILE // LANES
    bits = packed.dtype == types.uint16  # bfloat16 bits

    def codegen(context, builder, signature, args):
        x_arg, packed_arg, tile_arg, out_arg, _ = args
        x_ary = context.make_array(signature.args[0])(context, builder, x_arg)
        packed_ary = context.make_array(signature.args[1])(context, builder, packed_arg)
        out_ary = context.make_array(signature.args[3])(context, builder, out_arg)
        rows, k_len = cgutils.unpack_tuple(builder, x_ary.shape, 2)
        x_row = builder.udiv(cgutils.unpack_tuple(builder, x_ary.strides, 2)[0], const(4))  # in elements
        out_row = builder.udiv(cgutils.unpack_tuple(builder, out_ary.strides, 2)[0], const(4))
        weights = builder.gep(packed_ary.data, [builder.mul(tile_arg, builder.mul(k_len, const(TILE)))])

        def product(num_rows):
            def step(k, acc):  # acc[r * vectors + v] += x[r, k] * packed[tile, k, v * LANES:(v + 1) * LANES]
                here = builder.gep(weights, [builder.mul(k, const(TILE))])
                if num_rows >= PREFETCH_ROWS:  # this step's weights PREFETCH_BYTES on
                    simd.prefetch_lines(builder, here, PREFETCH_BYTES, TILE * (2 if bits else 4))
                w = simd.load_pieces(builder, here, vectors, bits)
                summed = []
                for r in range(num_rows):
                    x_rk = simd.broadcast(builder, builder.load(
                        builder.gep(x_ary.data, [builder.add(builder.mul(const(r), x_row), k)])))
                    summed += [simd.fma(builder, w[v], x_rk, acc[r * vectors + v]) for v in range(vectors)]
                return summed

            results = simd.accumulate(builder, k_len, num_rows * vectors, step)
            for r in range(num_rows):
                for v in range(vectors):
                    to = builder.gep(out_ary.data, [builder.add(builder.mul(const(r), out_row), const(v * LANES))])
                    result = results[r * vectors + v]
                    simd.store(builder, builder.fadd(simd.load(builder, to, False), result)
                               if accumulate.literal_value else result, to)

        simd.cases(builder, rows, range(1, ROW_GROUP + 1), product)
        return context.get_dummy_value()

    return types.void(x, packed, tile, out, accumulate), codegen
