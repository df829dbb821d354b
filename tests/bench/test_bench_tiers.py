"""bench tiers on a tiny model and tiny sizes: the workloads do what they claim (behaviour, not times)."""
from __future__ import annotations

import pytest

from bench import tiers
from tests.support.bench_command import run_quick

TINY = tiers.Scale(hot_tokens=96, long_tokens=96, question_tokens=8, scan_rounds=2, burst=3, scan_pool_blocks=20,
                   disk_prefixes=4, disk_rounds=2, disk_pool_blocks=14, restart_trials=1,
                   policy_workloads=("bursty",), policy_pools=(16, 64))


@pytest.fixture(scope="module")
def command_run(tiny_llama_dir, tmp_path_factory):
    """`python -m bench tiers --quick` at the tiny scale, run once: the results it wrote and what it printed."""
    return run_quick(tiers, "tiers", TINY, tiny_llama_dir, tmp_path_factory.mktemp("tiers"))


def test_tiers_workloads_on_a_tiny_model(command_run):
    r, _ = command_run
    scan = r["scan"]
    assert scan["slru"]["hot_requests"] == scan["lru"]["hot_requests"] == 2  # one per round, then a burst
    assert scan["slru"]["hot_hit_rate"] == 1.0  # the hot prefix is never flushed by the bursts
    # 6 hot blocks: the first request follows the cold one; a burst flushes all but 2 before the second
    assert scan["lru"]["hot_hit_rate"] == (6 + 2) / 12
    assert scan["slru"]["prefill_computed"] < scan["lru"]["prefill_computed"]
    disk = r["disk"]
    # 4 prefixes of 6 blocks cycle through a 14-block pool: RAM alone hits nothing, the disk tier all repeats
    assert disk["ram only"]["repeat_cached_tokens"] == 0 and disk["ram only"]["disk_hit_tokens"] == 0
    assert disk["ram + disk"]["disk_hit_tokens"] == disk["ram + disk"]["repeat_cached_tokens"] == 4 * 96
    assert disk["ram + disk"]["prefill_computed"] == disk["oracle_prefill"]
    assert set(r["targets"]) and "restart_vs_warm" in r["restart"]
    assert set(r["policies"]) == {"bursty/37", "bursty/64"}  # 16 blocks cannot hold its longest prompt (36)
    assert r["policies"]["bursty/64"]["lru"] > 0
    assert "slru" in tiers.render(r)


def test_bench_tiers_command_writes_results(command_run):
    results, printed = command_run
    assert set(results) == {"policies", "scan", "disk", "restart", "targets"}
    assert "first after restart" in printed
