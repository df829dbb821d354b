"""Admission order of waiting requests: FCFS, or longest cached prefix first with a bounded wait."""
from __future__ import annotations

from collections import Counter

from engine.config import SchedulingPolicy
from engine.kv.kv_cache_manager import KVCacheManager
from engine.request import Request


class AdmissionOrder:
    def __init__(self, policy: SchedulingPolicy, max_reorder_wait_s: float, max_queue: int,
                 kv: KVCacheManager) -> None:
        self.policy = policy
        self.max_reorder_wait_s = max_reorder_wait_s
        self.max_queue = max_queue
        self.kv = kv

    def is_overdue(self, request: Request, now: float) -> bool:
        """May no later arrival pass `request` any more? Under FCFS none ever may."""
        return self.policy is SchedulingPolicy.FCFS or now - request.arrival_time >= self.max_reorder_wait_s

    def __call__(self, waiting: list[Request], now: float) -> list[Request]:
        # sorting by prefix match is not free: above max_queue waiting requests fall back to FCFS
        if self.policy is SchedulingPolicy.FCFS or len(waiting) > self.max_queue or not self.kv.enable_caching:
            return list(waiting)
        # a request that has waited max_reorder_wait_s is never passed again (aging bounds the delay)
        overdue, rest = [], []
        for r in waiting:
            (overdue if self.is_overdue(r, now) else rest).append(r)
        # the KV cache manager remembers each request's hit between steps: this is one dict lookup each
        cached = {r.request_id: self.kv.num_cached_blocks(r) for r in rest}
        sharers = Counter(r.block_hashes[0] for r in rest if r.block_hashes)

        def key(r: Request):
            shared = sharers[r.block_hashes[0]] - 1 if r.block_hashes else 0
            return (-cached[r.request_id], -shared, r.arrival_time)

        return overdue + sorted(rest, key=key)
