"""Decode attention that reads K/V straight from the paged cache on CPU (no gathered copy).

The plain path copies every decode's context out of the cache once per layer (`index_select`) and then
runs torch's SDPA over the copy: at a 1,000-token context that copy costs more than the attention
itself, and at batch 8 it is most of the step. This kernel walks each row's slots in place with an
online softmax and returns the log-sum-exp that cascade attention merges with. numba compiles it once
(cached on disk). A batch's rows are split over torch's thread count: the caller takes one share and
plain Python threads (waiting on a lock while idle, the kernel releases the GIL) the others. numba's
own thread pool is not used: beside torch's OpenMP threads it slowed the matmuls around it more than
the second thread saved (measured: a batch-8 step went from 56 ms to 150 ms). float32 and bfloat16
caches (the math is float32); CUDA takes the plain path.
"""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from numba import njit

from engine.model.bfloat16_bits import as_float32, numpy_view


def supports(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                 lengths: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [B, H, D]; caches: [num_slots, KVH, D]; slots: [B, S] (row b reads slots[b, :lengths[b]]).
    Returns the attention output [B, H, D] and its log-sum-exp [B, H]."""
    out = torch.empty(q.shape)
    lse = torch.empty(q.shape[:2])
    args = (q.float().contiguous().numpy(), numpy_view(k_cache), numpy_view(v_cache), slots.numpy(), lengths.numpy(),
            np.float32(scale), out.numpy(), lse.numpy())
    shares = min(torch.get_num_threads(), q.shape[0])
    if shares == 1:
        _kernel(*args)
    else:  # rows in contiguous shares: one on this thread, the others on the helper threads
        bounds = [q.shape[0] * i // shares for i in range(shares + 1)]
        pending = [_helpers(shares - 1).submit(_rows, args, bounds[i], bounds[i + 1]) for i in range(1, shares)]
        _rows(args, bounds[0], bounds[1])
        for future in pending:
            future.result()
    return out.to(q.dtype), lse


_pool: tuple[int, ThreadPoolExecutor] | None = None  # (workers, pool), made on first use


def _helpers(count: int) -> ThreadPoolExecutor:
    global _pool
    if _pool is None or _pool[0] < count:
        _pool = (count, ThreadPoolExecutor(count, thread_name_prefix="paged-decode"))
    return _pool[1]


def _rows(args: tuple, start: int, end: int) -> None:
    q, k_cache, v_cache, slots, lengths, scale, out, lse = args
    _kernel(q[start:end], k_cache, v_cache, slots[start:end], lengths[start:end], scale, out[start:end],
            lse[start:end])


@njit(fastmath=True, cache=True, nogil=True)
def _kernel(q, k_cache, v_cache, slots, lengths, scale, out, lse):
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads  # query heads per kv head (GQA)
    run_max = np.empty(heads, dtype=np.float32)
    run_sum = np.empty(heads, dtype=np.float32)
    acc = np.empty((heads, dim), dtype=np.float32)
    for b in range(batch):
        run_max[:] = -np.inf
        run_sum[:] = 0.0
        acc[:] = 0.0
        scaled_q = q[b] * scale
        for t in range(lengths[b]):
            slot = slots[b, t]
            for kvh in range(kv_heads):
                key, value = k_cache[slot, kvh], v_cache[slot, kvh]
                for h in range(kvh * group, (kvh + 1) * group):
                    qh, ah = scaled_q[h], acc[h]
                    score = np.float32(0.0)
                    for d in range(dim):
                        score += qh[d] * as_float32(key[d])
                    if score > run_max[h]:  # a new maximum rescales what was summed so far
                        rescale = np.float32(math.exp(run_max[h] - score))
                        run_sum[h] = run_sum[h] * rescale + 1.0
                        for d in range(dim):
                            ah[d] = ah[d] * rescale + as_float32(value[d])
                        run_max[h] = score
                    else:
                        p = np.float32(math.exp(score - run_max[h]))
                        run_sum[h] += p
                        for d in range(dim):
                            ah[d] += p * as_float32(value[d])
        for h in range(heads):
            for d in range(dim):
                out[b, h, d] = acc[h, d] / run_sum[h]
            lse[b, h] = run_max[h] + math.log(run_sum[h])
