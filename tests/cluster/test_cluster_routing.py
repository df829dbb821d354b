"""The prefix router's ranking and its view of the replicas, without Ray; and the engine's KV events."""
from __future__ import annotations

import asyncio
import math

from hypothesis import given
from hypothesis import strategies as st

from cluster.kv_event_log import KvEventLog
from cluster.prefix_index import PrefixIndex, RoutingReason, choose_replica
from engine.kv.block_pool import BlockPool
from engine.kv.hashing import hash_full_blocks

H = [bytes([i]) * 4 for i in range(8)]  # stand-in block hashes of one prompt, in chain order


def _held(table: dict[str, set[bytes]]):
    def matched(replica: str, hashes) -> int:
        n = 0
        for h in hashes:
            if h not in table[replica]:
                break
            n += 1
        return n
    return matched


def test_the_replica_with_the_longest_leading_match_wins():
    table = {"r0": set(H[:2]), "r1": set(H[:5]), "r2": {H[3], H[4], H[5], H[6]}}  # r2: no leading block
    decision = choose_replica(H, {"r0": 1, "r1": 1, "r2": 1}, _held(table))
    assert (decision.replica, decision.reason, decision.matched_blocks) == ("r1", RoutingReason.PREFIX_MATCH, 5)


def test_a_miss_goes_to_the_least_loaded_replica():
    table = {"r0": set(), "r1": set(), "r2": set()}
    decision = choose_replica(H, {"r0": 3, "r1": 1, "r2": 2}, _held(table))
    assert (decision.replica, decision.reason) == ("r1", RoutingReason.NO_MATCH)


def test_an_idle_miss_goes_to_the_replica_with_the_least_cache():
    table = {"r0": set(H[:6]), "r1": set(H[:2]), "r2": set(H[:4])}
    other = [bytes([100 + i]) * 4 for i in range(4)]  # a prompt nobody holds
    decision = choose_replica(other, {"r0": 0, "r1": 0, "r2": 0}, _held(table),
                              cache_sizes={r: len(held) for r, held in table.items()})
    assert (decision.replica, decision.reason) == ("r1", RoutingReason.NO_MATCH)


def test_prompts_sent_one_at_a_time_spread_over_the_replicas():
    """4 system prompts x 4 turns in sequence on 2 replicas: each new system prompt (a miss) goes to the
    replica with less cache, so both serve, and every later turn follows its prompt (was: all 16 on one)."""
    index = PrefixIndex()
    index.set_replicas(["r0", "r1"])
    served: dict[str, list[int]] = {"r0": [], "r1": []}
    prompts = [[bytes([p, i]) * 2 for i in range(3)] for p in range(4)]
    for turn in range(4):
        for p, hashes in enumerate(prompts):
            decision = index.choose(hashes[:1 + turn % 3], ["r0", "r1"])
            index.reserve(decision.replica, hashes)
            index.release(decision.replica)  # one at a time: finished before the next is sent
            served[decision.replica].append(p)
    assert sorted(set(served["r0"])) + sorted(set(served["r1"])) in ([0, 2, 1, 3], [1, 3, 0, 2])
    assert len(served["r0"]) == len(served["r1"]) == 8


def test_a_tie_goes_to_the_less_loaded_holder():
    table = {"r0": set(H[:5]), "r1": set(H[:5]), "r2": set()}
    decision = choose_replica(H, {"r0": 2, "r1": 1, "r2": 0}, _held(table))
    assert (decision.replica, decision.reason) == ("r1", RoutingReason.PREFIX_MATCH)


def test_a_match_under_half_the_prompt_goes_to_the_least_loaded_replica():
    """A new chat sharing only its system prompt starts where there is room (its later turns follow it
    there), instead of piling onto the busier replica that saw the system prompt first."""
    table = {"r0": set(H[:3]), "r1": set(), "r2": set(H[:1])}
    decision = choose_replica(H, {"r0": 2, "r1": 1, "r2": 1}, _held(table))
    assert (decision.replica, decision.reason, decision.matched_blocks) == ("r2", RoutingReason.SHORT_MATCH, 1)
    decision = choose_replica(H, {"r0": 1, "r1": 1, "r2": 1}, _held(table))  # equally loaded: the longer match
    assert (decision.replica, decision.reason, decision.matched_blocks) == ("r0", RoutingReason.SHORT_MATCH, 3)
    table["r0"] = set(H[:4])  # half the prompt's blocks is enough to follow
    decision = choose_replica(H, {"r0": 2, "r1": 1, "r2": 1}, _held(table))
    assert (decision.replica, decision.reason, decision.matched_blocks) == ("r0", RoutingReason.PREFIX_MATCH, 4)
    decision = choose_replica(H, {"r0": 2, "r1": 1, "r2": 1}, _held(table), min_match_share=0.75)
    assert (decision.replica, decision.reason) == ("r2", RoutingReason.SHORT_MATCH)  # r1 as loaded, no match


def test_the_load_bound_sends_a_busy_best_match_to_the_best_match_under_it():
    """Bounded loads: no replica is given more than ceil(1.25 x the mean load, this request counted)."""
    table = {"r0": set(H[:6]), "r1": set(H[:3]), "r2": set()}
    decision = choose_replica(H, {"r0": 2, "r1": 1, "r2": 1}, _held(table))  # bound ceil(1.25 * 5 / 3) = 3
    assert (decision.replica, decision.reason, decision.matched_blocks) == ("r0", RoutingReason.PREFIX_MATCH, 6)
    decision = choose_replica(H, {"r0": 3, "r1": 1, "r2": 1}, _held(table))  # bound 3: r0 is at it
    assert (decision.replica, decision.reason, decision.matched_blocks) == ("r1", RoutingReason.LOAD_GUARD, 3)
    decision = choose_replica(H, {"r0": 3, "r1": 1, "r2": 1}, _held(table), mean_load_factor=2.0)  # bound 4
    assert decision.replica == "r0"


def test_when_every_holder_is_at_the_bound_the_least_loaded_replica_takes_it():
    table = {"r0": set(H), "r1": set(H[:2]), "r2": set()}
    decision = choose_replica(H, {"r0": 3, "r1": 3, "r2": 0}, _held(table))  # bound ceil(1.25 * 7 / 3) = 3
    assert (decision.replica, decision.reason, decision.matched_blocks) == ("r2", RoutingReason.LOAD_GUARD, 0)


@given(st.lists(st.integers(0, 12), min_size=1, max_size=8), st.floats(1.0, 3.0))
def test_the_chosen_replica_stays_within_the_bound(loads, factor):
    """Whatever each replica holds, the one chosen runs at most ceil(factor x mean) with this request."""
    names = [f"r{i}" for i in range(len(loads))]
    table = {name: set(H[:i % 5]) for i, name in enumerate(names)}
    decision = choose_replica(H, dict(zip(names, loads)), _held(table), mean_load_factor=factor)
    assert loads[names.index(decision.replica)] + 1 <= math.ceil(factor * (sum(loads) + 1) / len(loads))


def test_index_follows_stored_and_removed_events_and_drops_dead_replicas():
    index = PrefixIndex()
    index.set_replicas(["r0", "r1"])
    index.apply_events("r0", [("stored", H[0]), ("stored", H[1]), ("stored", H[2])])
    assert index.matched_blocks("r0", H) == 3
    index.apply_events("r0", [("removed", H[1])])  # evicted: the chain breaks there
    assert index.matched_blocks("r0", H) == 1
    index.set_replicas(["r1", "r2"])  # r0 died, r2 replaced it
    assert index.held("r0") == set() and index.replicas == ["r1", "r2"]
    index.apply_events("r0", [("stored", H[0])])  # a dead replica's late events do not revive it
    assert index.replicas == ["r1", "r2"]


def test_events_of_a_replica_not_yet_live_are_kept_and_a_snapshot_replaces_a_view():
    index = PrefixIndex()
    index.set_replicas(["r0"])
    index.apply_log([("r1", "stored", H[0]), ("r0", "stored", H[0]), ("r1", "stored", H[1])])
    index.set_replicas(["r0", "r1"])  # Ray reports r1 after its first events went through the log
    assert index.matched_blocks("r1", H) == 2 and index.sizes() == {"r0": 1, "r1": 2}
    index.load_snapshot({"r0": [H[0], H[1], H[2]], "r1": [], "gone": [H[0]]})
    assert index.matched_blocks("r0", H) == 3 and index.matched_blocks("r1", H) == 0
    index.drop_replica("r1")
    index.load_snapshot({"r1": [H[0]]})  # a snapshot taken before r1 died does not revive it
    assert index.replicas == ["r0"] and index.held("r1") == set() and index.dead == {"r1"}


def test_the_kv_event_log_gives_each_follower_every_replicas_events_in_order():
    async def scenario():
        log = KvEventLog(max_events=6)
        await log.push("r0", [("stored", H[0]), ("stored", H[1])])
        end, snapshot, events = await log.pull(None)  # a new follower: a snapshot, then events from `end`
        assert (end, events) == (2, []) and {r: set(h) for r, h in snapshot.items()} == {"r0": {H[0], H[1]}}
        await log.push("r1", [("stored", H[2])])
        await log.push("r0", [("removed", H[1])])
        assert await log.pull(end) == (4, None, [("r1", "stored", H[2]), ("r0", "removed", H[1])])
        assert await log.pull(4, wait_s=0.01) == (4, None, [])  # nothing new: the pull waited and returned
        waiting = asyncio.ensure_future(log.pull(4, wait_s=30))
        await asyncio.sleep(0)
        await log.push("r1", [("stored", H[3])])  # wakes the waiting pull at once
        assert await waiting == (5, None, [("r1", "stored", H[3])])
        await log.push("r1", [("stored", H[4]), ("stored", H[5])], reset=True)  # a restarted replica's cache (4 events)
        end, snapshot, _ = await log.pull(1)  # fell out of the bounded log (6 events): a snapshot instead
        assert end == 9 and {r: set(h) for r, h in snapshot.items()} == {"r0": {H[0]}, "r1": {H[4], H[5]}}
        assert (await log.pull(99))[1] is not None  # a cursor past the end (a log started anew): a snapshot
        await log.forget(["r0"])
        assert set((await log.pull(None))[1]) == {"r1"}

    asyncio.run(scenario())


def test_a_prefix_just_sent_counts_as_held_until_it_expires_or_events_say_otherwise():
    now = [0.0]
    index = PrefixIndex(recent_ttl_s=5.0, clock=lambda: now[0])
    index.set_replicas(["r0", "r1"])
    index.reserve("r1", H[:4])
    assert index.choose(H, ["r0", "r1"]).replica == "r1"  # a burst of one prompt stays together
    assert index.in_flight == {"r0": 0, "r1": 1}
    index.apply_events("r1", [("removed", H[2])])  # the replica's own word wins over the memory
    assert index.matched_blocks("r1", H) == 2
    now[0] = 6.0
    assert index.matched_blocks("r1", H) == 0
    index.release("r1")
    assert index.in_flight == {"r0": 0, "r1": 0}


def test_block_pool_records_stored_and_removed_hashes_when_asked():
    pool = BlockPool(2)
    assert pool.take_kv_events() == []  # off by default
    pool.kv_events = []
    hashes = hash_full_blocks(list(range(8)), 4)
    blocks = pool.allocate(2)
    for block, h, i in zip(blocks, hashes, (0, 4)):
        pool.cache_block(block, h, tuple(range(i, i + 4)))
    pool.free(blocks[::-1])
    assert pool.take_kv_events() == [("stored", hashes[0]), ("stored", hashes[1])]
    pool.allocate(1)  # lazy eviction: the LRU block's hash goes only now
    assert pool.take_kv_events() == [("removed", hashes[1])]
    pool.erase(None)  # DELETE /v1/cache of requests without a tenant
    assert pool.take_kv_events() == [("removed", hashes[0])]


def test_the_cluster_collector_exposes_per_replica_series_with_a_replica_label():
    from prometheus_client import CollectorRegistry, generate_latest

    from cluster.metrics import SERIES, ClusterCollector
    from engine.stats import PrefixCacheStats, SchedulerStats

    class FakeClient:
        model_name, num_retries = "m", 1

        def replica_snapshots(self):
            return {"r0": SchedulerStats(num_running=2, prefix_cache=PrefixCacheStats(queries=100, hits=60)),
                    "r1": SchedulerStats(prefix_cache=PrefixCacheStats(queries=10, hits=0))}

        def routing_decisions(self):
            return {reason.value: 3 for reason in RoutingReason}

        def index_blocks(self):
            return {"r0": 7, "r1": 0}

        def replicas_up(self):
            return 2

    registry = CollectorRegistry()
    registry.register(ClusterCollector(FakeClient()))
    text = generate_latest(registry).decode()
    assert 'prefixgate_replica_prefix_cache_hits_tokens_total{model_name="m",replica="r0"} 60.0' in text
    assert 'prefixgate_replica_requests_running{model_name="m",replica="r0"} 2.0' in text
    assert 'prefixgate_router_decisions_total{model_name="m",reason="load_guard"} 3.0' in text
    assert 'prefixgate_router_index_blocks{model_name="m",replica="r0"} 7.0' in text
    exposed = {line.split("{")[0] for line in text.splitlines() if line and not line.startswith("#")}
    assert exposed == SERIES
