"""bench router-sim on a tiny recorded trace: the simulated replicas drive engine/kv's real BlockPool, the event
log feeds the real PrefixIndex exactly, and the routing results hold (behaviour, not times)."""
from __future__ import annotations

import json

import pytest

from bench import router_sim
from bench.__main__ import main as bench_main
from bench.router_sim import (ChatHashes, Policy, ReplicaShape, RunConfig, Simulation, TraceRequest, TraceShape,
                              read_trace, record_trace, workload, write_trace)

TINY_REPLICA = ReplicaShape(num_blocks=256, max_num_seqs=4)
# 4 replicas' worth: few tenants, so prompts are shared; chats short enough that a 256-block pool holds several
TINY = TraceShape(replicas=4, requests=400, tenants=12, prompt_tokens=100, public_prompts=3,
                  public_prompt_tokens=(200, 400), user_tokens=20, answer_tokens=40, think_s=5.0, max_context=1024)


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("traces") / "tiny.json.gz"
    write_trace(record_trace(TINY, TINY_REPLICA, seed=3), path)
    return read_trace(path)


@pytest.fixture(scope="module")
def requests(trace):
    return workload(trace, 4, TINY.requests, ChatHashes(trace))


def run(requests, replicas=4, **config) -> Simulation:
    sim = Simulation(requests, RunConfig(replicas=replicas, **config), TINY_REPLICA)
    sim.summary = sim.run()
    return sim


def chat(name: str, num_blocks: int) -> list[bytes]:
    return [f"{name}{i}".encode() for i in range(num_blocks)]


def logged_events(sim: Simulation) -> list[tuple[str, bytes]]:
    return [event for _, events in sim.log.since(0) for event in events]


def test_a_replica_keeps_running_blocks_frees_tail_first_and_evicts_least_recently_freed():
    a, b = chat("a", 4), chat("b", 4)
    c = a[:2] + chat("c", 2)  # shares a's first two blocks
    # each 48 prompt + 16 output tokens: 4 blocks of a 6-block pool, the 3 prompt blocks cached
    requests = [TraceRequest(0.0, a, 48, 16), TraceRequest(0.001, b, 48, 16), TraceRequest(10.0, c, 48, 16)]
    shape = ReplicaShape(num_blocks=6, max_num_seqs=4)
    sim = Simulation(requests, RunConfig(Policy.PREFIX, 1, lag_s=0.0), shape)
    sim.run()
    # b waits for a's blocks: then a's prompt is freed tail first, so a2 goes and a0, a1 stay for c to hit
    # c's 2 new blocks: the free queue's blockless block, then the least recently freed cached one, b2
    assert logged_events(sim) == [("stored", a[0]), ("stored", a[1]), ("stored", a[2]), ("removed", a[2]),
                                  ("stored", b[0]), ("stored", b[1]), ("stored", b[2]), ("removed", b[2]),
                                  ("stored", c[2])]
    prefill_s, a_done_s = 48 * shape.prefill_s_per_token, 48 * shape.prefill_s_per_token + 16 * shape.decode_step_s
    assert sim.ttfts == pytest.approx([prefill_s, a_done_s - 0.001 + prefill_s, 16 * shape.prefill_s_per_token])
    assert sim.cached_tokens == 32
    pool = sim.replicas[0].pool
    assert set(pool.cached) == {a[0], a[1], b[0], b[1], c[2]} and pool.num_free_blocks == 6


def test_a_block_computed_twice_is_stored_once():
    same = chat("s", 30)
    # the second waits for the first's prompt and hits it, then both compute the same two answer blocks
    requests = [TraceRequest(t, same, 320, 40) for t in (0.0, 0.001)]
    sim = Simulation(requests, RunConfig(Policy.PREFIX, 1, lag_s=0.0), TINY_REPLICA)
    sim.run()
    assert logged_events(sim) == [("stored", h) for h in same[:22]]
    assert set(sim.replicas[0].pool.cached) == set(same[:22])


def test_a_request_waits_for_the_prefill_computing_its_prefix_and_hits_it():
    same_prompt = [TraceRequest(t, chat("p", 30), 320, 10) for t in (0.0, 0.001)]
    sim = run(same_prompt, policy=Policy.ROUND_ROBIN, replicas=1)
    assert sim.cached_tokens == (320 - 1) // 16 * 16  # all but the last block, as the engine caps a hit
    prefill_s = TINY_REPLICA.prefill_s_per_token
    assert sim.ttfts == pytest.approx([320 * prefill_s, 320 * prefill_s - 0.001 + 16 * prefill_s])


@pytest.mark.parametrize("lag_s", [0.0, 0.05, 0.5])
def test_the_log_gives_every_gateway_exactly_each_replica_cache(requests, lag_s):
    sim = run(requests, policy=Policy.PREFIX, gateways=2, lag_s=lag_s)
    assert sim.summary["evictions"] > 0  # the pools were full: "removed" events count too
    for gateway in sim.gateways:
        for replica in sim.replicas:
            assert gateway.index.held(replica.name) == set(replica.pool.cached)
    assert sim.log.events == sum(g.applied for g in sim.gateways) / 2


class DirectEvents(Simulation):
    """Each replica's events applied straight to the gateway's index, no log."""

    def _publish(self, replica, events):
        for gateway in self.gateways:
            gateway.index.apply_events(replica.name, events)


def test_lag_0_routes_as_applying_events_directly(requests):
    logged = run(requests, policy=Policy.PREFIX, lag_s=0.0)
    direct = DirectEvents(requests, RunConfig(Policy.PREFIX, 4, lag_s=0.0), TINY_REPLICA)
    direct.run()
    assert logged.routes == direct.routes
    assert len(set(logged.routes)) == 4


def test_prefix_routing_hits_more_than_round_robin_and_less_than_one_pool(requests):
    prefix = run(requests, policy=Policy.PREFIX, gateways=2).summary
    round_robin = run(requests, policy=Policy.ROUND_ROBIN).summary
    pool = run(requests, policy=Policy.ONE_POOL).summary
    assert round_robin["hit_rate"] < prefix["hit_rate"] <= pool["hit_rate"] <= router_sim.oracle_hit_rate(requests)
    assert prefix["requests"] == round_robin["requests"] == len(requests)
    assert sum(prefix["decisions"].values()) == len(requests)
    assert 1.0 <= prefix["max_over_mean_requests"] and 1.0 <= prefix["max_over_mean_busy"]


def test_same_seed_same_run_and_trace(trace, requests):
    first, again = run(requests, policy=Policy.PREFIX, gateways=2, seed=1), run(requests, policy=Policy.PREFIX,
                                                                                gateways=2, seed=1)
    assert first.routes == again.routes
    timings = {"wall_s", "route_us_p50", "route_us_p99", "route_cpu_us_p50", "route_cpu_us_p99", "apply_us_per_event"}
    assert {k: v for k, v in first.summary.items() if k not in timings} == \
        {k: v for k, v in again.summary.items() if k not in timings}
    assert run(requests, policy=Policy.PREFIX, gateways=2, seed=2).routes != first.routes  # another gateway split
    assert json.loads(json.dumps(record_trace(TINY, TINY_REPLICA, seed=3))) == trace


def test_fewer_replicas_replay_their_share_of_the_chats(trace):
    hashes = ChatHashes(trace)
    half = workload(trace, 2, TINY.requests, hashes)
    assert len(half) == TINY.requests // 2
    kept = {id(hashes(i)) for i in range(len(trace["chats"])) if i % 4 < 2}  # chats 0, 1, 4, 5, ...
    assert {id(r.chat_hashes) for r in half} <= kept
    with pytest.raises(ValueError):
        workload(trace, 5, TINY.requests, hashes)


def test_router_sim_command_writes_the_table_and_json(trace, tmp_path, capsys):
    path = tmp_path / "tiny.json.gz"
    write_trace(trace, path)
    out = tmp_path / "sim.json"
    assert bench_main(["router-sim", "--replicas", "2,4", "--gateways", "1,2", "--lag-ms", "0,50", "--requests",
                       "200", "--trace", str(path), "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert set(results) == {"trace", "replica", "block_size", "hash_algo", "runs", "environment"}
    runs = results["runs"]
    assert [(r["replicas"], r["run"]) for r in runs[:6]] == [
        (2, "one_pool"), (2, "round_robin"), (2, "prefix G=1 lag=0ms"), (2, "prefix G=1 lag=50ms"),
        (2, "prefix G=2 lag=0ms"), (2, "prefix G=2 lag=50ms")]
    assert len(runs) == 12 and {r["requests"] for r in runs} == {100, 200}
    prefix = runs[5]
    for key in ("hit_rate", "hit_rate_vs_pool", "oracle_hit_rate", "route_us_p50", "route_us_p99",
                "index_mb_per_gateway", "events_per_s", "log_in_kb_per_s", "log_out_kb_per_s",
                "max_over_mean_requests", "max_over_mean_busy"):
        assert prefix[key] > 0, key
    # each of the 2 gateways pulls every event, each tagged with its replica
    assert 2 * prefix["log_in_kb_per_s"] < prefix["log_out_kb_per_s"] < 3 * prefix["log_in_kb_per_s"]
    assert "prefix G=2 lag=50ms" in capsys.readouterr().out

