"""Prefix-aware admission (lpm) raises hits on a bursty mix, and aging bounds how long it delays anyone."""
from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.request import Request

MAX_WAIT_STEPS = 12


class StepClock:
    """The scheduler's clock, advanced one unit per engine step: queue times in steps, no wall clock."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _bursty_mix(vocab_size: int, seed: int = 0) -> list[tuple[int, list[int]]]:
    """(arrival step, prompt): bursts over three long shared prefixes interleaved with unique prompts."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, vocab_size) for _ in range(64)] for _ in range(3)]
    arrivals = []
    for burst in range(4):
        for _ in range(12):
            if rng.random() < 0.6:
                prompt = rng.choice(prefixes) + [rng.randrange(3, vocab_size) for _ in range(8)]
            else:
                prompt = [rng.randrange(3, vocab_size) for _ in range(72)]
            arrivals.append((burst * 6, prompt))
    return arrivals


def _run(model_dir, policy: str) -> tuple[list[Request], list[float], int]:
    llm = LLM(str(model_dir), scheduling_policy=policy, max_reorder_wait_s=MAX_WAIT_STEPS, block_size=16,
              num_kv_blocks=24, max_num_seqs=4, max_num_batched_tokens=96)
    clock = StepClock()
    core = llm.core
    core.scheduler.clock = clock
    pending = [(step, Request(f"r{i}", prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                              arrival_time=step))
               for i, (step, prompt) in enumerate(_bursty_mix(core.vocab_size, seed=2))]  # the pool alone keeps too little
    requests = [r for _, r in pending]
    while pending or core.has_unfinished():
        while pending and pending[0][0] <= clock.now:
            core.add_request(pending.pop(0)[1])
        core.step()
        clock.now += 1
    assert all(b.ref_cnt == 0 for b in core.kv.pool.blocks)
    queue_times = [r.first_scheduled_time - r.arrival_time for r in requests]
    return requests, queue_times, core.kv.num_hit_tokens


@pytest.fixture(scope="module")
def runs(tiny_llama_dir):
    return {policy: _run(tiny_llama_dir, policy) for policy in ("fcfs", "lpm")}


def test_lpm_hits_more_than_fcfs_on_a_bursty_mix(runs):
    _, _, fcfs_hits = runs["fcfs"]
    _, _, lpm_hits = runs["lpm"]
    assert lpm_hits > fcfs_hits


def test_an_overdue_request_is_never_passed_by_a_later_arrival(runs):
    requests, _, _ = runs["lpm"]
    for r in requests:
        overdue_at = r.arrival_time + MAX_WAIT_STEPS
        passers = [s for s in requests
                   if overdue_at <= s.first_scheduled_time < r.first_scheduled_time and s.arrival_time > r.arrival_time]
        assert not passers, f"{r.request_id} was passed by {[s.request_id for s in passers]} after waiting the bound"


def test_every_request_finished(runs):
    for requests, _, _ in runs.values():
        assert all(r.is_finished for r in requests)


def _core(model_dir, **overrides):
    llm = LLM(str(model_dir), block_size=16, num_kv_blocks=64, **overrides)
    clock = StepClock()
    llm.core.scheduler.clock = clock
    return llm.core, clock


def _run_arrivals(core, clock, arrivals: list[tuple[float, Request]]) -> None:
    """Adds each request at its arrival step and steps the engine (one clock unit per step) until all finish."""
    pending = sorted(arrivals, key=lambda a: a[0])
    while pending or core.has_unfinished():
        while pending and pending[0][0] <= clock.now:
            core.add_request(pending.pop(0)[1])
        core.step()
        clock.now += 1


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def test_a_request_waiting_for_an_in_flight_prefix_is_not_passed_once_overdue(tiny_llama_dir):
    """With max_reorder_wait_s=0 every request is overdue at once: arrival order is the promise.

    A's 97-token prefill takes steps 0 and 1 (budget 80). In step 1, B could hit A's blocks 0-4 but waits
    for block 5, which A is computing; C (later, unrelated) fits the budget left. C must not go first.
    """
    core, clock = _core(tiny_llama_dir, scheduling_policy="lpm", max_reorder_wait_s=0, max_num_batched_tokens=80,
                        max_num_seqs=8)
    rng = random.Random(5)
    shared = [rng.randrange(3, 500) for _ in range(96)]
    a = Request("a", shared + [7], _greedy(2), arrival_time=0.0)
    b = Request("b", shared + [8, 9, 10, 11], _greedy(2), arrival_time=0.1)
    c = Request("c", [rng.randrange(3, 500) for _ in range(40)], _greedy(2), arrival_time=0.2)
    _run_arrivals(core, clock, [(0, a), (0, b), (0, c)])
    assert b.num_cached_tokens == 96  # B waited for the block in flight and hit it
    assert c.first_scheduled_time >= b.first_scheduled_time, "C passed the overdue B"


def test_lpm_falls_back_to_fcfs_above_max_queue():
    from engine.config import SchedulingPolicy
    from engine.kv.kv_cache_manager import KVCacheManager
    from engine.policy import AdmissionOrder

    kv = KVCacheManager(16, 4)
    cached = Request("cached", list(range(10, 22)), _greedy(1))
    assert kv.allocate(cached, 12)
    cached.num_computed_tokens = 12
    kv.cache_full_blocks(cached)
    kv.free(cached)
    unique = Request("unique", list(range(100, 112)), _greedy(1), arrival_time=0.0)
    sharer = Request("sharer", list(range(10, 22)) + [1], _greedy(1), arrival_time=1.0)
    lpm = AdmissionOrder(SchedulingPolicy.LPM, max_reorder_wait_s=100, max_queue=2, kv=kv)
    assert [r.request_id for r in lpm([unique, sharer], now=2.0)] == ["sharer", "unique"]  # 3 blocks hit first
    lpm.max_queue = 1
    assert [r.request_id for r in lpm([unique, sharer], now=2.0)] == ["unique", "sharer"]  # too many: FCFS


def test_aging_bounds_how_long_lpm_passes_a_request(tiny_llama_dir):
    """A stream of requests that hit a cached prefix, one arriving every step, would starve a request with
    a unique prompt forever under pure lpm: aging admits it once it has waited the bound."""
    bound = 4
    core, clock = _core(tiny_llama_dir, scheduling_policy="lpm", max_reorder_wait_s=bound, max_num_seqs=1,
                        max_num_batched_tokens=64)
    rng = random.Random(6)
    shared = [rng.randrange(3, 500) for _ in range(48)]
    sharers = [(step, Request(f"s{step}", shared + [rng.randrange(3, 500)], _greedy(2), arrival_time=step))
               for step in range(40)]
    unique = Request("u", [rng.randrange(3, 500) for _ in range(49)], _greedy(2), arrival_time=0.5)
    _run_arrivals(core, clock, [*sharers, (0.5, unique)])
    steps_per_request = 2  # a prefill step that samples the first token, one decode
    waited = unique.first_scheduled_time - unique.arrival_time
    assert waited <= bound + steps_per_request
    passed_by = [r for _, r in sharers if unique.arrival_time < r.arrival_time
                 and r.first_scheduled_time < unique.first_scheduled_time]
    assert passed_by  # lpm did reorder: later sharers went first while the bound allowed it
