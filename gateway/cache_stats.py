"""`GET /v1/cache/stats`: the prefix cache as the caller sees it, for the chat page's live panel and for
applications: the caller's own prompt tokens, cached tokens, hit rate and evicted blocks (per tenant when
API keys are on; the anonymous tenant's without keys), and the pool's occupancy (blocks used, cached, free;
the free ones split into cached and empty) and disk tier. Behind the same auth as the API."""
from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from engine.stats import SchedulerStats, StepStats


@dataclass(slots=True)
class _TenantCache:
    prompt_tokens: int = 0  # looked up in the cache
    cached_tokens: int = 0  # found there
    evicted_blocks: int = 0  # of this tenant's blocks


class CacheStats:
    """Sums the engine's per-step tenant counters since start-up (a stats listener)."""

    def __init__(self) -> None:
        self._tenants: dict[str, _TenantCache] = {}
        self._scheduler = SchedulerStats()

    def on_step(self, stats: StepStats) -> None:
        self._scheduler = stats.scheduler
        for tenant, (queries, hits) in stats.tenant_cache.items():
            entry = self._tenants.setdefault(tenant, _TenantCache())
            entry.prompt_tokens += queries
            entry.cached_tokens += hits
        for tenant, blocks in stats.tenant_evictions.items():
            self._tenants.setdefault(tenant, _TenantCache()).evicted_blocks += blocks

    def body(self, tenant: str) -> dict:
        own = self._tenants.get(tenant, _TenantCache())
        pool = self._scheduler
        disk = pool.prefix_cache.disk
        free_cached = pool.prefix_cache.free_cached_blocks
        return {
            "object": "cache.stats", "tenant": tenant,
            "prompt_tokens": own.prompt_tokens, "cached_tokens": own.cached_tokens,
            "hit_rate": own.cached_tokens / own.prompt_tokens if own.prompt_tokens else 0.0,
            "evicted_blocks": own.evicted_blocks,
            "kv_blocks": {"total": pool.num_blocks, "used": pool.num_blocks - pool.num_free_blocks,
                          "cached": pool.prefix_cache.cached_blocks, "free": pool.num_free_blocks,
                          # the free ones split: cached (hittable until handed out) and empty (handed out first)
                          "free_cached": free_cached, "free_empty": pool.num_free_blocks - free_cached},
            "disk": None if disk is None else {"blocks": disk.files, "bytes": disk.bytes},
        }


CACHE_STATS = web.AppKey("cache_stats", CacheStats)
