"""The stats dataclasses merge themselves, field by field by each field's declared rule: the steps of one
engine (a replica's report) and the snapshots of several engines (a cluster's)."""
from __future__ import annotations

from dataclasses import fields

import pytest

from engine.stats import (DiskTierStats, FinishedRequestStats, Merge, Mergeable, PrefixCacheStats, SchedulerStats,
                          StepStats)


@pytest.mark.parametrize("cls", [DiskTierStats, PrefixCacheStats, SchedulerStats, StepStats])
def test_every_field_names_its_merge_rule(cls):
    assert issubclass(cls, Mergeable)
    assert all(isinstance(f.metadata.get("merge"), Merge) for f in fields(cls))


def replica(running: int, free: int, queries: int, regrets: int, usage: float, *, disk: DiskTierStats | None = None,
            pinned: dict[str, int] | None = None, released: dict[str, int] | None = None) -> SchedulerStats:
    cache = PrefixCacheStats(queries=queries, hits=queries // 2, regrets=regrets, disk_hits=regrets * 4,
                             cached_blocks=free - 1, usage=usage, pins=len(pinned or {}),
                             tenant_pinned_blocks=pinned or {}, pins_released=released or {}, disk=disk)
    return SchedulerStats(num_running=running, num_waiting=1, num_preemptions=2, num_steps=10, num_blocks=48,
                          num_free_blocks=free, prefix_cache=cache)


def test_replicas_merge_counters_over_all_and_levels_over_those_up():
    a = replica(2, 40, 100, 3, 0.25, disk=DiskTierStats(files=5, bytes=500, writes=7, write_errors={"io": 1}),
                pinned={"alice": 2}, released={"expired": 1})
    b = replica(1, 30, 50, 1, 0.75, pinned={"alice": 1, "bob": 4})
    gone = replica(3, 20, 1000, 9, 1.0, disk=DiskTierStats(files=9, writes=2, write_errors={"io": 2, "no_space": 1}),
                   released={"expired": 2, "erased": 1})

    merged = SchedulerStats.merged([a, b], gone=[gone])

    assert (merged.num_running, merged.num_waiting, merged.num_blocks, merged.num_free_blocks) == (3, 2, 96, 70)
    assert (merged.num_preemptions, merged.num_steps) == (6, 30)  # the gone replica's counts still count
    cache = merged.prefix_cache
    assert (cache.queries, cache.hits, cache.regrets, cache.disk_hits) == (1150, 575, 13, 52)
    assert (cache.cached_blocks, cache.usage, cache.pins) == (68, 0.5, 3)
    assert cache.tenant_pinned_blocks == {"alice": 3, "bob": 4}
    assert cache.pins_released == {"expired": 3, "erased": 1}
    assert cache.disk == DiskTierStats(files=5, bytes=500, writes=9, write_errors={"io": 3, "no_space": 1})


def test_merging_leaves_its_parts_unchanged():
    a = replica(1, 10, 10, 1, 0.5, pinned={"alice": 1}, disk=DiskTierStats(write_errors={"io": 1}))
    b = replica(1, 10, 10, 1, 0.5, pinned={"alice": 2}, disk=DiskTierStats(write_errors={"io": 1}))
    a.merge(b)
    assert a.prefix_cache.tenant_pinned_blocks == {"alice": 1} and a.prefix_cache.disk.write_errors == {"io": 1}
    assert b.prefix_cache.tenant_pinned_blocks == {"alice": 2}


def test_no_engine_up_merges_to_empty_stats_and_no_disk_tier_stays_none():
    assert SchedulerStats.merged([]) == SchedulerStats()
    assert SchedulerStats.merged([replica(1, 2, 3, 0, 0.5)]).prefix_cache.disk is None
    only_gone = SchedulerStats.merged([], gone=[replica(1, 2, 3, 1, 0.5, disk=DiskTierStats(files=4, writes=5))])
    assert (only_gone.num_running, only_gone.num_free_blocks, only_gone.prefix_cache.usage) == (0, 0, 0.0)
    assert only_gone.prefix_cache.disk == DiskTierStats(files=0, writes=5)


def finished(request_id: str) -> FinishedRequestStats:
    return FinishedRequestStats(request_id, "alice", "stop", 8, 4, 2, 0.1, 0.3, 0.4)


def test_steps_merge_counts_and_events_and_keep_the_latest_snapshot():
    first = StepStats(replica(1, 40, 10, 0, 0.25), num_prompt_tokens=8, num_generation_tokens=1,
                      finished=[finished("a")], tenant_cache={"alice": (8, 4)}, tenant_evictions={"alice": 1},
                      ttfts=[0.1], inter_token_latencies=[0.01], kv_events=[("stored", b"h1")],
                      tenant_regrets={"alice": 2}, tenant_pin_refusals={("alice", "tenant_quota"): 1})
    second = StepStats(replica(2, 30, 20, 1, 0.5), num_generation_tokens=2, finished=[finished("b")],
                       tenant_cache={"alice": (4, 4), "bob": (8, 0)}, ttfts=[0.2], prefill_times=[0.05],
                       kv_events=[("removed", b"h1")], tenant_regrets={"alice": 1, "bob": 3},
                       tenant_pin_expiries={"bob": 1}, tenant_pin_refusals={("alice", "tenant_quota"): 2})

    merged = first.merge(second)

    assert merged.scheduler is second.scheduler  # a snapshot: the later one
    assert (merged.num_prompt_tokens, merged.num_generation_tokens) == (8, 3)
    assert [f.request_id for f in merged.finished] == ["a", "b"]
    assert merged.tenant_cache == {"alice": (12, 8), "bob": (8, 0)}
    assert merged.tenant_evictions == {"alice": 1}
    assert (merged.ttfts, merged.prefill_times, merged.inter_token_latencies) == ([0.1, 0.2], [0.05], [0.01])
    assert merged.kv_events == [("stored", b"h1"), ("removed", b"h1")]
    assert merged.tenant_regrets == {"alice": 3, "bob": 3}
    assert merged.tenant_pin_expiries == {"bob": 1}
    assert merged.tenant_pin_refusals == {("alice", "tenant_quota"): 3}
    assert first.ttfts == [0.1] and first.tenant_cache == {"alice": (8, 4)}  # the parts are unchanged
