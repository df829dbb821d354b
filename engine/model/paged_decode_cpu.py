"""Decode attention that reads K/V straight from the paged cache on CPU (no gathered copy).

The plain path copies every decode's context out of the cache once per layer (`index_select`) and then
runs torch's SDPA over the copy: at a 1,000-token context that copy costs more than the attention
itself. This kernel walks each row's slots in place and returns the log-sum-exp that cascade attention
merges with. The compiled decode step (decode_step_cpu.py) and the per-layer eager path both call it.

Work is split flash-decoding style: each row's context is cut into chunks of CHUNK slots, the chunks of
all rows are spread over numba's threads, and each row's partial softmaxes are merged at the end by
their maxima. A chunk takes three passes: scores (each cached key is read once for every query head of
its GQA group), their exponentials (a loop that vectorizes), the weighted values. Head sizes 64 and 128
get their own compiled copy of the chunk, so the per-slot dot products have a constant length that
LLVM unrolls into whole vector registers (measured here at head size 64: bfloat16 attention took 0.7x
the time of the same code with a run-time length). float32 and bfloat16 caches (the math is float32);
CUDA takes the plain path.
"""
from __future__ import annotations

import math
import threading

import numba
import numpy as np
import torch
from numba import njit, prange

from engine.model import kernel_cache  # noqa: F401  (numba's cache folder, set before any @njit below)
from engine.model.bfloat16_bits import as_float32, float_from_bits, numpy_view

# context slots a parallel task attends: a batch-1 step at a 1,000-token context makes 4 tasks for the
# threads, and the partials to merge stay few (measured: 128 and 512 were no faster)
CHUNK = 256

# numba's workqueue layer (the fallback where no OpenMP is found) must not be entered by two threads at once
launch_lock = threading.Lock()


def supports(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                 lengths: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [B, H, D]; caches: [num_slots, KVH, D]; slots: [B, S] (row b reads slots[b, :lengths[b]]).
    Returns the attention output [B, H, D] and its log-sum-exp [B, H]."""
    rows, heads, dim = q.shape
    out = torch.empty(rows, heads * dim)
    lse = torch.empty(rows, heads)
    with launch_lock:
        use_threads()
        attend(q.float().reshape(rows, heads * dim).contiguous().numpy(), numpy_view(k_cache), numpy_view(v_cache),
               slots.numpy(), lengths.numpy(), heads, np.float32(scale), out.numpy(), lse.numpy())
    return out.view(rows, heads, dim).to(q.dtype), lse


def use_threads() -> None:
    """numba's parallel regions use as many threads as torch's (the setting is per calling thread)."""
    numba.set_num_threads(min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))


@njit(fastmath=True, nogil=True, cache=True, inline="always")
def fast_exp(x):
    """e^x for x <= 0 to ~1e-7 relative, in plain arithmetic that vectorizes over an array (math.exp is a
    libm call per element): x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor polynomial, 2^n by bits."""
    x = max(x, np.float32(-87.0))  # keeps 2^n a normal float; e^-87 is 0 to a softmax anyway
    n = np.float32(math.floor(x * np.float32(1.442695) + np.float32(0.5)))
    r = x - n * np.float32(0.693145751953125) - n * np.float32(1.428606765330187e-06)  # ln2 in two parts
    p = np.float32(1.0) + r * (np.float32(1.0) + r * (np.float32(0.5) + r * (np.float32(1 / 6) + r * (
        np.float32(1 / 24) + r * (np.float32(1 / 120) + r * np.float32(1 / 720))))))
    return p * float_from_bits(np.int32(n + np.float32(127.0)) << 23)


@njit(fastmath=True, nogil=True, cache=True, parallel=True)
def attend(q, k_cache, v_cache, slots, lengths, heads, scale, out, lse):
    """q, out: [rows, heads * dim] (q may be a strided view, out is contiguous); caches: [num_slots, KVH, dim]; row m attends
    slots[m, :lengths[m]]; lse: [rows, heads]. A row with no slots gets 0 and a log-sum-exp of -inf."""
    rows = q.shape[0]
    dim = q.shape[1] // heads
    # (3-D, so that no index is computed: numba checks a computed index for wraparound, and that check
    # alone kept the dot products from vectorizing, 3x slower)
    scaled = np.empty((rows, heads, dim), np.float32)
    for m in range(rows):
        for h in range(heads):
            for d in range(dim):
                scaled[m, h, d] = q[m, h * dim + d] * scale
    first = np.empty(rows + 1, np.int64)  # row m's chunks are tasks first[m] to first[m + 1] - 1
    first[0] = 0
    for m in range(rows):
        first[m + 1] = first[m] + (lengths[m] + CHUNK - 1) // CHUNK
    tasks = first[rows]
    task_row = np.empty(tasks, np.int64)
    for m in range(rows):
        task_row[first[m]:first[m + 1]] = m
    acc = np.empty((tasks, heads, dim), np.float32)  # each chunk's unnormalized output,
    top = np.empty((tasks, heads), np.float32)  # its largest score
    total = np.empty((tasks, heads), np.float32)  # and its sum of e^(score - top)
    for task in prange(tasks):
        m = task_row[task]
        start = (task - first[m]) * CHUNK
        count = min(CHUNK, lengths[m] - start)
        if dim == 64:
            _chunk(scaled[m], k_cache, v_cache, slots[m, start:start + count], 64, acc[task], top[task], total[task])
        elif dim == 128:
            _chunk(scaled[m], k_cache, v_cache, slots[m, start:start + count], 128, acc[task], top[task],
                   total[task])
        else:
            _chunk(scaled[m], k_cache, v_cache, slots[m, start:start + count], dim, acc[task], top[task],
                   total[task])
    merged = out.reshape(rows, heads, dim)
    for m in prange(rows):
        for h in range(heads):
            row_top = np.float32(-np.inf)
            for task in range(first[m], first[m + 1]):
                row_top = max(row_top, top[task, h])
            row_total = np.float32(0.0)
            for d in range(dim):
                merged[m, h, d] = 0.0
            for task in range(first[m], first[m + 1]):
                weight = np.float32(math.exp(top[task, h] - row_top))
                row_total += weight * total[task, h]
                for d in range(dim):
                    merged[m, h, d] += weight * acc[task, h, d]
            if row_total > 0:
                for d in range(dim):
                    merged[m, h, d] /= row_total
            lse[m, h] = row_top + math.log(row_total) if row_total > 0 else -np.inf


@njit(fastmath=True, nogil=True, cache=True, inline="always")
def _chunk(q, k_cache, v_cache, slots, dim, acc, top, total):
    """One chunk of one row: q [heads, dim] already scaled; acc [heads, dim], top and total [heads] out."""
    heads = acc.shape[0]
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads  # query heads per kv head (GQA)
    count = len(slots)
    scores = np.empty((heads, count), np.float32)
    for t in range(count):
        slot = slots[t]
        for kvh in range(kv_heads):
            for h in range(kvh * group, (kvh + 1) * group):
                score = np.float32(0.0)
                for d in range(dim):
                    score += q[h, d] * as_float32(k_cache[slot, kvh, d])
                scores[h, t] = score
    for h in range(heads):
        largest = np.float32(-np.inf)
        for t in range(count):
            largest = max(largest, scores[h, t])
        summed = np.float32(0.0)
        for t in range(count):
            e = fast_exp(scores[h, t] - largest)
            scores[h, t] = e
            summed += e
        top[h] = largest
        total[h] = summed
    acc[:] = 0.0
    for t in range(count):
        slot = slots[t]
        for kvh in range(kv_heads):
            for h in range(kvh * group, (kvh + 1) * group):
                p = scores[h, t]
                for d in range(dim):
                    acc[h, d] += p * as_float32(v_cache[slot, kvh, d])
