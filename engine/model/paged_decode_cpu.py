"""Decode attention that reads K/V straight from the paged cache on CPU (no gathered copy).

The plain path copies every decode's context out of the cache once per layer (`index_select`) and then
runs torch's SDPA over the copy: at a 1,000-token context that copy costs more than the attention
itself, and at batch 8 it is most of the step. This kernel walks each row's slots in place with an
online softmax and returns the log-sum-exp that cascade attention merges with. numba compiles it once
(cached on disk). It runs on the calling thread: a numba thread pool beside torch's OpenMP threads
slowed the matmuls around it more than the second thread saved (measured: a batch-8 step went from
56 ms to 150 ms). float32 only: other dtypes and devices take the plain path.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit


def supports(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype == torch.float32


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                 lengths: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [B, H, D]; caches: [num_slots, KVH, D]; slots: [B, S] (row b reads slots[b, :lengths[b]]).
    Returns the attention output [B, H, D] and its log-sum-exp [B, H]."""
    out = torch.empty(q.shape)
    lse = torch.empty(q.shape[:2])
    _kernel(q.contiguous().numpy(), k_cache.numpy(), v_cache.numpy(), slots.numpy(), lengths.numpy(),
            np.float32(scale), out.numpy(), lse.numpy())
    return out, lse


@njit(fastmath=True, cache=True)
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
                        score += qh[d] * key[d]
                    if score > run_max[h]:  # a new maximum rescales what was summed so far
                        rescale = math.exp(run_max[h] - score)
                        run_sum[h] = run_sum[h] * rescale + 1.0
                        for d in range(dim):
                            ah[d] = ah[d] * rescale + value[d]
                        run_max[h] = score
                    else:
                        p = math.exp(score - run_max[h])
                        run_sum[h] += p
                        for d in range(dim):
                            ah[d] += p * value[d]
        for h in range(heads):
            for d in range(dim):
                out[b, h, d] = acc[h, d] / run_sum[h]
            lse[b, h] = run_max[h] + math.log(run_sum[h])
