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


def test_lpm_delays_nobody_more_than_the_bound_beyond_fcfs(runs):
    _, fcfs_waits, _ = runs["fcfs"]
    _, lpm_waits, _ = runs["lpm"]
    assert max(lpm_waits) <= max(fcfs_waits) + MAX_WAIT_STEPS


def test_every_request_finished(runs):
    for requests, _, _ in runs.values():
        assert all(r.is_finished for r in requests)
