"""The engine's thread budget on CPU: how many compute threads a decode-only step uses, and how many a step
with a prefill chunk (llama.cpp's --threads and --threads-batch).

A batch-1 decode step streams the weights once and is bound by memory: on a 2-core machine one thread
decoded faster than two before the compiled step became one parallel region (docs/speed.md#threads), while a
prefill chunk is bound by arithmetic and wants every core. Either number left unset is chosen at start-up by
timing both kinds of step at each thread count the process may use, the counts taking turns; the fastest count
wins, a smaller one when it is within 5 %, which leaves a core to the API process.

A timed decode count is then re-checked on live steps: a start-up that another process happened to slow (its
probes take a second) would otherwise keep its choice for the server's life (one decode thread where two ran
1.6x faster, docs/serving.md). Every RECHECK_EVERY decode-only steps, a pair of consecutive steps of the same
batch size runs at the chosen count and then at another count, in turn; when each other count has
RECHECK_PAIRS pairs, their median time ratios choose again by the start-up's rule.
"""
from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

logger = logging.getLogger("prefixgate.engine")

NEAR_BEST = 1.05  # a smaller thread count within 5 % of the fastest is chosen
DECODE_PROBES = 5
# a prefill count is chosen by its fastest of 3 probes: other work only ever slows a step, and the median of 2 (the
# rule before) let one slowed probe of 2 threads hand a 2-core server 1 prefill thread, its TTFT 1.5x (128-token
# probes on the default model run only 1.25-1.35x faster on 2 threads there); prefill counts get no live re-check
PREFILL_PROBES = 3
RECHECK_EVERY = 200  # decode-only steps at the chosen count between two re-check pairs (one step in 200 at
# another count: a slower one costs a fraction of a percent)
RECHECK_PAIRS = 5  # the latest pairs of each other count whose median ratio decides
# counts whose start-up probes took more than this times the fastest's are not re-checked: many cores would
# otherwise run one step in 200 at 1 thread, several times slower
RECHECK_WITHIN = 2.0


@dataclass(slots=True)
class ThreadBudget:
    threads: int  # decode-only steps
    threads_batch: int  # steps with a prefill chunk
    decode_ms: dict[int, float] = field(default_factory=dict)  # the timings it was chosen by (empty: given)
    prefill_ms: dict[int, float] = field(default_factory=dict)
    # the live re-check of a timed decode count (the module docstring): the counts it compares, the steps since
    # the last pair, the running step (its count, rows, role), the pair's first step (rows, seconds), and each
    # other count's latest ratios (its step's time over the chosen count's)
    _counts: tuple[int, ...] = ()
    _since: int = 0
    _running: tuple[int, int, str] | None = None
    _reference: tuple[int, float] | None = None
    _ratios: dict[int, list[float]] = field(default_factory=dict)

    def apply(self, has_prefill: bool, rows: int = 0) -> None:
        """Sets torch's (and through it the compiled kernels') thread count for the next step, of `rows`
        sequences."""
        self._running = None  # (a step that failed before its observe() leaves its role to none after it)
        if has_prefill:
            self._reference = None  # a pair is two consecutive decode-only steps
        wanted = self.threads_batch if has_prefill else self._decode_count(rows)
        if torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)

    def counts(self) -> tuple[int, int]:
        """(decode-only steps' count, prefill steps' count)."""
        return self.threads, self.threads_batch

    def observe(self, seconds: float) -> None:
        """The time of the step apply() was last called for (the re-check's timings)."""
        if self._running is None:
            return
        count, rows, role = self._running
        self._running = None
        if role == "plain":
            self._since += 1
        elif role == "reference":
            self._reference = (rows, seconds)
        else:
            ratios = self._ratios.setdefault(count, [])
            ratios[:] = ratios[-(RECHECK_PAIRS - 1):] + [seconds / self._reference[1]]
            self._reference, self._since = None, 0
            if all(len(self._ratios.get(n, ())) == RECHECK_PAIRS for n in self._others()):
                self._choose_again()

    def recheck(self, counts: list[int]) -> None:
        """Re-checks the decode count on live steps against each of `counts`."""
        self._counts = tuple(counts)

    def _decode_count(self, rows: int) -> int:
        if len(self._counts) < 2:
            return self.threads
        role, count = "plain", self.threads
        if self._reference is not None and self._reference[0] == rows:
            role, count = "candidate", min(self._others(), key=lambda n: len(self._ratios.get(n, ())))
        elif self._since >= RECHECK_EVERY:  # (a pair whose batch size changed starts again)
            role = "reference"
        self._reference = self._reference if role == "candidate" else None
        self._running = (count, rows, role)
        return count

    def _others(self) -> list[int]:
        return [n for n in self._counts if n != self.threads]

    def _choose_again(self) -> None:
        timings = {n: statistics.median(self._ratios[n]) for n in self._others()} | {self.threads: 1.0}
        chosen = _fastest(timings)
        if chosen != self.threads:
            logger.info("threads: %d for decode steps from now on (live steps: %s of %d's time)", chosen,
                        ", ".join(f"{n} thread{'s' * (n != 1)} {ratio:.2f}x" for n, ratio in sorted(timings.items())
                                  if n != self.threads), self.threads)
            self.threads = chosen
        self._ratios.clear()


def usable_cores() -> int:
    """The cores this process may run on (a container's CPU set, taskset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def choose(threads: int | None, threads_batch: int | None, decode_step: Callable[[], None],
           prefill_chunk: Callable[[], None]) -> ThreadBudget:
    """The budget: given numbers as they are, unset ones timed over 1..usable_cores() threads."""
    candidates = range(1, usable_cores() + 1)
    budget = ThreadBudget(threads or 1, threads_batch or 1)
    if threads is None:
        budget.decode_ms = _time_each(candidates, decode_step, DECODE_PROBES)
        budget.threads = _fastest(budget.decode_ms)
        best = min(budget.decode_ms.values())
        budget.recheck([n for n in candidates if budget.decode_ms[n] <= RECHECK_WITHIN * best])
    if threads_batch is None:
        budget.prefill_ms = _time_each(candidates, prefill_chunk, PREFILL_PROBES, min)
        budget.threads_batch = _fastest(budget.prefill_ms)
    logger.info("threads: %d for decode steps %s, %d for steps with a prefill %s", budget.threads,
                _describe(budget.decode_ms), budget.threads_batch, _describe(budget.prefill_ms))
    return budget


def _time_each(candidates: range, step: Callable[[], None], probes: int,
               summary: Callable[[list[float]], float] = statistics.median) -> dict[int, float]:
    """Each count's time, the summary (median, or min) of its probes; the counts take turns probe by probe, so a
    burst of other work on a shared machine slows every count alike instead of deciding the choice against the
    count it hit."""
    samples: dict[int, list[float]] = {n: [] for n in candidates}
    for n in candidates:
        torch.set_num_threads(n)
        step()  # warm: the first call at a new thread count starts its workers
    for _ in range(probes):
        for n in candidates:
            torch.set_num_threads(n)
            start = time.perf_counter()
            step()
            samples[n].append((time.perf_counter() - start) * 1e3)
    return {n: summary(ms) for n, ms in samples.items()}


def _fastest(timings: dict[int, float]) -> int:
    best = min(timings.values())
    return min(n for n, ms in timings.items() if ms <= best * NEAR_BEST)


def _describe(timings: dict[int, float]) -> str:
    if not timings:
        return "(as set)"
    return "(timed: " + ", ".join(f"{n} thread{'s' * (n != 1)} {ms:.2f} ms" for n, ms in timings.items()) + ")"
