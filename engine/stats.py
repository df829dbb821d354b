"""Plain stats the engine hands out; metrics/ turns them into Prometheus series."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class DiskTierStats:
    files: int = 0
    bytes: int = 0
    writes: int = 0  # blocks written
    dropped_spills: int = 0  # spills refused: the writer was too far behind
    evictions: int = 0  # files dropped by the tier's LRU
    corrupt: int = 0  # files that failed a check (deleted, never served)
    write_errors: dict[str, int] = field(default_factory=dict)  # failed block writes by reason (no_space, ...)


@dataclass(slots=True)
class PrefixCacheStats:
    """Cumulative counters of the prefix cache since start-up."""

    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens found cached
    requests: int = 0  # lookups (one per admitted request)
    evictions_capacity: int = 0  # cached blocks dropped to make room
    evictions_preemption: int = 0  # computed blocks (no hash, no other holder) dropped by preemption
    cached_blocks: int = 0  # blocks currently holding a registered hash
    usage: float = 0.0  # fraction of blocks referenced by running requests
    evictions_spill: int = 0  # cached blocks dropped from RAM with their KV written to the disk tier
    evictions_reset: int = 0  # cached blocks forgotten by a cache reset
    regrets: int = 0  # evicted blocks asked for again while their hash was in the ghost list
    disk_hits: int = 0  # prompt tokens loaded from the disk tier (part of `hits`)
    evictions_erase: int = 0  # cached blocks forgotten by DELETE /v1/cache
    pins: int = 0  # pinned prefixes now (cache_control breakpoints)
    pinned_blocks: int = 0  # distinct blocks they hold
    max_pinned_blocks: int = 0  # what pins may hold at most (max_pinned_fraction of the pool)
    pins_released: dict[str, int] = field(default_factory=dict)  # cumulative, by reason: expired, pressure, erased
    tenant_pinned_blocks: dict[str, int] = field(default_factory=dict)  # tenant -> blocks its pins hold now
    disk: DiskTierStats | None = None  # None: no disk tier

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass(slots=True)
class SchedulerStats:
    """A snapshot taken after each engine step."""

    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0  # cumulative
    num_steps: int = 0  # cumulative
    num_blocks: int = 0
    num_free_blocks: int = 0  # in the free queue: empty, or cached and hittable
    prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)


@dataclass(slots=True)
class FinishedRequestStats:
    """Timings and counts of one finished request, in seconds since arrival (metrics observe TTFT,
    prefill time and inter-token latency from StepStats, when they happen)."""

    request_id: str
    tenant: str | None
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    queue_time: float  # arrival -> first scheduled
    prefill_time: float  # first scheduled -> first token
    ttft: float  # arrival -> first token
    e2e_latency: float  # arrival -> finished
    inter_token_latencies: list[float] = field(default_factory=list)
    num_disk_cached_tokens: int = 0  # the part of num_cached_tokens read back from the disk tier
    num_cache_write_tokens: int = 0  # prompt tokens computed and written to the cache


@dataclass(slots=True)
class StepStats:
    """What one engine step did, for per-step metrics."""

    scheduler: SchedulerStats
    num_prompt_tokens: int = 0  # prefill tokens computed this step
    num_generation_tokens: int = 0
    finished: list[FinishedRequestStats] = field(default_factory=list)
    tenant_cache: dict[str, tuple[int, int]] = field(default_factory=dict)  # tenant -> (queries, hits) tokens this step
    tenant_evictions: dict[str, int] = field(default_factory=dict)  # tenant whose block was evicted -> blocks this step
    # latencies of the tokens this step produced, in seconds: observed now, not when their request finishes
    ttfts: list[float] = field(default_factory=list)  # arrival -> first token, one per first token
    prefill_times: list[float] = field(default_factory=list)  # first scheduled -> first token
    inter_token_latencies: list[float] = field(default_factory=list)  # one per later token
    kv_events: list[tuple[str, bytes]] = field(default_factory=list)  # ("stored"|"removed", block hash), if enabled
    tenant_regrets: dict[str, int] = field(default_factory=dict)  # tenant whose evicted block was asked again -> blocks
    tenant_pin_expiries: dict[str, int] = field(default_factory=dict)  # tenant -> its pins that expired
    tenant_pin_refusals: dict[tuple[str, str], int] = field(default_factory=dict)  # (tenant, quota) -> refused pins
