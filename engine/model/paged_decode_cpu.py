"""Decode attention that reads K/V straight from the paged cache on CPU (no gathered copy): its entry, its
plan of tasks and the merge. The loops of one task are in paged_decode_loops.py, their vector kernels in
paged_decode_vectors.py.

The plain path copies every decode's context out of the cache once per layer (`index_select`) and then
runs torch's SDPA over the copy: at a 1,000-token context that copy costs more than the attention
itself. This kernel walks each row's slots in place. The compiled decode step (decode_step_cpu.py) and
the per-layer eager path both call it.

Work is split flash-decoding style: each row's context is cut into equal chunks of at most CHUNK slots, the
chunks are spread over numba's threads, and each row's partial softmaxes are merged at the end by their
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
a share between its steps. Its speed (`python -m bench.attention`): docs/speed.md#paged-attention. Other
head sizes take the plain loops (one compiled copy of the chunk serves every head size: a copy per size,
as the plain loops once had, made the kernel's first compile slower). float32 and bfloat16 caches (the
math is float32); other dtypes and CUDA take the plain path.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
import torch
from numba import njit, prange

from engine.model import kernel_cache  # numba's cache folder, set before any @njit below
from engine.model.bfloat16_bits import numpy_view
from engine.model.cpu_threads import launch_lock, use_threads
from engine.model.paged_decode_loops import _matmul_form, _task

# context slots a parallel task attends: a batch-1 step at a 1,000-token context makes 4 tasks for the
# threads, and the partials to merge stay few (128 and 512 measured no faster)
CHUNK = 256
# a row's own context shorter than CHUNK but of at least twice this many slots is split in two halves, so that
# a short context's attention at batch 1 runs on two threads rather than one (the split depends on the row's
# length alone: a row's answer never depends on its batch or on the thread count)
MIN_OWN_CHUNK = 64
# context slots of a cascade group's task, at the least: its two matmuls are over this many keys, and at 64 a
# task's packing and calls cost more than its arithmetic (Zen 5: 8 rows on 960 shared slots 3% faster at 128)
MIN_SHARED_CHUNK = 128
# a row-slot of a task in the plain loops costs this many of one in _cascade's matmuls, to deal tasks by (with
# 1, one thread got every own chunk while the other waited at the join; docs/speed.md#paged-attention)
PLAIN_COST = 3


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
    if not shared:
        return _no_groups(rows)
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


@functools.lru_cache(maxsize=64)
def _no_groups(rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """cascade_groups() of no shared prefix, made once per row count (the kernels only read them): three fresh
    arrays took 20 us of a batch-1 step's Python."""
    return np.full(rows, -1, np.int64), np.zeros((0, 1), np.int64), np.zeros(0, np.int64)


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE, parallel=True)
def attend(q, k_cache, v_cache, slots, lengths, group, shared_slots, shared_lengths, heads, scale, threads, out):
    """q, out: [rows, heads * dim], contiguous; caches: [num_slots, KVH, dim].
    Row m attends slots[m, :lengths[m]] and, when group[m] >= 0, its group's shared_slots[g, :shared_lengths[g]]
    too: the chunks of a shared prefix are read once for every row of the group (cascade attention).
    A row with no slots at all gets 0. threads: numba's thread count (use_threads()), one bin of tasks each."""
    rows = q.shape[0]
    dim = q.shape[1] // heads
    scaled = np.empty((rows, heads, dim), np.float32)
    scale_queries(q.reshape(rows, heads, dim), scale, scaled)
    tasks = plan(lengths, group, shared_lengths, threads, heads // k_cache.shape[1], dim)
    partials = new_partials(tasks, heads, dim)
    for b in prange(bins(tasks)):
        run_bin(tasks, b, scaled, k_cache, v_cache, slots, shared_slots, partials)
    merged = out.reshape(rows, heads, dim)
    for m in prange(rows):
        merge_row(tasks, partials, m, merged[m])


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE)
def scale_queries(q, scale, scaled):
    """scaled = q * scale, both [rows, heads, dim] (3-D, so that no index is computed: numba checks a computed
    index for wraparound, and that check alone kept the dot products from vectorizing)."""
    for m in range(q.shape[0]):
        for h in range(q.shape[1]):
            for d in range(q.shape[2]):
                scaled[m, h, d] = q[m, h, d] * scale


@njit(nogil=True, cache=kernel_cache.CACHE)
def new_partials(plan, heads, dim):
    """The plan's partial softmaxes, to be filled by run_bin: each one's unnormalized output, its largest score
    and its sum of e^(score - largest)."""
    partials = plan[0][-1]
    return (np.empty((partials, heads, dim), np.float32), np.empty((partials, heads), np.float32),
            np.empty((partials, heads), np.float32))


@njit(nogil=True, cache=kernel_cache.CACHE)
def bins(plan):
    """The plan's bins of tasks (one per thread, but fewer where there are fewer tasks)."""
    return len(plan[8]) - 1


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE)
def run_bin(plan, b, scaled, k_cache, v_cache, slots, shared_slots, partials):
    """The tasks of bin b, on the calling thread: their partial softmaxes into `partials`."""
    first, source, chunk_start, chunk_end, member_first, member_row, member_partial, by_bin, bin_first = plan
    acc, top, total = partials
    rows, dim = scaled.shape[0], scaled.shape[2]
    for k in range(bin_first[b], bin_first[b + 1]):
        task = by_bin[k]
        # the slots of the bin's next task (none after the last), which a task asks for while it computes
        last = k + 1 == bin_first[b + 1]
        after = by_bin[k if last else k + 1]
        following = _context(slots, shared_slots, rows, source[after], chunk_start[after],
                             chunk_start[after] if last else chunk_end[after])
        _task(scaled, k_cache, v_cache, _context(slots, shared_slots, rows, source[task], chunk_start[task],
                                                 chunk_end[task]), following,
              member_row[member_first[task]:member_first[task + 1]],
              member_partial[member_first[task]:member_first[task + 1]], dim, acc, top, total)


@njit(fastmath=True, nogil=True, cache=kernel_cache.CACHE, error_model="numpy")  # (its division vectorizes)
def merge_row(plan, partials, m, out):
    """Row m's attention output [heads, dim] from its partial softmaxes, merged by their maxima (0 for a row
    with no slots)."""
    first = plan[0]
    acc, top, total = partials
    out[:] = 0.0
    if first[m] == first[m + 1]:
        return
    for h in range(out.shape[0]):
        # (maxima start from a value, not -inf: fastmath lets LLVM assume no infinities)
        row_top = top[first[m], h]
        for partial in range(first[m] + 1, first[m + 1]):
            row_top = max(row_top, top[partial, h])
        row_total = np.float32(0.0)
        for partial in range(first[m], first[m + 1]):
            weight = np.float32(math.exp(top[partial, h] - row_top))
            row_total += weight * total[partial, h]
            for d in range(out.shape[1]):
                out[h, d] += weight * acc[partial, h, d]
        for d in range(out.shape[1]):
            out[h, d] /= row_total


@njit(nogil=True, cache=kernel_cache.CACHE)
def plan(lengths, group, shared_lengths, threads, per_kv, dim):
    """attend's tasks and their bins (a function of its own: in attend's parallel body numba would launch
    each of these small array operations as a parallel loop, which measured costly)."""
    rows = len(lengths)
    halves = (lengths < CHUNK) & (lengths >= 2 * MIN_OWN_CHUNK)
    own = np.where(halves, 2, (lengths + CHUNK - 1) // CHUNK)  # each row's own chunks (none for no slots)
    # of equal size (the last up to `own` slots shorter): 968 slots as 4 x 242, not 3 x 256 and 200, which kept
    # one thread waiting at batch 1 for the other's 56 slots more
    own_chunk = (lengths + np.maximum(own, 1) - 1) // np.maximum(own, 1)
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
            source[task], chunk_start[task], member_first[task] = m, c * own_chunk[m], member
            chunk_end[task] = min((c + 1) * own_chunk[m], lengths[m])
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
    # thread an equal run of a prange's iterations, and a cascade task costs members x slots (in task order
    # one thread got every cascade task, slower than no cascade), PLAIN_COST times that in the plain loops
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
