"""bench pins on a tiny model and tiny sizes: the workloads do what they claim (behaviour, not times)."""
from __future__ import annotations

import pytest

from bench import pins
from tests.support.bench_command import run_quick

pytestmark = pytest.mark.slow  # a benchmark run: three chatbot workloads and 100,000 bookkeeping rounds timed

TINY = pins.Scale(hot_tokens=96, doc_tokens=96, question_tokens=8, rounds=2, burst=3, pool_blocks=20, cost_repeats=1)


@pytest.fixture(scope="module")
def command_run(tiny_llama_dir, tmp_path_factory):
    """`python -m bench pins --quick` at the tiny scale, run once: the results it wrote and what it printed."""
    return run_quick(pins, "pins", TINY, tiny_llama_dir, tmp_path_factory.mktemp("pins"))


def test_pins_workloads_on_a_tiny_model(command_run):
    r, _ = command_run
    survive = r["survive"]
    assert set(survive) == {"slru, not pinned", "slru, pinned", "lru, not pinned", "lru, pinned"}
    for policy in ("slru", "lru"):
        pinned, unpinned = survive[f"{policy}, pinned"], survive[f"{policy}, not pinned"]
        assert pinned["hot_hit_rate"] == 1.0 and pinned["pinned_blocks"] == 6  # 96 tokens: 6 full blocks
        assert unpinned["hot_hit_rate"] < 1.0 and unpinned["pinned_blocks"] == 0
        assert pinned["prefill_computed"] < unpinned["prefill_computed"]
    cost = r["cost"]
    assert cost["hit_rate_ratio"] == 1.0  # no pins: the same hits with and without the hooks
    assert 0 < cost["bookkeeping_per_step_s"] < cost["mean_step_s"]
    assert "pin bookkeeping per step" in pins.render(r)


def test_bench_pins_command_writes_results(command_run):
    results, printed = command_run
    assert set(results) == {"survive", "cost", "targets"}
    assert "hot hit rate" in printed
