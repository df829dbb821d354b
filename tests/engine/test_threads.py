"""The thread budget: unset counts are timed at each count the process may use; the fastest wins, a
smaller count when it is within 5 %; given counts are used as they are; each step gets its kind's count."""
from __future__ import annotations

import logging

import pytest
import torch

from engine import threads

# milliseconds a fake step takes at each thread count
DECODE_MS = {1: 10.0, 2: 10.3, 3: 14.0}  # memory-bound: 2 threads are no faster
PREFILL_MS = {1: 30.0, 2: 16.0, 3: 16.5}  # compute-bound: 3 is within 5 % of 2


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def step(self, costs: dict[int, float]):
        def run() -> None:
            self.now += costs[torch.get_num_threads()] / 1e3
        return run


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(threads, "usable_cores", lambda: 3)
    monkeypatch.setattr(threads.time, "perf_counter", fake.perf_counter)
    before = torch.get_num_threads()
    yield fake
    torch.set_num_threads(before)


def test_unset_counts_are_timed_and_a_near_tie_goes_to_fewer_threads(clock):
    budget = threads.choose(None, None, clock.step(DECODE_MS), clock.step(PREFILL_MS))
    assert (budget.threads, budget.threads_batch) == (1, 2)
    assert budget.decode_ms == pytest.approx(DECODE_MS) and budget.prefill_ms == pytest.approx(PREFILL_MS)


def test_the_start_up_log_says_1_thread_not_1_threads(clock, caplog):
    with caplog.at_level(logging.INFO, logger=threads.logger.name):
        threads.choose(None, 3, clock.step(DECODE_MS), clock.step(PREFILL_MS))
    assert ("threads: 1 for decode steps (timed: 1 thread 10.00 ms, 2 threads 10.30 ms, 3 threads 14.00 ms), "
            "3 for steps with a prefill (as set)") in caplog.text


def test_given_counts_are_kept_and_not_timed(clock):
    def never() -> None:
        raise AssertionError("a given count must not be timed")
    budget = threads.choose(2, 3, never, never)
    assert (budget.threads, budget.threads_batch) == (2, 3) and not budget.decode_ms and not budget.prefill_ms


def test_each_step_runs_with_its_kind_of_count(clock):
    budget = threads.ThreadBudget(threads=1, threads_batch=3)
    budget.apply(has_prefill=False)
    assert torch.get_num_threads() == 1
    budget.apply(has_prefill=True)
    assert torch.get_num_threads() == 3


def test_the_counts_take_turns_so_a_burst_of_other_work_slows_them_alike(clock):
    """A burst of other work on a shared machine as long as one count's probes: timed count by count, it fell
    on all of 2 threads' and the choice went to 3; taking turns, it slows two probes of each and 2 still win."""
    order = []
    burst = iter([0.0] * 6 + [40.0] * 6 + [0.0] * 100)  # the 7th to 12th step calls run 40 ms longer

    def step() -> None:
        order.append(torch.get_num_threads())
        clock.now += ({1: 20.0, 2: 12.0, 3: 13.0}[torch.get_num_threads()] + next(burst)) / 1e3
    timings = threads._time_each(range(1, 4), step, probes=5)
    assert order == [1, 2, 3] + [1, 2, 3] * 5  # warm-ups, then the counts take turns probe by probe
    assert timings == pytest.approx({1: 20.0, 2: 12.0, 3: 13.0})
    assert threads._fastest(timings) == 2


def _decode(budget: threads.ThreadBudget, clock: FakeClock, costs: dict[int, float], steps: int, rows=lambda i: 1,
            ran: list[int] | None = None) -> None:
    """`steps` decode-only steps as EngineCore.step runs them: apply, the step, observe."""
    for i in range(steps):
        budget.apply(has_prefill=False, rows=rows(i))
        if ran is not None:
            ran.append(torch.get_num_threads())
        start = clock.perf_counter()
        clock.step(costs)()
        budget.observe(clock.perf_counter() - start)


def test_live_steps_correct_a_start_up_choice_that_other_work_spoiled(clock, monkeypatch):
    """A start-up whose probes another process slowed chose 1 decode thread where 2 run 1.6x faster: the live
    re-check moves it to 2 once each other count has its pairs, and the step stats say so."""
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    budget = threads.choose(None, 2, clock.step({1: 10.0, 2: 11.0}), clock.step(PREFILL_MS))  # the spoiled probes
    assert budget.threads == 1
    live = {1: 16.0, 2: 10.0}
    _decode(budget, clock, live, threads.RECHECK_EVERY["decode"] * threads.RECHECK_PAIRS)
    assert budget.threads == 1  # one pair short
    _decode(budget, clock, live, threads.RECHECK_EVERY["decode"] + 2)
    assert budget.threads == 2 and budget.counts() == (2, 2)


def test_the_live_re_check_keeps_the_rule_a_near_tie_goes_to_fewer_threads(clock):
    budget = threads.choose(None, 2, clock.step(DECODE_MS), clock.step(PREFILL_MS))
    assert budget.threads == 1
    ran: list[int] = []
    _decode(budget, clock, DECODE_MS, 4 * threads.RECHECK_EVERY["decode"] * threads.RECHECK_PAIRS, ran=ran)
    assert budget.threads == 1
    assert {2, 3} <= set(ran)  # the other counts did run, one step a pair
    assert ran.count(1) > 0.99 * len(ran)


def test_a_pair_is_two_consecutive_decode_steps_of_one_batch_size(clock, monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    budget = threads.choose(None, 2, clock.step({1: 10.0, 2: 11.0}), clock.step(PREFILL_MS))
    ran: list[int] = []
    _decode(budget, clock, {1: 16.0, 2: 10.0}, 10 * threads.RECHECK_EVERY["decode"], rows=lambda i: 1 + i % 2, ran=ran)
    assert ran == [1] * len(ran) and budget.threads == 1  # the batch size changed at every step: no pair
    _decode(budget, clock, {1: 16.0, 2: 10.0}, 1)  # a reference step, then a prefill step: the pair starts again
    budget.apply(has_prefill=True, rows=1)
    budget.observe(0.5)
    ran.clear()
    _decode(budget, clock, {1: 16.0, 2: 10.0}, 2, ran=ran)
    assert ran == [1, 2]


def test_a_failed_steps_part_in_a_pair_does_not_pass_to_the_step_after_it(clock, monkeypatch):
    """EngineCore.step skips observe() when the forward fails: a prefill step after it must not be timed as the
    failed step's half of a pair."""
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    budget = threads.choose(None, 2, clock.step({1: 10.0, 2: 11.0}), clock.step(PREFILL_MS))
    _decode(budget, clock, {1: 16.0, 2: 10.0}, threads.RECHECK_EVERY["decode"])  # the next decode step starts a pair ...
    budget.apply(has_prefill=False, rows=1)  # ... and fails
    budget.apply(has_prefill=True, rows=1)
    budget.observe(0.5)
    ran: list[int] = []
    _decode(budget, clock, {1: 16.0, 2: 10.0}, 2, ran=ran)
    assert ran == [1, 2]  # the pair starts afresh: its first step at the chosen count, then the other


def test_counts_far_slower_at_start_up_are_not_re_checked(clock):
    """On many cores one thread is several times slower: a step in 200 at that count would cost too much."""
    costs = {1: 10.0, 2: 10.3, 3: 25.0}
    budget = threads.choose(None, 2, clock.step(costs), clock.step(PREFILL_MS))
    ran: list[int] = []
    _decode(budget, clock, costs, 4 * threads.RECHECK_EVERY["decode"] * threads.RECHECK_PAIRS, ran=ran)
    assert set(ran) == {1, 2} and budget.threads == 1


def test_given_counts_are_not_re_checked(clock):
    budget = threads.choose(2, 3, clock.step(DECODE_MS), clock.step(PREFILL_MS))
    ran: list[int] = []
    _decode(budget, clock, DECODE_MS, 3 * threads.RECHECK_EVERY["decode"] * threads.RECHECK_PAIRS, ran=ran)
    assert set(ran) == {2} and budget.counts() == (2, 3)


def test_each_step_reports_the_engines_counts(tiny_llama_dir):
    from engine.config import EngineConfig
    from engine.core import EngineCore
    from engine.request import Request
    from engine.sampling_params import SamplingParams
    core = EngineCore(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=16, threads=1, threads_batch=2))
    core.add_request(Request("r", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0)))
    reported = [core.step()[1].threads for _ in range(2)]
    assert reported == [(1, 2), (1, 2)] == [core.thread_budget.counts()] * 2


def test_a_prefill_count_goes_by_its_fastest_probe(clock):
    """Other work only slows a step: two of 2 threads' three prefill probes slowed by bursts (their median, 46 ms,
    would hand the choice to 1 thread's 30) leave the choice to the count's own speed."""
    burst = iter([0.0] * 3 + [0.0, 30.0, 0.0] * 2 + [0.0] * 100)  # warm-ups, then 1 / 2 / 3 in turns, three probes

    def prefill() -> None:
        clock.now += (PREFILL_MS[torch.get_num_threads()] + next(burst)) / 1e3
    budget = threads.choose(1, None, clock.step(DECODE_MS), prefill)
    assert budget.prefill_ms == pytest.approx(PREFILL_MS) and budget.threads_batch == 2
    assert threads.PREFILL_PROBES == 3


def _prefill(budget: threads.ThreadBudget, clock: FakeClock, costs: dict[int, float], steps: int,
             tokens=lambda i: 512, ran: list[int] | None = None) -> None:
    """`steps` steps with a prefill chunk of `tokens(i)` tokens beside one decode, as EngineCore.step runs them."""
    for i in range(steps):
        budget.apply(has_prefill=True, rows=2, tokens=tokens(i))
        if ran is not None:
            ran.append(torch.get_num_threads())
        start = clock.perf_counter()
        clock.step(costs)()
        budget.observe(clock.perf_counter() - start)


def test_live_prefill_steps_correct_a_start_up_that_other_work_spoiled(clock, monkeypatch, caplog):
    """The soak probe's start-up: 2 prefill threads' probes ran while other servers loaded the cores (179 ms on 1
    thread, 572 on 2), so 1 was chosen where 2 prefill 1.7x faster; the live re-check moves it to 2. All the
    cores stay in the re-check though their probes took over twice the fastest's."""
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    budget = threads.choose(1, None, clock.step(DECODE_MS), clock.step({1: 179.0, 2: 572.0}))
    assert budget.threads_batch == 1
    live = {1: 47.0, 2: 27.0}
    every, pairs = threads.RECHECK_EVERY["prefill"], threads.RECHECK_PAIRS
    with caplog.at_level(logging.INFO, logger=threads.logger.name):
        _prefill(budget, clock, live, (every + 2) * pairs - 1)
        assert budget.threads_batch == 1  # one step short
        _prefill(budget, clock, live, 1)
    assert budget.counts() == (1, 2)
    assert "threads: 2 for steps with a prefill from now on (live steps: 2 threads 0.57x of 1's time)" in caplog.text


def test_a_prefill_pair_is_two_consecutive_prefill_steps_of_one_shape(clock, monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    budget = threads.choose(1, None, clock.step(DECODE_MS), clock.step({1: 179.0, 2: 572.0}))
    ran: list[int] = []
    live = {1: 47.0, 2: 27.0}
    _prefill(budget, clock, live, 10 * threads.RECHECK_EVERY["prefill"], tokens=lambda i: 512 - i % 2, ran=ran)
    assert ran == [1] * len(ran)  # the chunk's tokens changed at every step: no pair
    for _ in range(10 * threads.RECHECK_EVERY["prefill"]):  # a decode step between any two prefill steps
        _prefill(budget, clock, live, 1, ran=ran)
        _decode(budget, clock, live, 1)
    assert set(ran) == {1} and budget.threads_batch == 1


def test_a_choice_the_re_check_keeps_is_re_checked_less_and_less_often(clock, monkeypatch):
    """A start-up that judged right (another process holding one of 2 cores for good: 2 threads prefill 2.5x
    slower): each round of pairs that keeps 1 thread doubles the steps before the next, up to 16 times."""
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    costs = {1: 40.0, 2: 100.0}
    budget = threads.choose(1, None, clock.step(DECODE_MS), clock.step(costs))
    assert budget.threads_batch == 1 and budget.checks["prefill"].counts == (1, 2)  # all the cores, though slower
    ran: list[int] = []
    every, pairs = threads.RECHECK_EVERY["prefill"], threads.RECHECK_PAIRS
    intervals = []
    for _ in range(6):  # six rounds of pairs, each kept 1 thread
        intervals.append(budget.checks["prefill"].every)
        _prefill(budget, clock, costs, (budget.checks["prefill"].every + 2) * pairs, ran=ran)
    assert intervals == [every, 2 * every, 4 * every, 8 * every, 16 * every, 16 * every]
    assert budget.threads_batch == 1 and ran.count(2) == 6 * pairs
