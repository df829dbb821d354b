"""A replica's stats report: its engine's StepStats merged as they are (the fast lane: no Ray imported). That they
reach the gateway whole, in /metrics and /v1/cache/stats, is tested on a local Ray Serve in test_cluster.py,
where the run's one Ray instance starts."""
from __future__ import annotations

from cluster.report_buffer import ReportBuffer, later_snapshot
from engine.stats import PrefixCacheStats, SchedulerStats, StepStats
from metrics import Metrics

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


def test_a_report_older_than_the_one_held_leaves_the_counters_where_they_are():
    """Reports travel on separate request streams: one taken at step 11 may reach the gateway after one taken at
    step 12. The held snapshot stays the later, so the cache's hit counter reads 1,200, not 1,200 plus 1,100 (a
    drop read as an engine restart)."""
    metrics, held = Metrics("m", tenants=[]), None
    for steps, hits in ((10, 1000), (12, 1200), (11, 1100)):
        held = later_snapshot(held, SchedulerStats(num_steps=steps, prefix_cache=PrefixCacheStats(hits=hits)))
        metrics.on_step(StepStats(held))
    assert held.num_steps == 12
    exposed = metrics.render()[0].decode()
    assert 'prefixgate_prefix_cache_hits_tokens_total{model_name="m"} 1200.0' in exposed
    assert later_snapshot(held, SchedulerStats(num_steps=12)).prefix_cache.hits == 0  # (as new as it: the report's)
