"""A replica's stats report: its engine's StepStats merged as they are (the fast lane: no Ray imported). That they
reach the gateway whole, in /metrics and /v1/cache/stats, is tested on a local Ray Serve in test_cluster.py,
where the run's one Ray instance starts."""
from __future__ import annotations

from cluster.report_buffer import ReportBuffer
from engine.stats import PrefixCacheStats, SchedulerStats, StepStats

BLOCKS = 9


def test_a_replica_report_is_its_engine_steps_merged_without_kv_events():
    reports = ReportBuffer(SchedulerStats(num_blocks=BLOCKS, num_free_blocks=BLOCKS))
    latest = SchedulerStats(num_blocks=BLOCKS, num_free_blocks=7, prefix_cache=PrefixCacheStats(regrets=2))
    reports.on_step(StepStats(SchedulerStats(num_free_blocks=9), num_prompt_tokens=8, ttfts=[0.1],
                              kv_events=[("stored", b"h1")], tenant_regrets={"alice": 1}))
    reports.on_step(StepStats(latest, num_generation_tokens=1, kv_events=[("removed", b"h1")],
                              tenant_regrets={"alice": 1}))

    taken = reports.take()

    assert taken == StepStats(latest, num_prompt_tokens=8, num_generation_tokens=1, ttfts=[0.1],
                              tenant_regrets={"alice": 2})
    assert reports.take_kv_events() == [("stored", b"h1"), ("removed", b"h1")]
    assert reports.take() == StepStats(latest)  # nothing since: the latest snapshot alone
