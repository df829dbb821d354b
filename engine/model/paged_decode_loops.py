"""The loops of one task of the CPU decode attention (paged_decode_cpu.py): a chunk of slots for its rows, one
row after the other (_chunk), or for many queries as two matmuls (_cascade); the softmax's exponentials
and the prefetches. The vector kernels they call are in paged_decode_vectors.py.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from engine.model import kernel_cache  # numba's cache folder, set before any @njit below
from engine.model import simd
from engine.model.bfloat16_bits import as_float32, float_from_bits
from engine.model.packed_matmul_cpu import ROW_GROUP, TILE, tile_product
from engine.model.paged_decode_vectors import (KEYS, SCORE_HEADS, VALUE_VECTORS, _copy, _key_scores, _largest,
                                               _pack_keys, _prefetch_row, _vector_head_size, _weighted_values)

# query vectors of one kv head (rows x its query heads) from which a chunk is two matmuls (_cascade): below
# it the matmul form measured slower than the plain loops (docs/speed.md#paged-attention)
CASCADE_QUERIES = 12


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE, inline="always")
def fast_exp(x):
    """e^x for x <= 0 to ~1e-7 relative, in plain arithmetic that vectorizes over an array (math.exp is a
    libm call per element): x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor polynomial, 2^n by bits."""
    x = max(x, np.float32(-87.0))  # keeps 2^n a normal float; e^-87 is 0 to a softmax anyway
    # n = x log2(e) rounded to nearest: truncating y - 0.5 rounds any y <= 0.5 so, and unlike math.floor (a
    # libm call per element, a visible share of an attention profile) it vectorizes
    n = np.float32(np.int32(x * np.float32(1.442695) - np.float32(0.5)))
    r = x - n * np.float32(0.693145751953125) - n * np.float32(1.428606765330187e-06)  # ln2 in two parts
    p = np.float32(1.0) + r * (np.float32(1.0) + r * (np.float32(0.5) + r * (np.float32(1 / 6) + r * (
        np.float32(1 / 24) + r * (np.float32(1 / 120) + r * np.float32(1 / 720))))))
    return p * float_from_bits(np.int32(n + np.float32(127.0)) << 23)


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE, inline="always")
def _task(q, k_cache, v_cache, context, following, members, partials, dim, acc, top, total):
    """The slots `context` for the rows `members`; `following`: the slots of the thread's next task."""
    if _matmul_form(len(members), q.shape[1] // k_cache.shape[1], dim):
        _cascade(q, members, partials, k_cache, v_cache, context, following, dim, acc, top, total)
    else:
        _chunk(q, members, partials, k_cache, v_cache, context, following, dim, acc, top, total)


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE, inline="always")
def _matmul_form(members, per_kv, dim):
    """Whether a task of `members` rows (per_kv query heads per kv head) runs as _cascade's two matmuls."""
    return _vector_head_size(dim) and members * per_kv >= CASCADE_QUERIES


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE, inline="always")
def _chunk(q, members, partials, k_cache, v_cache, slots, following, dim, acc, top, total):
    """One chunk of slots for the rows `members` (q [rows, heads, dim], already scaled), one row after the
    other (rows innermost, every key serving all rows at once, measured slower). Fills acc[p]
    [heads, dim], top[p] and total[p] [heads] of each row's partial p; asks for the K/V of `following` (the
    slots of the thread's next task) in its last row's value passes."""
    heads = q.shape[1]
    kv_heads = k_cache.shape[1]
    per_kv = heads // kv_heads  # query heads per kv head (GQA)
    count = len(slots)
    vector_keys = count - count % KEYS if _vector_head_size(dim) else 0  # keys the vector kernels score
    scores = np.empty((heads, count), np.float32)
    for i in range(len(members)):  # the chunk's K/V come from memory for the first row, then from the cache
        m, p = members[i], partials[i]
        # (keys outermost: the chunk's K rows stream in order, each pass asking for the next KEYS rows; measured
        # faster from memory: docs/speed.md#paged-attention)
        for t in range(0, vector_keys, KEYS):
            _prefetch_rows(k_cache, slots, t + KEYS, KEYS)
            _prefetch_rows(v_cache, slots, t, KEYS)  # for the value pass below, which found them cold
            for kvh in range(kv_heads):
                last = (kvh + 1) * per_kv  # the GQA group's heads, SCORE_HEADS a pass
                for h in range(kvh * per_kv, last, SCORE_HEADS):
                    _key_scores(q, m, h, min(SCORE_HEADS, last - h), k_cache, kvh, slots, t, dim, scores)
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
        # the value passes work from the cache: while they run, the last row's ask for the thread's next task's K/V,
        # a share each (from memory a chunk's time was its arithmetic plus its wait, apart; docs/speed.md)
        share = (len(following) + kv_heads - 1) // kv_heads if i == len(members) - 1 else 0
        for kvh in range(kv_heads):
            last = (kvh + 1) * per_kv
            ahead = following[kvh * share:(kvh + 1) * share]
            if _vector_head_size(dim):  # the group's heads, as many a pass as their sums fit the registers
                per_pass = VALUE_VECTORS * simd.LANES // dim
                for h in range(kvh * per_kv, last, per_pass):
                    _weighted_values(scores, h, min(per_pass, last - h), k_cache, v_cache, kvh, slots, dim, acc, p,
                                     ahead if h == kvh * per_kv else following[:0])
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
    # (from memory it took as long as this task's arithmetic, one after the other; one burst was no faster)
    groups = (len(queries) + ROW_GROUP - 1) // ROW_GROUP
    steps = kv_heads * (groups * (padded // TILE + dim // TILE) + len(queries))
    share, ahead = (len(following) + steps - 1) // steps, 0
    # every kv head's K and V in one pass over the slots (the chunk's one read from memory, in address order),
    # each pass asking for the rows a little ahead of it into L1: what the task before asked for waits in L2,
    # where the transposes' loads found it too slowly (measured: docs/speed.md#paged-attention)
    for t in range(0, whole, KEYS):
        _prefetch_rows(k_cache, slots, t + KEYS, KEYS)
        for kvh in range(kv_heads):
            _pack_keys(k_cache, kvh, slots, t, dim, keys[kvh])
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
