"""Mutation testing of the kernels (the CPU ones, and the Triton prefill kernel as its tests run it, through
Triton's interpreter where there is no GPU): each mutant is a one-place edit of a kernel source, a bug the kernel
tests must catch. Per mutant the edit is applied, the tests run in a subprocess (`pytest -x -q`) with numba's
cache in a fresh temporary folder (the kernels compile from the mutated source, and the user's cache never holds
a mutant), and the file is put back whatever happens, Ctrl-C included. Prints each mutant: caught (by which
test) or survived.

    python scripts/mutants.py [NAME ...]    # all mutants, or those named

Not run by CI: every mutant compiles the kernels afresh (a minute or two of CPU each).
"""
from __future__ import annotations

import argparse
import fnmatch
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KERNELS = REPO / "engine" / "model"
ATTENTION_TESTS = ("tests/engine/model/test_attention.py", "tests/engine/model/test_decode_step_cpu.py")
STEP_TESTS = ("tests/engine/model/test_decode_step_cpu.py",)
QUANT_TESTS = ("tests/engine/model/test_quant_matmul.py",)
DOT_TESTS = ("tests/engine/model/test_quant_dot.py",)
# a Q4_K_M-like model through the compiled step: its layer 0's qkv holds v in tiles of their own
K_QUANT_TESTS = ("tests/engine/model/test_quantized_models.py::"
                 "test_k_quants_give_the_dequantized_models_tokens_from_super_block_records",)
PREFILL_TESTS = ("tests/engine/model/test_paged_prefill_cuda.py",)
FUSED_TESTS = ("tests/engine/model/test_fused_cuda.py",)
TIMEOUT_S = 1800


@dataclass(frozen=True, slots=True)
class Mutant:
    name: str
    file: str  # under engine/model/
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple[str, ...]
    # the code it mutates: "avx2" (compiled for AVX2 on any host that has it), "narrow-vnni" (VNNI on 256-bit vectors
    # only, on any host with AVX-VNNI), or the host's "avx512", "vnni" or "wide" (VNNI on 512-bit vectors)
    isa: str = ""


MUTANTS = [
    # the merge of a row's partial softmaxes takes its maximum over all but the last partial
    Mutant("merge-maximum-skips-last-partial", "paged_decode_cpu.py",
           "for partial in range(first[m] + 1, first[m + 1]):",
           "for partial in range(first[m] + 1, first[m + 1] - 1):", ATTENTION_TESTS),
    # a chunk's softmax maximum skips the first key of the tail past its last 16
    Mutant("softmax-maximum-skips-one-key", "paged_decode_loops.py",
           "for t in range(whole, len(scores)):", "for t in range(whole + 1, len(scores)):", ATTENTION_TESTS),
    # the matmul form packs the last key of a partial 32-key tile as zeros
    Mutant("partial-tile-off-by-one", "paged_decode_loops.py",
           "if t < count\n", "if t < count - 1\n", ATTENTION_TESTS),
    # a row's last chunk ends one slot early: the newest token, at the end of its partial last block, is not read
    Mutant("partial-last-block-off-by-one", "paged_decode_cpu.py",
           "chunk_end[task] = min((c + 1) * own_chunk[m], lengths[m])",
           "chunk_end[task] = min((c + 1) * own_chunk[m], lengths[m] - 1)", ATTENTION_TESTS),
    # a row's equal chunks rounded down: a length they do not divide loses its last slots
    Mutant("equal-chunks-short", "paged_decode_cpu.py",
           "own_chunk = (lengths + np.maximum(own, 1) - 1) // np.maximum(own, 1)",
           "own_chunk = lengths // np.maximum(own, 1)", ATTENTION_TESTS),
    # each of a row's chunks starts one slot late: the slot before it is read by no task
    Mutant("chunk-start-one-late", "paged_decode_cpu.py",
           "source[task], chunk_start[task], member_first[task] = m, c * own_chunk[m], member",
           "source[task], chunk_start[task], member_first[task] = m, c * own_chunk[m] + 1, member", ATTENTION_TESTS),
    # a cascade group's shared prefix ends one slot early
    Mutant("cascade-boundary-off-by-one", "paged_decode_cpu.py",
           "chunk_end[task] = min((c + 1) * shared_chunk[g], shared_lengths[g])",
           "chunk_end[task] = min((c + 1) * shared_chunk[g], shared_lengths[g] - 1)", ATTENTION_TESTS),
    # RMSNorm's epsilon added to the root instead of the mean square
    Mutant("rms-norm-epsilon-outside-root", "decode_step_cpu.py",
           "np.float32(math.sqrt(total / x.shape[1] + eps))",
           "(np.float32(math.sqrt(total / x.shape[1])) + eps)", STEP_TESTS),
    # rotary embedding with the halves swapped (a rotation the other way)
    Mutant("rotary-halves-swapped", "decode_step_cpu.py",
           "first, second = heads[:, :half], heads[:, half:]",
           "first, second = heads[:, half:], heads[:, :half]", STEP_TESTS),
    # a thread of the step's region goes on before a phase's other chunks are done
    Mutant("phase-wait-skipped", "work_phases.py",
           "while _load(ary, phase, HALF) < chunks:", "while False and _load(ary, phase, HALF) < chunks:",
           ("tests/engine/model/test_work_phases.py",) + STEP_TESTS),
    # the step's matmuls leave their last tile to no thread: the last output columns are never written
    Mutant("step-matmul-last-tile-unclaimed", "decode_step_cpu.py",
           "c * tiles // chunks, (c + 1) * tiles // chunks)",
           "c * tiles // chunks, (c + 1) * tiles // chunks - (c == chunks - 1))", STEP_TESTS),
    # the greedy token: a later run of the lm_head's columns wins a tie with an earlier one
    Mutant("greedy-tie-to-later-run", "decode_step_cpu.py",
           "if logits[r, best[c, r]] > logits[r, column]:", "if logits[r, best[c, r]] >= logits[r, column]:",
           STEP_TESTS),
    # a run's largest logit is looked for short of its last vector's tail
    Mutant("greedy-tail-skipped", "decode_step_cpu.py",
           "for j in range(start + vectors * simd.LANES, end):",
           "for j in range(start + vectors * simd.LANES, end - 1):", STEP_TESTS),
    # only the first row of a step finds its largest logits: the other rows' greedy tokens are garbage
    Mutant("greedy-first-row-only", "decode_step_cpu.py",
           "        for r in range(logits.shape[0]):\n            best[c, r]",
           "        for r in range(1):\n            best[c, r]", STEP_TESTS),
    # a fused weight's tail rows (v in Q6_K beside Q4_K q and k) copied one tile late: v's columns shifted
    Mutant("stacked-tail-copied-a-tile-late", "decode_step_cpu.py",
           "tail_from = tile_count(qkv_w[layer]) * TILE if", "tail_from = tile_count(qkv_w[layer]) * TILE + TILE if",
           K_QUANT_TESTS),
    # the matmuls' row groups one row short: every 8th row of a step's batch is never computed
    Mutant("matmul-row-group-one-short", "packed_matmul_cpu.py",
           "group = x[first:first + ROW_GROUP]", "group = x[first:first + ROW_GROUP - 1]", STEP_TESTS),
    # the quantized kernel drops the min * (group sum of x) term: right only where mins are zero
    Mutant("quant-min-term-dropped", "quant_matmul_cpu.py",
           "total = simd.fma(builder, low[v], x_sum, total)", "total = total", QUANT_TESTS),
    # a step by halves passes over the tile's first half only: columns 16-31 of its rows stay zero
    Mutant("quant-halves-second-half-skipped", "quant_matmul_cpu.py",
           "for first in range(0, n, per_pass) for v in range(2)]",
           "for first in range(0, n, per_pass) for v in range(1)]", QUANT_TESTS),
    # AVX-512's one-loop passes (up to 4 rows) never add the odd k's
    Mutant("quant-split-k-odd-run-dropped", "quant_matmul_cpu.py",
           "+ k_step(i, partial[len(pairs):], 2, 1))", "+ list(partial[len(pairs):]))", QUANT_TESTS, isa="avx512"),
    # ... and its two-loop passes (5 to 8 rows) read the even k's twice
    Mutant("quant-split-k-even-run-twice", "quant_matmul_cpu.py",
           "for parity in (0, 1)]", "for parity in (0, 0)]", QUANT_TESTS, isa="avx512"),
    # a group's sum of x skips its last weight
    Mutant("quant-group-sum-one-short", "quant_matmul_cpu.py",
           "total += x[r, k]", "total += x[r, k] if k % group != group - 1 else np.float32(0.0)", QUANT_TESTS),
    # the group sums left to inherit their caller's fastmath: reordered, so that results depend on who compiled them
    Mutant("quant-group-sums-inherit-fastmath", "quant_matmul_cpu.py",
           "@njit(fastmath=False, nogil=True, cache=kernel_cache.CACHE)\ndef _group_sums",
           "@njit(nogil=True, cache=kernel_cache.CACHE)\ndef _group_sums", QUANT_TESTS),
    # prefill's dequantization writes a tile's high nibbles over its low columns (columns 16-31 never written)
    Mutant("dequantize-block-high-nibble-as-low", "quant_matmul_cpu.py",
           "store_column(j + HALF, builder.sitofp(builder.lshr(", "store_column(j, builder.sitofp(builder.lshr(",
           QUANT_TESTS),
    # ... and the 8-bit tile's second half of columns as its first
    Mutant("dequantize-block-second-half-as-first", "quant_matmul_cpu.py",
           "store_column(c * LANES + j, builder.sitofp(lanes, simd.FLOATS))",
           "store_column(j, builder.sitofp(lanes, simd.FLOATS))", QUANT_TESTS),
    # the high nibbles (columns 16-31 of a tile) read as the low ones
    Mutant("quant-high-nibble-as-low", "quant_matmul_cpu.py",
           "high = builder.lshr(wide, words(4))", "high = low", QUANT_TESTS),
    # the low nibbles not masked: columns 0-15 read with their high neighbours' bits (16x too large; AVX2's code)
    Mutant("quant-low-nibble-unmasked", "quant_matmul_cpu.py",
           "low = builder.and_(wide, words(0x0F))", "low = wide", QUANT_TESTS, isa="avx2"),
    # AVX-512's nibble lookup reads the high nibbles for the low columns too
    Mutant("quant-nibble-lookup-high-as-low", "quant_matmul_cpu.py",
           "return [_nibble_floats(builder, wide), _nibble_floats(builder, high)]",
           "return [_nibble_floats(builder, high), _nibble_floats(builder, high)]", QUANT_TESTS, isa="avx512"),
    # 8-bit weights widened as unsigned: negative weights read as 128..255
    Mutant("quant-int8-read-unsigned", "quant_matmul_cpu.py",
           "return [builder.sitofp(builder.load(", "return [builder.uitofp(builder.load(", QUANT_TESTS),
    # fp16 scales read back as integers where a row is dequantized (embedding, prefill)
    Mutant("quant-half-scale-bits-as-integer", "quant_matmul_cpu.py",
           "return lambda values, tile, g, j: _half_to_float(values[tile, g, j])",
           "return lambda values, tile, g, j: np.float32(values[tile, g, j])", QUANT_TESTS),
    # the microkernel's second vector of a group's scales read from the middle of the first
    Mutant("quant-half-scales-second-vector-shifted", "quant_matmul_cpu.py",
           "quant_dot_cpu.group_columns(builder, kind, pointers, v * LANES, LANES)",
           "quant_dot_cpu.group_columns(builder, kind, pointers, v * LANES // 2, LANES)", QUANT_TESTS),
    # an embedding row's weights scaled by the next group's scale
    Mutant("quant-row-group-index-shifted", "quant_matmul_cpu.py",
           "scale = _group_value(scales, tile, g, j)",
           "scale = _group_value(scales, tile, (g + 1) % (out.shape[0] // group), j)", QUANT_TESTS),
    # super-block records: both microkernels take the int8 sub-scales for the scales (the fp16 factor dropped)
    Mutant("quant-super-block-factor-dropped", "quant_dot_cpu.py",
           "return builder.fmul(builder.sitofp(run(at, _I8, 1), ir.VectorType(ir.FloatType(), count)), widened(head))",
           "return builder.sitofp(run(at, _I8, 1), ir.VectorType(ir.FloatType(), count))", QUANT_TESTS + DOT_TESTS),
    # ... every kernel reads a group's sub-scales half a run early (two groups' columns mixed)
    Mutant("quant-super-block-sub-scales-shifted", "quant_dot_cpu.py",
           "builder.add(const(SUPER_HEAD), builder.mul(within, const(TILE)))",
           "builder.add(const(SUPER_HEAD), builder.mul(within, const(TILE // 2)))", QUANT_TESTS),
    # ... a row read alone (embedding, prefill's last rows) loses the high byte of its fp16 factor
    Mutant("quant-super-block-row-factor-low-byte", "quant_matmul_cpu.py",
           "bits = (np.int32(record[2 * j]) & 0xFF) | (np.int32(record[2 * j + 1]) << 8)",
           "bits = np.int32(record[2 * j]) & 0xFF", QUANT_TESTS),
    # 6 bits: the microkernel takes lanes 4-7's bytes from the first 16 bytes of the k, as lanes 0-3's
    Mutant("quant-six-bit-lanes-from-first-half", "quant_matmul_cpu.py",
           "at = [3 * lane + i if lane < 4 else 16 + 3 * lane + i - 8 for i in range(3)]",
           "at = [3 * lane + i for i in range(3)]", QUANT_TESTS),
    # ... columns 8-15 and 24-31 take the field of columns 0-7 and 16-23
    Mutant("quant-six-bit-field-shift-repeated", "quant_matmul_cpu.py",
           "[18 - 6 * (2 * v)] * 8 + [18 - 6 * (2 * v + 1)] * 8", "[18 - 6 * (2 * v)] * 16", QUANT_TESTS),
    # ... the fields shifted down without their sign (-32..-1 read as 32..63)
    Mutant("quant-six-bit-sign-dropped", "quant_matmul_cpu.py",
           "builder.ashr(up, words(26))", "builder.lshr(up, words(26))", QUANT_TESTS),
    # super-block records: a group's place in its super-block masked one bit too wide
    Mutant("quant-super-block-within-mask", "quant_dot_cpu.py",
           "within = builder.and_(g, builder.sub(per_super, const(1)))", "within = builder.and_(g, per_super)",
           QUANT_TESTS),
    # ... prefill's dequantization reads each lane's word from the bytes at its index, not 3 times it
    Mutant("dequantize-block-six-bit-lane-bytes", "quant_matmul_cpu.py",
           "b0, b1, b2 = by_byte[3 * lane:3 * lane + 3]", "b0, b1, b2 = by_byte[lane:lane + 3]", QUANT_TESTS),
    # ... and a row read alone takes its field 4 bits a step, not 6
    Mutant("quant-six-bit-row-field", "quant_matmul_cpu.py",
           "u = (word >> (6 * field)) & 63", "u = (word >> (4 * field)) & 63", QUANT_TESTS),
    # integer dot products: 8-bit weights' signs never reach the activations (every weight read as |w|)
    Mutant("dot-int8-sign-dropped", "quant_dot_cpu.py",
           'signed_x = x_bytes if bits != 8 else _x86(builder, "psign.b", _BYTES, x_bytes, w[v])',
           "signed_x = x_bytes", DOT_TESTS, isa="avx2"),
    # the high nibbles (columns 8-15 and 24-31 of a tile) read as the low ones
    Mutant("dot-high-nibble-as-low", "quant_dot_cpu.py",
           "low, high = builder.and_(raw, nibble), builder.and_(high, nibble)",
           "low, high = builder.and_(raw, nibble), builder.and_(raw, nibble)", DOT_TESTS, isa="avx2"),
    # ... and in the 512-bit register of both nibble vectors (AVX512-VNNI)
    Mutant("dot-wide-high-nibbles-as-low", "quant_dot_cpu.py",
           "both = builder.shuffle_vector(raw, high,", "both = builder.shuffle_vector(raw, raw,", DOT_TESTS,
           isa="wide"),
    # the two vectors' sums in a 512-bit register taken the wrong way round: columns 0-7 get 8-15's sums
    Mutant("dot-wide-halves-swapped", "quant_dot_cpu.py",
           "builder.load(acc[r][v // 2]), (v % 2) * COLUMNS, COLUMNS)",
           "builder.load(acc[r][v // 2]), (1 - v % 2) * COLUMNS, COLUMNS)", DOT_TESTS, isa="wide"),
    # 8-bit weights on 512-bit vectors and 6-bit ones: the + 128 or + 32 that makes them unsigned never taken off
    # their sums
    Mutant("dot-offset-kept", "quant_dot_cpu.py",
           "sums = builder.sub(sums, offsets[r])", "sums = sums", DOT_TESTS, isa="wide"),
    # ... or never added: negative weights read as 128..255
    Mutant("dot-wide-8bit-not-offset", "quant_dot_cpu.py",
           "ir.Constant(_WIDE_BYTES, [-128] * 64)) for i", "ir.Constant(_WIDE_BYTES, [0] * 64)) for i", DOT_TESTS,
           isa="wide"),
    # an integer pass's last row is not written out: every ROW_GROUP-th (or WIDE_ROWS-th) row of a batch stays empty
    Mutant("integer-pass-row-dropped", "quant_matmul_cpu.py",
           "_add_out(scratch, min(step, rows - first), bias, out, first, tile * TILE, accumulate)\n        return",
           "_add_out(scratch, min(step - 1, rows - first), bias, out, first, tile * TILE, accumulate)\n        return",
           DOT_TESTS),
    # the activations rounded toward zero: errors up to a whole step, not half
    Mutant("dot-activations-truncated", "quant_dot_cpu.py",
           "xq[r, k] = np.int8(np.rint(x[r, k] * inverse))", "xq[r, k] = np.int8(x[r, k] * inverse)", DOT_TESTS),
    # both microkernels read fp16 scales and mins as float32 (their bits taken for other numbers, twice as far)
    Mutant("half-scales-read-as-float32", "quant_dot_cpu.py",
           "if kind == types.float32:", "if kind != types.int8:", QUANT_TESTS + DOT_TESTS),
    # a group's integer sums scaled a quad early: its last quad's products counted in the next group's
    Mutant("dot-group-ends-a-quad-early", "quant_dot_cpu.py",
           "builder.and_(quad, last), last)", "builder.and_(quad, last), builder.sub(last, const(1)))", DOT_TESTS),
    # ... and never set back to zero: every group's scale multiplies the sums of all the groups before it too
    Mutant("dot-group-sums-not-reset", "quant_dot_cpu.py",
           "builder.store(ir.Constant(acc_type, None), register)\n", "pass\n", DOT_TESTS),
    # VNNI's quad sums start afresh at every quad: a group counts its last quad's products only
    Mutant("dot-vnni-sums-restarted", "quant_dot_cpu.py",
           "builder.store(_dot_quads(builder, builder.load(acc[r][v]), magnitude[v], signed_x),",
           "builder.store(_dot_quads(builder, ir.Constant(_SUMS, None), magnitude[v], signed_x),", DOT_TESTS,
           isa="narrow-vnni"),
    # 6-bit weights: a vector's top bit pairs read from its neighbour's bits (AVX2's and 256-bit VNNI's code) ...
    Mutant("dot-6bit-top-bits-of-the-neighbour", "quant_dot_cpu.py",
           "low = builder.or_(low, top_bits(top, pairs[i], [4] * 16))",
           "low = builder.or_(low, top_bits(top, pairs[i], [2] * 16))", DOT_TESTS, isa="avx2"),
    # ... or the two vectors of a 512-bit register swapping theirs
    Mutant("dot-6bit-wide-top-bits-swapped", "quant_dot_cpu.py",
           "top_bits(twice, pairs[i], [4] * 16 + [2] * 16)", "top_bits(twice, pairs[i], [2] * 16 + [4] * 16)",
           DOT_TESTS, isa="wide"),
    # ... or a half tile's second half reading the first half's
    Mutant("dot-6bit-half-tile-top-bits-of-the-first-half", "quant_dot_cpu.py",
           "builder.trunc(builder.mul(pair, const(4)), _I16)", "builder.trunc(builder.mul(pair, const(0)), _I16)",
           DOT_TESTS, isa="avx2"),
    # ... the + 32 taken off 16 times the activations' sum, not 32
    Mutant("dot-6bit-offset-halved", "quant_dot_cpu.py",
           "return builder.shl(total_at(r, g), ir.Constant(_I32, 5))",
           "return builder.shl(total_at(r, g), ir.Constant(_I32, 4))", DOT_TESTS),
    # ... and their mins multiplying the sum over the first 16 activations of the group of 32, whichever half
    Mutant("dot-6bit-mins-of-the-first-half", "quant_dot_cpu.py",
           "builder.sitofp(total_at(r, g), ir.FloatType())",
           "builder.sitofp(total_at(r, builder.shl(g_x, const(1))), ir.FloatType())", DOT_TESTS),
    # large batches' half-tile passes: the second half of a tile reads the first half's weights
    Mutant("dot-half-tile-weights-of-the-first-half", "quant_dot_cpu.py",
           "builder.gep(tile_data, [builder.mul(part, const(part_bytes))])", "builder.gep(tile_data, [const(0)])",
           DOT_TESTS, isa="avx2"),
    # ... or the first half's scales and mins
    Mutant("dot-half-tile-scales-of-the-first-half", "quant_dot_cpu.py",
           "first_column = builder.mul(part, const(vectors * COLUMNS))", "first_column = const(0)", DOT_TESTS,
           isa="avx2"),
    # the online softmax (prefill and decode kernels) does not rescale its running sum of weighted values when a
    # later key tile raises the maximum
    Mutant("prefill-values-not-rescaled", "paged_decode_cuda.py",
           "acc = acc * rescale[:, None] + tl.dot(weights, values.to(tl.float32), input_precision=\"ieee\")",
           "acc = acc + tl.dot(weights, values.to(tl.float32), input_precision=\"ieee\")", PREFILL_TESTS),
    # a chunk's queries placed one position late in their context: each sees the key after its own
    Mutant("prefill-query-position-one-late", "paged_prefill_cuda.py",
           "position = context - num_queries + query", "position = context - num_queries + query + 1", PREFILL_TESTS),
    # the unmasked key tiles run one tile too far: a query sees keys past its own position
    Mutant("prefill-unmasked-tiles-one-too-many", "paged_prefill_cuda.py",
           "full_end = (first_position + 1) // TILE_N * TILE_N",
           "full_end = (first_position + 1 + TILE_N) // TILE_N * TILE_N", PREFILL_TESTS),
    # a split of the keys (a small step's) starts a tile late: each split's first key tile is never read
    Mutant("prefill-split-starts-a-tile-late", "paged_prefill_cuda.py",
           "low = split * SPLIT_KEYS", "low = split * SPLIT_KEYS + TILE_N", PREFILL_TESTS),
    # the merge weighs the splits' partials by natural exponentials of sums kept in log2 units
    Mutant("prefill-split-merge-natural-exp", "paged_prefill_cuda.py",
           "weights = tl.exp2(lse - tl.max(lse, axis=0))", "weights = tl.exp(lse - tl.max(lse, axis=0))",
           PREFILL_TESTS),
    # a row that has seen no key yet subtracts its -inf maximum: exp(-inf - -inf) is NaN in an empty split
    Mutant("online-softmax-empty-row-unguarded", "paged_decode_cuda.py",
           "shift = tl.where(new_best == float(\"-inf\"), 0.0, new_best)", "shift = new_best", PREFILL_TESTS),
    # the add and norm's stream not written back: the next layer adds to the stream before this one
    Mutant("add-rms-norm-stream-not-stored", "fused_cuda.py", "    tl.store(at, total, mask=inside)\n", "\n",
           FUSED_TESTS),
    # the rotation's first half turned the wrong way (CUDA's fused rotary and K/V store)
    Mutant("rotary-first-half-sign", "fused_cuda.py",
           "return (first * cos_first[None, :] - second * sin_first[None, :],",
           "return (first * cos_first[None, :] + second * sin_first[None, :],", FUSED_TESTS),
    # weights and the KV pool in a shared anonymous mapping: Linux backs it with huge pages only where shmem_enabled
    # says so (mostly never)
    Mutant("huge-pages-shared-mapping", "huge_pages.py", "flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS",
           "flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS", ("tests/engine/model/test_huge_pages.py",)),
]


def kernel_files_are_clean(files: set[str]) -> bool:
    paths = [str(KERNELS / f) for f in files]
    status = subprocess.run(["git", "status", "--porcelain", "--", *paths], cwd=REPO, capture_output=True,
                            text=True, check=True)
    return not status.stdout.strip()


def isa_env(isa: str) -> dict[str, str] | None:
    """The environment that has numba compile the kernels for `isa` on this host, or None where the host cannot
    run that code. AVX2: haswell with the host's features less AVX-512 (as tests/engine/model/test_cpu_isa.py)."""
    if not isa:
        return {}
    from llvmlite import binding

    features = binding.get_host_cpu_features().flatten().split(",")
    if isa in ("vnni", "wide"):
        from engine.model.kernel_cache import has_vnni, has_wide_vnni
        return {} if (has_vnni if isa == "vnni" else has_wide_vnni)(",".join(features)) else None
    if isa == "narrow-vnni":
        from engine.model.kernel_cache import has_vnni
        narrow = ",".join("-avx512vnni" if f == "+avx512vnni" else f for f in features)
        return {"NUMBA_CPU_FEATURES": narrow} if has_vnni(narrow) else None
    if "+" + {"avx2": "avx2", "avx512": "avx512f"}[isa] not in features:
        return None
    if isa == "avx512":
        return {}
    return {"NUMBA_CPU_NAME": "haswell",
            "NUMBA_CPU_FEATURES": ",".join("-" + f[1:] if f[1:].startswith("avx512") else f for f in features)}


def run_tests(tests: tuple[str, ...], cache_dir: str | None, extra_env: dict[str, str] | None = None
              ) -> tuple[int, str]:
    """(pytest's exit code, the first failed or erroring test, or the last line of its output)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), **(extra_env or {}))
    if cache_dir is not None:
        env["NUMBA_CACHE_DIR"] = cache_dir
    try:
        run = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return 1, f"timed out after {TIMEOUT_S} s"
    output = run.stdout + run.stderr
    failed = re.search(r"^(?:FAILED|ERROR) (\S+)", output, re.MULTILINE)
    lines = output.strip().splitlines()
    return run.returncode, failed.group(1) if failed else (lines[-1] if lines else "")


def try_mutant(mutant: Mutant) -> tuple[bool, str, float]:
    """(caught, by what, seconds): the tests run over the mutated source, which is then put back."""
    path = KERNELS / mutant.file
    original = path.read_text()
    started = time.perf_counter()
    try:
        path.write_text(original.replace(mutant.old, mutant.new))
        with tempfile.TemporaryDirectory(prefix="mutant-numba-") as cache_dir:
            code, by = run_tests(mutant.tests, cache_dir, isa_env(mutant.isa))
    finally:
        path.write_text(original)
    return code != 0, by, time.perf_counter() - started


def choose(patterns: list[str]) -> tuple[list[Mutant], list[str]]:
    """The mutants whose names match one of `patterns` (names or shell patterns; every mutant without any), in
    their order here, and the patterns that match none."""
    chosen = [m for m in MUTANTS if not patterns or any(fnmatch.fnmatchcase(m.name, p) for p in patterns)]
    return chosen, [p for p in patterns if not any(fnmatch.fnmatchcase(m.name, p) for m in MUTANTS)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="mutants to run, by name or shell pattern ('dot-*'; default: all)")
    args = parser.parse_args()
    chosen, unknown = choose(args.names)
    if unknown:
        parser.error(f"no mutant matches {unknown}; known: {[m.name for m in MUTANTS]}")
    for mutant in [m for m in chosen if isa_env(m.isa) is None]:
        print(f"{mutant.name}: skipped, this CPU cannot run {mutant.isa} code (the mutated code never runs here)")
        chosen.remove(mutant)
    files = {m.file for m in chosen}
    if not kernel_files_are_clean(files):
        print(f"refusing to start: {sorted(files)} have uncommitted changes, which a mutant run would overwrite",
              file=sys.stderr)
        return 2
    for mutant in chosen:  # every edit is checked before any file is touched
        count = (KERNELS / mutant.file).read_text().count(mutant.old)
        assert count == 1, f"{mutant.name}: {mutant.old!r} occurs {count} times in {mutant.file}, not once"
    tests = sorted({t for m in chosen for t in m.tests})
    print(f"baseline: {' '.join(tests)} without mutants ...", flush=True)
    code, by = run_tests(tuple(tests), None)  # the user's cache: the unmutated sources' own folder
    if code != 0:
        print(f"the tests fail without any mutant ({by}): fix that first", file=sys.stderr)
        return 1
    results = []
    for mutant in chosen:
        print(f"{mutant.name} ...", flush=True)
        results.append((mutant, *try_mutant(mutant)))
    width = max((len(m.name) for m in chosen), default=len("mutant"))
    print(f"\n{'mutant':{width}}  {'file':20}  result    seconds  by")
    for mutant, caught, by, seconds in results:
        print(f"{mutant.name:{width}}  {mutant.file:20}  {'caught' if caught else 'SURVIVED':8}  {seconds:7.0f}  "
              f"{by if caught else ''}")
    return 0 if all(caught for _, caught, _, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
