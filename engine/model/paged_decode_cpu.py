"""Decode attention that reads K/V straight from the paged cache on CPU (no gathered copy).

The plain path copies every decode's context out of the cache once per layer (`index_select`) and then
runs torch's SDPA over the copy: at a 1,000-token context that copy costs more than the attention
itself. This kernel walks each row's slots in place. The compiled decode step (decode_step_cpu.py) and
the per-layer eager path both call it.

Work is split flash-decoding style: each row's context is cut into chunks of CHUNK slots, the chunks
are spread over numba's threads, and each row's partial softmaxes are merged at the end by their
maxima. Rows whose block tables start with the same blocks (a shared system prompt) form a cascade
group: a task takes a chunk of that shared prefix for all of the group's rows, so the chunk comes from
memory once and from the cache for the other rows, which turns the prefix's K/V traffic of a batch
into that of one sequence. Tasks are dealt to the threads by cost (rows x slots). For each row a chunk
takes three passes: scores, their exponentials (a loop that vectorizes), the weighted values. At head
sizes 64 and 128 the first and last are LLVM vector kernels (simd.py): scores come 16 keys at a time,
each key read once for the query heads of its GQA group (up to 4 at once), its products summed
lane-wise and the 16 sums then folded into one vector, so no key pays a horizontal sum of its own; the
weighted values stay in registers across the chunk's keys, each value read once for up to 4 heads (2 at
head size 128).

A cascade task with many queries per kv head (CASCADE_QUERIES: 4 rows of SmolLM2's 3 query heads) is
instead two matmuls by the matmul microkernel (_cascade): the chunk's keys are transposed into the packed
weight layout so that the scores of up to 8 queries come 32 keys at a time with the keys in vector
lanes, no sums across lanes at all; the values, copied into the same layout, are weighted by the
exponentials the same way. While it computes, such a task asks for the K/V of its thread's next task,
a share between its steps. Measured here (`python -m bench.attention`: 8 rows, 1,000-token contexts,
30 layers): K/V in cache 3.7-3.9 ms, from memory 12.2-12.7 ms (the arithmetic and the wait for K/V add
up instead of overlapping), 960 tokens shared 4.0-4.9 ms (4.5-5.3 before the matmul form), 16 rows
with 960 shared 6.7-6.8 ms (7.8), batch 1 1.4-2.9 ms. Other head sizes take the plain
loops (one compiled copy of the chunk serves every head size: a copy per size, as the plain loops once
had, took the kernel's first compile from 20 to 27 s). float32 and bfloat16 caches (the math is
float32); other dtypes and CUDA take the plain path.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
import torch
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from engine.model import kernel_cache  # numba's cache folder, set before any @njit below
from engine.model import simd
from engine.model.bfloat16_bits import as_float32, float_from_bits, numpy_view
from engine.model.cpu_threads import launch_lock, use_threads
from engine.model.packed_matmul_cpu import ROW_GROUP, TILE, tile_product

# context slots a parallel task attends: a batch-1 step at a 1,000-token context makes 4 tasks for the
# threads, and the partials to merge stay few (measured: 128 and 512 were no faster)
CHUNK = 256
MIN_SHARED_CHUNK = 64  # context slots of a cascade group's task, at the least
KEYS = simd.LANES  # keys _key_scores scores at once
SCORE_HEADS = 4  # query heads _key_scores takes per pass over the keys (their sums must fit the registers)
# query vectors of one kv head (rows x its query heads) from which a chunk is two matmuls (_cascade); measured
# in cache, 64 slots, 3 query heads per kv head: 1.2x slower at 2 rows, even at 3, 1.1x faster at 4, 1.3x at 8
CASCADE_QUERIES = 12
# a row-slot of a task in the plain loops costs this many of one in _cascade's matmuls, to deal tasks by
# (measured in decode steps, 8 rows, 960 of 1,000 slots shared: 4.5 us for a row's own 40 slots against 12 us for
# a 64-slot cascade task of 8 rows, 5x a row-slot; 1.8x with K/V in cache. With 1 (slots x rows), one thread
# got every own chunk while the other waited at the join: attention 4.18-4.30 ms a step, 3.98-4.15 with 3 or 4)
PLAIN_COST = 3
VALUE_VECTORS = 16  # sums _weighted_values keeps in registers: 4 heads at head size 64, 2 at 128


def supports(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                 lengths: torch.Tensor, scale: float, shared: Sequence = ()) -> torch.Tensor:
    """q: [B, H, D]; caches: [num_slots, KVH, D]; slots: [B, S] (row b reads slots[b, :lengths[b]]);
    shared: cascade groups (attention.SharedPrefix: .rows read .slots as well, before their own slots).
    Returns the attention output [B, H, D]."""
    rows, heads, dim = q.shape
    out = torch.empty(rows, heads * dim)
    group, shared_slots, shared_lengths = cascade_groups(shared, rows)
    with launch_lock:
        threads = use_threads()
        attend(q.float().reshape(rows, heads * dim).contiguous().numpy(), numpy_view(k_cache), numpy_view(v_cache),
               slots.numpy(), lengths.numpy(), group, shared_slots, shared_lengths, heads, np.float32(scale),
               threads, out.numpy())
    return out.view(rows, heads, dim).to(q.dtype)


def cascade_groups(shared: Sequence, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """attend's form of cascade groups: each row's group (-1: none), the groups' slots [G, longest] and
    their lengths [G]."""
    group = np.full(rows, -1, np.int64)
    for g, prefix in enumerate(shared):
        members = prefix.rows.numpy()
        if np.any(group[members] >= 0):
            raise ValueError("a row can be in one cascade group only")
        group[members] = g
    lengths = np.array([len(p.slots) for p in shared], np.int64)
    slots = np.zeros((len(shared), max(lengths, default=1)), np.int64)  # padded with slot 0, never read
    for g, prefix in enumerate(shared):
        slots[g, :lengths[g]] = prefix.slots.numpy()
    return group, slots, lengths


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE, inline="always")
def fast_exp(x):
    """e^x for x <= 0 to ~1e-7 relative, in plain arithmetic that vectorizes over an array (math.exp is a
    libm call per element): x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor polynomial, 2^n by bits."""
    x = max(x, np.float32(-87.0))  # keeps 2^n a normal float; e^-87 is 0 to a softmax anyway
    # n = x log2(e) rounded to nearest: truncating y - 0.5 rounds any y <= 0.5 so, and unlike math.floor (a
    # libm call per element, measured: 4% of an attention step) it vectorizes
    n = np.float32(np.int32(x * np.float32(1.442695) - np.float32(0.5)))
    r = x - n * np.float32(0.693145751953125) - n * np.float32(1.428606765330187e-06)  # ln2 in two parts
    p = np.float32(1.0) + r * (np.float32(1.0) + r * (np.float32(0.5) + r * (np.float32(1 / 6) + r * (
        np.float32(1 / 24) + r * (np.float32(1 / 120) + r * np.float32(1 / 720))))))
    return p * float_from_bits(np.int32(n + np.float32(127.0)) << 23)


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE, parallel=True)
def attend(q, k_cache, v_cache, slots, lengths, group, shared_slots, shared_lengths, heads, scale, threads, out):
    """q, out: [rows, heads * dim], contiguous; caches: [num_slots, KVH, dim].
    Row m attends slots[m, :lengths[m]] and, when group[m] >= 0, its group's shared_slots[g, :shared_lengths[g]]
    too: the chunks of a shared prefix are read once for every row of the group (cascade attention).
    A row with no slots at all gets 0. threads: numba's thread count (use_threads()), one bin of tasks each."""
    rows = q.shape[0]
    dim = q.shape[1] // heads
    # (3-D, so that no index is computed: numba checks a computed index for wraparound, and that check
    # alone kept the dot products from vectorizing, 3x slower)
    scaled = np.empty((rows, heads, dim), np.float32)
    for m in range(rows):
        for h in range(heads):
            for d in range(dim):
                scaled[m, h, d] = q[m, h * dim + d] * scale
    first, source, chunk_start, chunk_end, member_first, member_row, member_partial, by_bin, bin_first = _plan(
        lengths, group, shared_lengths, threads, heads // k_cache.shape[1], dim)
    acc = np.empty((first[rows], heads, dim), np.float32)  # each partial's unnormalized output,
    top = np.empty((first[rows], heads), np.float32)  # its largest score
    total = np.empty((first[rows], heads), np.float32)  # and its sum of e^(score - top)
    for b in prange(len(bin_first) - 1):
        for k in range(bin_first[b], bin_first[b + 1]):
            task = by_bin[k]
            # the slots of the bin's next task (none after the last), which a cascade task asks for while it computes
            last = k + 1 == bin_first[b + 1]
            after = by_bin[k if last else k + 1]
            following = _context(slots, shared_slots, rows, source[after], chunk_start[after],
                                 chunk_start[after] if last else chunk_end[after])
            _task(scaled, k_cache, v_cache, _context(slots, shared_slots, rows, source[task], chunk_start[task],
                                                     chunk_end[task]), following,
                  member_row[member_first[task]:member_first[task + 1]],
                  member_partial[member_first[task]:member_first[task + 1]], dim, acc, top, total)
    merged = out.reshape(rows, heads, dim)
    for m in prange(rows):
        merged[m] = 0.0
        if first[m] == first[m + 1]:
            continue
        for h in range(heads):
            # (maxima start from a value, not -inf: fastmath lets LLVM assume no infinities)
            row_top = top[first[m], h]
            for partial in range(first[m] + 1, first[m + 1]):
                row_top = max(row_top, top[partial, h])
            row_total = np.float32(0.0)
            for partial in range(first[m], first[m + 1]):
                weight = np.float32(math.exp(top[partial, h] - row_top))
                row_total += weight * total[partial, h]
                for d in range(dim):
                    merged[m, h, d] += weight * acc[partial, h, d]
            for d in range(dim):
                merged[m, h, d] /= row_total


@njit(nogil=True, cache=kernel_cache.CACHE)
def _plan(lengths, group, shared_lengths, threads, per_kv, dim):
    """attend's tasks and their bins (a function of its own: in attend's parallel body numba would launch
    each of these small array operations as a parallel loop, measured: 60 us a call)."""
    rows = len(lengths)
    own = (lengths + CHUNK - 1) // CHUNK
    # a shared chunk serves every row of its group: 1/size of CHUNK each, so that a cascade task costs
    # about what a row's own chunk does and the tasks can be dealt evenly (below), but at least
    # MIN_SHARED_CHUNK slots, which bounds the partials of a large group
    size = np.zeros(len(shared_lengths), np.int64)
    for m in range(rows):
        if group[m] >= 0:
            size[group[m]] += 1
    shared_chunk = np.maximum(CHUNK // np.maximum(size, 1), MIN_SHARED_CHUNK)
    common = (shared_lengths + shared_chunk - 1) // shared_chunk
    # row m's partial softmaxes: first[m] to first[m + 1] - 1, its own chunks then its group's
    first = np.zeros(rows + 1, np.int64)
    for m in range(rows):
        first[m + 1] = first[m] + own[m] + (common[group[m]] if group[m] >= 0 else 0)
    # the tasks: every row's own chunks, then every group's shared chunks; task i fills the partials
    # member_partial[member_first[i]:member_first[i + 1]] of the rows member_row[...] from slots
    # source[i] (a row m, or rows + g for group g), chunk_start[i] to chunk_end[i] - 1
    tasks = own.sum() + common.sum()
    source = np.empty(tasks, np.int64)
    chunk_start = np.empty(tasks, np.int64)
    chunk_end = np.empty(tasks, np.int64)
    member_first = np.empty(tasks + 1, np.int64)
    member_row = np.empty(first[rows], np.int64)
    member_partial = np.empty(first[rows], np.int64)
    task, member = 0, 0
    for m in range(rows):
        for c in range(own[m]):
            source[task], chunk_start[task], member_first[task] = m, c * CHUNK, member
            chunk_end[task] = min((c + 1) * CHUNK, lengths[m])
            member_row[member], member_partial[member] = m, first[m] + c
            task, member = task + 1, member + 1
    for g in range(len(shared_lengths)):
        for c in range(common[g]):
            source[task], chunk_start[task], member_first[task] = rows + g, c * shared_chunk[g], member
            chunk_end[task] = min((c + 1) * shared_chunk[g], shared_lengths[g])
            for m in range(rows):
                if group[m] == g:
                    member_row[member], member_partial[member] = m, first[m] + own[m] + c
                    member += 1
            task += 1
    member_first[tasks] = member
    # the tasks dealt to one bin per thread, the costliest first to the least loaded bin: numba hands each
    # thread an equal run of a prange's iterations, and a cascade task costs members x slots (measured:
    # in task order one thread got every cascade task, and the cascade took 1.2-2.4x the time of reading
    # the prefix once per row), PLAIN_COST times that in the plain loops
    cost = np.empty(tasks, np.int64)
    for task in range(tasks):
        members = member_first[task + 1] - member_first[task]
        cost[task] = (chunk_end[task] - chunk_start[task]) * members * (
            1 if _matmul_form(members, per_kv, dim) else PLAIN_COST)
    bins = min(threads, tasks)
    load = np.zeros(bins, np.int64)
    task_bin = np.empty(tasks, np.int64)
    for task in np.argsort(-cost):
        task_bin[task] = np.argmin(load)
        load[task_bin[task]] += cost[task]
    by_bin = np.argsort(task_bin, kind="mergesort")
    bin_first = np.searchsorted(task_bin[by_bin], np.arange(bins + 1))
    return first, source, chunk_start, chunk_end, member_first, member_row, member_partial, by_bin, bin_first


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE, inline="always")
def _context(slots, shared_slots, rows, source, start, end):
    """Slots start to end - 1 of a row's own context (source < rows) or of a group's shared prefix."""
    return slots[source, start:end] if source < rows else shared_slots[source - rows, start:end]


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE, inline="always")
def _task(q, k_cache, v_cache, context, following, members, partials, dim, acc, top, total):
    """The slots `context` for the rows `members`; `following`: the slots of the thread's next task."""
    if _matmul_form(len(members), q.shape[1] // k_cache.shape[1], dim):
        _cascade(q, members, partials, k_cache, v_cache, context, following, dim, acc, top, total)
    else:
        _chunk(q, members, partials, k_cache, v_cache, context, dim, acc, top, total)


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE, inline="always")
def _matmul_form(members, per_kv, dim):
    """Whether a task of `members` rows (per_kv query heads per kv head) runs as _cascade's two matmuls."""
    return _vector_head_size(dim) and members * per_kv >= CASCADE_QUERIES


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE, inline="always")
def _vector_head_size(dim):
    """Whether the vector kernels (_key_scores, _weighted_values, _pack_keys) are compiled for head size dim."""
    return dim == 64 or dim == 128


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE, inline="always")
def _chunk(q, members, partials, k_cache, v_cache, slots, dim, acc, top, total):
    """One chunk of slots for the rows `members` (q [rows, heads, dim], already scaled), one row after the
    other (measured: rows innermost, every key serving all rows at once, ran 1.3x slower). Fills acc[p]
    [heads, dim], top[p] and total[p] [heads] of each row's partial p."""
    heads = q.shape[1]
    kv_heads = k_cache.shape[1]
    per_kv = heads // kv_heads  # query heads per kv head (GQA)
    count = len(slots)
    vector_keys = count - count % KEYS if _vector_head_size(dim) else 0  # keys the vector kernels score
    scores = np.empty((heads, count), np.float32)
    for i in range(len(members)):  # the chunk's K/V come from memory for the first row, then from the cache
        m, p = members[i], partials[i]
        # (keys outermost: the chunk's K rows stream in order, each pass asking for the next KEYS rows; measured
        # from memory in decode-like steps, 1,000-token contexts: batch 1 1.68-1.82 vs 1.84-1.92 ms, batch 8
        # 10.49-11.22 vs 10.64-11.63 ms)
        for t in range(0, vector_keys, KEYS):
            _prefetch_rows(k_cache, slots, t + KEYS, KEYS)
            for kvh in range(kv_heads):
                last = (kvh + 1) * per_kv  # the GQA group's heads, SCORE_HEADS a pass
                for h in range(kvh * per_kv, last, SCORE_HEADS):
                    if dim == 64:
                        _key_scores(q, m, h, min(SCORE_HEADS, last - h), k_cache, kvh, slots, t, 64, scores)
                    else:
                        _key_scores(q, m, h, min(SCORE_HEADS, last - h), k_cache, kvh, slots, t, 128, scores)
        for h in range(heads):
            kvh = h // per_kv
            for t in range(vector_keys, count):
                slot = slots[t]
                score = np.float32(0.0)
                for d in range(dim):
                    score += q[m, h, d] * as_float32(k_cache[slot, kvh, d])
                scores[h, t] = score
        for h in range(heads):
            top[p, h], total[p, h] = _exponentials(scores[h])
        for kvh in range(kv_heads):
            last = (kvh + 1) * per_kv
            if _vector_head_size(dim):  # the group's heads, as many a pass as their sums fit the registers
                per_pass = VALUE_VECTORS * simd.LANES // dim
                for h in range(kvh * per_kv, last, per_pass):
                    if dim == 64:
                        _weighted_values(scores, h, min(per_pass, last - h), v_cache, kvh, slots, 64, acc, p)
                    else:
                        _weighted_values(scores, h, min(per_pass, last - h), v_cache, kvh, slots, 128, acc, p)
            else:
                for h in range(kvh * per_kv, last):
                    acc[p, h] = 0.0
                    for t in range(count):
                        weight = scores[h, t]
                        for d in range(dim):
                            acc[p, h, d] += weight * as_float32(v_cache[slots[t], kvh, d])


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE, inline="always")
def _cascade(q, members, partials, k_cache, v_cache, slots, following, dim, acc, top, total):
    """_chunk for many queries (members x query heads per kv head) at head size 64 or 128, as matmuls by the
    matmul microkernel (packed_matmul_cpu): per kv head, the chunk's keys are packed as a matmul weight (by
    16 x 16 transposes) and scored against the queries of all its heads of every member with the keys in
    vector lanes, so no sums across lanes; then a softmax per query, and the values, packed likewise,
    weighted by the exponentials as a second matmul."""
    kv_heads = k_cache.shape[1]
    per_kv = q.shape[1] // kv_heads
    count = len(slots)
    padded = (count + TILE - 1) // TILE * TILE
    keys = np.empty((kv_heads, padded // TILE, dim, TILE), np.float32)  # scores = queries @ keys[kvh]
    values = np.empty((kv_heads, dim // TILE, count, TILE), np.float32)  # outputs = exponentials @ values[kvh]
    queries = np.empty((len(members) * per_kv, dim), np.float32)  # row i * per_kv + j: members[i]'s head j
    scores = np.empty((len(queries), padded), np.float32)
    outputs = np.empty((len(queries), dim), np.float32)
    whole = count - count % KEYS
    # the next task's K/V are asked for in shares between the steps below, ahead of their first read
    # (measured: from memory it took as long as this task's arithmetic, one after the other; in one burst it
    # was no faster)
    groups = (len(queries) + ROW_GROUP - 1) // ROW_GROUP
    steps = kv_heads * (groups * (padded // TILE + dim // TILE) + len(queries))
    share, ahead = (len(following) + steps - 1) // steps, 0
    # every kv head's K and V in one pass over the slots (the chunk's one read from memory, in address order),
    # each pass asking for the rows a little ahead of it into L1: what the task before asked for waits in L2,
    # where the transposes' loads found it too slowly (measured in decode-like steps, 8 rows, 960 of 1,000
    # slots shared: packing 2.2 us and copying the values 2.6 us a task against 0.8 and 1.0 with K/V in
    # cache; attention 3.65-3.95 ms a step with these prefetches against 4.02-4.46 without)
    for t in range(0, whole, KEYS):
        _prefetch_rows(k_cache, slots, t + KEYS, KEYS)
        for kvh in range(kv_heads):
            if dim == 64:
                _pack_keys(k_cache, kvh, slots, t, 64, keys[kvh])
            else:
                _pack_keys(k_cache, kvh, slots, t, 128, keys[kvh])
    for t in range(whole, padded):  # the last keys, then zeros to the tile's end
        for kvh in range(kv_heads):
            for d in range(dim):
                keys[kvh, t // TILE, d, t % TILE] = (as_float32(k_cache[slots[t], kvh, d]) if t < count
                                                     else np.float32(0.0))
    for t in range(count):
        if t % 4 == 0:
            _prefetch_rows(v_cache, slots, t + 8, 4)
        for kvh in range(kv_heads):
            for c in range(dim // TILE):
                _copy(values[kvh, c, t], v_cache[slots[t], kvh, c * TILE:], TILE)
    for kvh in range(kv_heads):
        for i in range(len(members)):
            for j in range(per_kv):
                for c in range(dim // TILE):
                    _copy(queries[i * per_kv + j, c * TILE:], q[members[i], kvh * per_kv + j, c * TILE:], TILE)
        for first in range(0, len(queries), ROW_GROUP):
            for tile in range(padded // TILE):
                tile_product(queries[first:first + ROW_GROUP], keys[kvh], tile,
                             scores[first:first + ROW_GROUP, tile * TILE:], False)
                ahead = _prefetch(k_cache, v_cache, following, ahead, share)
        for i in range(len(members)):
            for j in range(per_kv):
                top[partials[i], kvh * per_kv + j], total[partials[i], kvh * per_kv + j] = _exponentials(
                    scores[i * per_kv + j, :count])
                ahead = _prefetch(k_cache, v_cache, following, ahead, share)
        for first in range(0, len(queries), ROW_GROUP):
            for tile in range(dim // TILE):
                tile_product(scores[first:first + ROW_GROUP, :count], values[kvh], tile,
                             outputs[first:first + ROW_GROUP, tile * TILE:], False)
                ahead = _prefetch(k_cache, v_cache, following, ahead, share)
        for i in range(len(members)):
            for j in range(per_kv):
                for c in range(dim // TILE):
                    _copy(acc[partials[i], kvh * per_kv + j, c * TILE:], outputs[i * per_kv + j, c * TILE:], TILE)


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE, inline="always")
def _exponentials(scores):
    """scores[t] = e^(scores[t] - largest) in place; returns the largest score and the sum of the exponentials."""
    whole = len(scores) - len(scores) % simd.LANES
    largest = _largest(scores, whole // simd.LANES) if whole else scores[0]
    for t in range(whole, len(scores)):
        largest = max(largest, scores[t])
    summed = np.float32(0.0)
    for t in range(len(scores)):
        e = fast_exp(scores[t] - largest)
        scores[t] = e
        summed += e
    return largest, summed


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


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE, inline="always")
def _prefetch(k_cache, v_cache, slots, ahead, share):
    """Asks for the K/V of slots[ahead:ahead + share] into every cache level; returns the next `ahead`."""
    _prefetch_rows(k_cache, slots, ahead, share)
    _prefetch_rows(v_cache, slots, ahead, share)
    return ahead + share


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE, inline="always")
def _prefetch_rows(cache, slots, start, count):
    """Asks for the rows of cache at slots[start:start + count] (those there are)."""
    for t in range(start, min(start + count, len(slots))):
        _prefetch_row(cache, slots[t])


@intrinsic
def _prefetch_row(typingctx, cache, slot):
    """Asks for cache[slot] (every kv head's) into every cache level, ahead of its use (measured in decode-like
    steps, 8 rows with 960 slots shared: attention 3.82-4.10 ms a step against 3.98-4.36 ms from L2 outward)."""
    def codegen(context, builder, signature, args):
        cache_ty = signature.args[0]
        cache_arg, slot_arg = args
        row = simd.element_pointer(context, builder, cache_ty, cache_arg, [slot_arg, simd.const(0), simd.const(0)])
        shape = cgutils.unpack_tuple(builder, context.make_array(cache_ty)(context, builder, cache_arg).shape, 3)
        size = builder.mul(builder.mul(shape[1], shape[2]), simd.const(context.get_abi_sizeof(
            context.get_data_type(cache_ty.dtype))))
        lines = builder.udiv(builder.add(size, simd.const(simd.CACHE_LINE - 1)), simd.const(simd.CACHE_LINE))
        with cgutils.for_range(builder, lines) as loop:
            simd.prefetch(builder, row, builder.mul(loop.index, simd.const(simd.CACHE_LINE)))
        return context.get_dummy_value()

    return types.void(cache, slot), codegen


@intrinsic
def _copy(typingctx, dst, src, n):
    """dst[:n] = src[:n] (float32, or bfloat16 bits widened) for n a constant multiple of LANES, both with unit
    stride: straight vector moves (numba's loop over computed indices does not vectorize, measured 17x slower)."""
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
    of their elements. dim (64 or 128) is a constant."""
    if not isinstance(dim, types.IntegerLiteral):
        return None
    pieces = dim.literal_value // simd.LANES
    bits = k_cache.dtype == types.uint16

    def codegen(context, builder, signature, args):
        k_arg, kvh_arg, slots_arg, t_arg, _, keys_arg = args
        k_ty, _, slots_ty, _, _, keys_ty = signature.args
        at = functools.partial(simd.element_pointer, context, builder)  # at(array type, array, indices)
        rows = [at(k_ty, k_arg, [builder.load(at(slots_ty, slots_arg, [builder.add(t_arg, simd.const(j))])), kvh_arg,
                                  simd.const(0)]) for j in range(KEYS)]
        tile, column = builder.sdiv(t_arg, simd.const(TILE)), builder.srem(t_arg, simd.const(TILE))
        for c in range(pieces):
            columns = simd.transpose(builder, [simd.load(builder, builder.gep(row, [simd.const(c * simd.LANES)]), bits)
                                               for row in rows])
            for d, vector in enumerate(columns):
                simd.store(builder, vector, at(keys_ty, keys_arg, [tile, simd.const(c * simd.LANES + d), column]))
        return context.get_dummy_value()

    return types.void(k_cache, kvh, slots, t, dim, keys), codegen


@intrinsic
def _key_scores(typingctx, q, m, h, group, k_cache, kvh, slots, t, dim, scores):
    """scores[h + i, t:t + KEYS] = q[m, h + i] . k_cache[slots[t + j], kvh] for i < group and j < KEYS: `group`
    (1 to SCORE_HEADS) query heads of one kv head (GQA), each key read once for all of them; dim (64 or 128)
    is a constant. Each key's products are summed lane-wise into one vector per head and the KEYS vectors then
    into one (simd.sum_lanes_of_each), so no key pays a horizontal sum of its own."""
    if not isinstance(dim, types.IntegerLiteral):
        return None  # numba then retries with the literal value of the constant the caller passes
    pieces = dim.literal_value // simd.LANES
    bits = k_cache.dtype == types.uint16

    def codegen(context, builder, signature, args):
        q_arg, m_arg, h_arg, group_arg, k_arg, kvh_arg, slots_arg, t_arg, _, scores_arg = args
        q_ty, _, _, _, k_ty, _, slots_ty, _, _, scores_ty = signature.args

        at = functools.partial(simd.element_pointer, context, builder)  # at(array type, array, indices)

        def head(i):
            return builder.add(h_arg, simd.const(i))

        def scores_of(heads):
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

        simd.cases(builder, group_arg, range(1, SCORE_HEADS + 1), scores_of)
        return context.get_dummy_value()

    return types.void(q, m, h, group, k_cache, kvh, slots, t, dim, scores), codegen


@intrinsic
def _weighted_values(typingctx, weights, h, group, v_cache, kvh, slots, dim, acc, p):
    """acc[p, h + i] = sum over t of weights[h + i, t] * v_cache[slots[t], kvh] for i < group: `group` query
    heads of one kv head (up to VALUE_VECTORS vectors of sums: 4 heads at head size 64, 2 at 128), each value
    read once for all of them; dim (64 or 128) is a constant. The sums stay in registers across the keys,
    each weight broadcast against its value's vectors."""
    if not isinstance(dim, types.IntegerLiteral):
        return None
    pieces = dim.literal_value // simd.LANES
    bits = v_cache.dtype == types.uint16

    def codegen(context, builder, signature, args):
        w_arg, h_arg, group_arg, v_arg, kvh_arg, slots_arg, _, acc_arg, p_arg = args
        w_ty, _, _, v_ty, _, slots_ty, _, acc_ty, _ = signature.args

        at = functools.partial(simd.element_pointer, context, builder)  # at(array type, array, indices)

        def head(i):
            return builder.add(h_arg, simd.const(i))

        count = cgutils.unpack_tuple(builder, context.make_array(slots_ty)(context, builder, slots_arg).shape, 1)[0]

        def weighted_values_of(heads):
            def step(t, sums):  # sums[i] += weights[h + i, t] * v_cache[slots[t], kvh]
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

        simd.cases(builder, group_arg, range(1, VALUE_VECTORS // pieces + 1), weighted_values_of)
        return context.get_dummy_value()

    return types.void(weights, h, group, v_cache, kvh, slots, dim, acc, p), codegen
