"""Plain stats the engine hands out; metrics/ turns them into Prometheus series.

Every stats class merges itself (`merge`, `merged`): the stats of several steps of one engine (a replica's
report between two outputs), or the snapshots of several engines taken together (a cluster's). How each
field combines is its rule, named where the field is declared:

- `count`: how many since start-up, or in a step: numbers add, dicts add per key, lists concatenate. An
  engine that is gone keeps counting (a Prometheus counter never goes down).
- `level`: how many now (free blocks, running requests): adds over the engines that are up; a gone one's is 0.
- `mean`: a fraction now (pool usage): the mean over the engines that are up (a deployment's pools are equal).
- `latest`: a snapshot (a step's scheduler stats): the last one given replaces the others.
- `nested`: stats of their own, merged field by field by the same rules (None: not there, as without a disk tier).
"""
from __future__ import annotations

from dataclasses import MISSING, Field, dataclass, field, fields
from enum import Enum
from functools import reduce
from typing import Any, Iterable, Self


class Merge(Enum):
    COUNT = "count"
    LEVEL = "level"
    MEAN = "mean"
    LATEST = "latest"
    NESTED = "nested"


def _rule(rule: Merge, default: Any = MISSING, factory: Any = MISSING) -> Any:
    return field(default=default, default_factory=factory, metadata={"merge": rule})


def count(factory: type | None = None) -> Any:
    return _rule(Merge.COUNT, factory=factory) if factory else _rule(Merge.COUNT, 0)


def level(factory: type | None = None) -> Any:
    return _rule(Merge.LEVEL, factory=factory) if factory else _rule(Merge.LEVEL, 0)


def mean() -> Any:
    return _rule(Merge.MEAN, 0.0)


def latest(default: Any = MISSING) -> Any:
    return _rule(Merge.LATEST, default)


def nested(factory: type | None = None) -> Any:
    return _rule(Merge.NESTED, factory=factory) if factory else _rule(Merge.NESTED, None)


class Mergeable:
    """A stats dataclass whose fields each name their merge rule."""

    __slots__ = ()

    def merge(self, *others: Self) -> Self:
        """These stats and `others` taken together (in order: the last one's snapshots win)."""
        return type(self).merged((self, *others))

    @classmethod
    def merged(cls, up: Iterable[Self], gone: Iterable[Self] = ()) -> Self:
        """The stats of the engines `up` taken together, and the counts of those `gone` (replicas that died:
        their counters still count, their levels no longer do)."""
        up, gone = list(up), list(gone)
        return cls(**{f.name: _merge_field(f, [getattr(s, f.name) for s in up], [getattr(s, f.name) for s in gone])
                      for f in fields(cls)})


def _merge_field(f: Field, up: list, gone: list) -> Any:
    rule = f.metadata["merge"]
    if rule is Merge.COUNT:
        return reduce(_add, up + gone, _empty(f))
    if rule is Merge.LEVEL:
        return reduce(_add, up, _empty(f))
    if rule is Merge.MEAN:
        return sum(up) / len(up) if up else f.default
    if rule is Merge.LATEST:
        return (up + gone)[-1]
    up, gone = [s for s in up if s is not None], [s for s in gone if s is not None]
    return type((up + gone)[0]).merged(up, gone) if up or gone else _empty(f)


def _empty(f: Field) -> Any:
    return f.default_factory() if f.default_factory is not MISSING else f.default


def _add(total: Any, value: Any) -> Any:
    """`total` and `value` added; never changes either (they may be an engine's own)."""
    if isinstance(total, dict):
        added = dict(total)
        for key, num in value.items():
            added[key] = _add(added[key], num) if key in added else num
        return added
    if isinstance(total, tuple):
        return tuple(map(_add, total, value))
    return total + value  # numbers add, lists concatenate


@dataclass(slots=True)
class DiskTierStats(Mergeable):
    files: int = level()
    bytes: int = level()
    writes: int = count()  # blocks written
    dropped_spills: int = count()  # spills refused: the writer was too far behind
    evictions: int = count()  # files dropped by the tier's LRU
    corrupt: int = count()  # files that failed a check (deleted, never served)
    write_errors: dict[str, int] = count(dict)  # failed block writes by reason (no_space, ...)


@dataclass(slots=True)
class PrefixCacheStats(Mergeable):
    """Cumulative counters of the prefix cache since start-up, and its levels now."""

    queries: int = count()  # prompt tokens looked up
    hits: int = count()  # prompt tokens found cached
    requests: int = count()  # lookups (one per admitted request)
    evictions_capacity: int = count()  # cached blocks dropped to make room
    evictions_preemption: int = count()  # computed blocks (no hash, no other holder) dropped by preemption
    cached_blocks: int = level()  # blocks currently holding a registered hash
    free_cached_blocks: int = level()  # of those, the ones no request holds (in the free queue, hittable)
    usage: float = mean()  # fraction of blocks referenced by running requests
    evictions_spill: int = count()  # cached blocks dropped from RAM with their KV written to the disk tier
    regrets: int = count()  # evicted blocks asked for again while their hash was in the ghost list
    disk_hits: int = count()  # prompt tokens loaded from the disk tier (part of `hits`)
    evictions_erase: int = count()  # cached blocks forgotten by DELETE /v1/cache
    pins: int = level()  # pinned prefixes now (cache_control breakpoints)
    pinned_blocks: int = level()  # distinct blocks they hold
    max_pinned_blocks: int = level()  # what pins may hold at most (max_pinned_fraction of the pool)
    pins_released: dict[str, int] = count(dict)  # by reason: expired, pressure, erased
    tenant_pinned_blocks: dict[str, int] = level(dict)  # tenant -> blocks its pins hold now
    disk: DiskTierStats | None = nested()  # None: no disk tier

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass(slots=True)
class SchedulerStats(Mergeable):
    """A snapshot taken after each engine step."""

    num_running: int = level()
    num_waiting: int = level()
    num_preemptions: int = count()
    num_steps: int = count()
    num_blocks: int = level()
    num_free_blocks: int = level()  # in the free queue: empty, or cached and hittable
    prefix_cache: PrefixCacheStats = nested(PrefixCacheStats)


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
    ttft: float  # arrival -> first token
    e2e_latency: float  # arrival -> finished
    inter_token_latencies: list[float] = field(default_factory=list)
    num_disk_cached_tokens: int = 0  # the part of num_cached_tokens read back from the disk tier
    num_cache_write_tokens: int = 0  # prompt tokens computed and written to the cache


@dataclass(slots=True)
class StepStats(Mergeable):
    """What one engine step did, for per-step metrics (merged: what several steps did)."""

    scheduler: SchedulerStats = latest()
    num_prompt_tokens: int = count()  # prefill tokens computed this step
    num_generation_tokens: int = count()
    finished: list[FinishedRequestStats] = count(list)
    tenant_cache: dict[str, tuple[int, int]] = count(dict)  # tenant -> (queries, hits) tokens this step
    tenant_evictions: dict[str, int] = count(dict)  # tenant whose block was evicted -> blocks this step
    # latencies of the tokens this step produced, in seconds: observed now, not when their request finishes
    ttfts: list[float] = count(list)  # arrival -> first token, one per first token
    prefill_times: list[float] = count(list)  # first scheduled -> first token
    inter_token_latencies: list[float] = count(list)  # one per later token
    kv_events: list[tuple[str, bytes]] = count(list)  # ("stored"|"removed", block hash), if enabled
    tenant_regrets: dict[str, int] = count(dict)  # tenant whose evicted block was asked again -> blocks
    tenant_pin_expiries: dict[str, int] = count(dict)  # tenant -> its pins that expired
    tenant_pin_refusals: dict[tuple[str, str], int] = count(dict)  # (tenant, quota) -> refused pins
    threads: tuple[int, int] | None = latest(None)  # CPU compute threads (decode, prefill); a live re-check moves them
