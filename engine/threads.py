"""The engine's thread budget on CPU: how many compute threads a decode-only step uses, and how many a step
with a prefill chunk (llama.cpp's --threads and --threads-batch).

A batch-1 decode step streams the weights once and is bound by memory: on a 2-core machine one thread
decoded faster than two before the compiled step became one parallel region (docs/speed.md#threads), while a
prefill chunk is bound by arithmetic and wants every core. Either number left unset is chosen at start-up by
timing both kinds of step at each thread count the process may use, the counts taking turns; the fastest count
wins, a smaller one when it is within 5 %, which leaves a core to the API process.

A timed count is then re-checked on live steps: a start-up that another process happened to slow (its probes
take a second) would otherwise keep its choice for the server's life (one decode thread where two ran 1.6x
faster; one prefill thread where two prefilled an 8,000-token prompt in 27 s against 47: docs/serving.md). Every
RECHECK_EVERY steps of a kind (decode-only, or with a prefill chunk), a pair of consecutive steps of that kind
and the same shape (decode: the batch size; prefill: the batch size and the tokens, as a long prompt's chunks
of a full token budget are) runs at the chosen count and then at another count, in turn; when each other count
has RECHECK_PAIRS pairs, their median time ratios choose again by the start-up's rule. A round that keeps the
choice doubles the kind's interval (up to RECHECK_BACKOFF times), a change starts it again.
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
# probes on the default model run only 1.25-1.35x faster on 2 threads there)
PREFILL_PROBES = 3
# steps of a kind at the chosen count between two re-check pairs (one step in 200 or 20 at another count: a
# slower one costs a fraction of a percent, or a few where prefill steps are all a server runs)
RECHECK_EVERY = {"decode": 200, "prefill": 20}
# each round of pairs that keeps the choice doubles the kind's interval, up to this many times its start: a
# machine that the start-up judged right (another process holding a core for good, where all the cores prefill
# 2-3x slower) pays for the re-check less and less
RECHECK_BACKOFF = 16
RECHECK_PAIRS = 5  # the latest pairs of each other count whose median ratio decides
# counts whose start-up probes took more than this times the fastest's are not re-checked: many cores would
# otherwise run one step in 200 at 1 thread, several times slower. For prefill, bound by arithmetic, all the
# cores are re-checked too: only other work makes them slower than fewer threads
RECHECK_WITHIN = 2.0


@dataclass(slots=True)
class LiveCheck:
    """The live re-check of one kind of step's timed count (the module docstring): the counts it compares, the
    steps since the last pair, the pair's first step (its shape, seconds), and each other count's latest ratios
    (its step's time over the chosen count's)."""

    counts: tuple[int, ...]
    every: int
    since: int = 0
    reference: tuple[object, float] | None = None
    ratios: dict[int, list[float]] = field(default_factory=dict)

    def count(self, chosen: int, shape: object) -> tuple[int, str]:
        """The count the next step of this kind runs at, and its role: plain, a pair's reference, or its
        candidate (the other count with the fewest ratios yet)."""
        role, count = "plain", chosen
        if self.reference is not None and self.reference[0] == shape:
            role, count = "candidate", min(self._others(chosen), key=lambda n: len(self.ratios.get(n, ())))
        elif self.since >= self.every:  # (a pair whose shape changed starts again)
            role = "reference"
        if role != "candidate":
            self.reference = None
        return count, role

    def observe(self, chosen: int, count: int, shape: object, role: str, seconds: float) -> dict[int, float] | None:
        """Takes a step's time. Once each other count has its pairs: their median time ratios, and the chosen
        count's 1.0, to choose again by."""
        if role == "plain":
            self.since += 1
        elif role == "reference":
            self.reference = (shape, seconds)
        else:
            ratios = self.ratios.setdefault(count, [])
            ratios[:] = ratios[-(RECHECK_PAIRS - 1):] + [seconds / self.reference[1]]
            self.reference, self.since = None, 0
            if all(len(self.ratios.get(n, ())) == RECHECK_PAIRS for n in self._others(chosen)):
                timings = {n: statistics.median(self.ratios[n]) for n in self._others(chosen)} | {chosen: 1.0}
                self.ratios.clear()
                return timings
        return None

    def _others(self, chosen: int) -> list[int]:
        return [n for n in self.counts if n != chosen]


@dataclass(slots=True)
class ThreadBudget:
    threads: int  # decode-only steps
    threads_batch: int  # steps with a prefill chunk
    decode_ms: dict[int, float] = field(default_factory=dict)  # the timings it was chosen by (empty: given)
    prefill_ms: dict[int, float] = field(default_factory=dict)
    checks: dict[str, LiveCheck] = field(default_factory=dict)  # "decode" / "prefill": the timed counts' re-checks
    _running: tuple[str, int, object, str] | None = None  # the running step: its kind, count, shape and role

    def apply(self, has_prefill: bool, rows: int = 0, tokens: int = 0) -> None:
        """Sets torch's (and through it the compiled kernels') thread count for the next step, of `rows`
        sequences and `tokens` tokens."""
        self._running = None  # (a step that failed before its observe() leaves its role to none after it)
        kind = "prefill" if has_prefill else "decode"
        for other, check in self.checks.items():
            if other != kind:
                check.reference = None  # a pair is two consecutive steps of one kind
        wanted = self.threads_batch if has_prefill else self.threads
        if kind in self.checks:
            shape = (rows, tokens) if has_prefill else rows
            wanted, role = self.checks[kind].count(wanted, shape)
            self._running = (kind, wanted, shape, role)
        if torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)

    def counts(self) -> tuple[int, int]:
        """(decode-only steps' count, prefill steps' count)."""
        return self.threads, self.threads_batch

    def observe(self, seconds: float) -> None:
        """The time of the step apply() was last called for (the re-checks' timings)."""
        if self._running is None:
            return
        kind, count, shape, role = self._running
        self._running = None
        chosen = self.threads_batch if kind == "prefill" else self.threads
        check = self.checks[kind]
        timings = check.observe(chosen, count, shape, role, seconds)
        if timings is None:
            return
        new = _fastest(timings)
        if new == chosen:
            check.every = min(2 * check.every, RECHECK_BACKOFF * RECHECK_EVERY[kind])
        else:
            check.every = RECHECK_EVERY[kind]
            steps = "steps with a prefill" if kind == "prefill" else "decode steps"
            logger.info("threads: %d for %s from now on (live steps: %s of %d's time)", new, steps,
                        ", ".join(f"{n} thread{'s' * (n != 1)} {ratio:.2f}x" for n, ratio in sorted(timings.items())
                                  if n != chosen), chosen)
            if kind == "prefill":
                self.threads_batch = new
            else:
                self.threads = new


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
        _recheck(budget, "decode", [n for n in candidates if budget.decode_ms[n] <= RECHECK_WITHIN * min(
            budget.decode_ms.values())])
    if threads_batch is None:
        budget.prefill_ms = _time_each(candidates, prefill_chunk, PREFILL_PROBES, min)
        budget.threads_batch = _fastest(budget.prefill_ms)
        _recheck(budget, "prefill", [n for n in candidates if n == candidates[-1] or budget.prefill_ms[n] <=
                                     RECHECK_WITHIN * min(budget.prefill_ms.values())])
    logger.info("threads: %d for decode steps %s, %d for steps with a prefill %s", budget.threads,
                _describe(budget.decode_ms), budget.threads_batch, _describe(budget.prefill_ms))
    return budget


def _recheck(budget: ThreadBudget, kind: str, counts: list[int]) -> None:
    if len(counts) > 1:
        budget.checks[kind] = LiveCheck(tuple(counts), RECHECK_EVERY[kind])


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
