"""The engine's thread budget on CPU: how many compute threads a decode-only step uses, and how many a step
with a prefill chunk (llama.cpp's --threads and --threads-batch).

A batch-1 decode step streams the weights once and is bound by memory: on a 2-core machine one thread
decoded faster than two (docs/speed.md#threads), while a prefill chunk is bound by arithmetic and
wants every core. Either number left unset is chosen at start-up by timing both kinds of step at each
thread count the process may use, the counts taking turns; the fastest count wins, a smaller one when it
is within 5 %, which leaves a core to the API process.
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
PREFILL_PROBES = 2


@dataclass(slots=True)
class ThreadBudget:
    threads: int  # decode-only steps
    threads_batch: int  # steps with a prefill chunk
    decode_ms: dict[int, float] = field(default_factory=dict)  # the timings it was chosen by (empty: given)
    prefill_ms: dict[int, float] = field(default_factory=dict)

    def apply(self, has_prefill: bool) -> None:
        """Sets torch's (and through it the compiled kernels') thread count for the next step."""
        wanted = self.threads_batch if has_prefill else self.threads
        if torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)


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
    if threads_batch is None:
        budget.prefill_ms = _time_each(candidates, prefill_chunk, PREFILL_PROBES)
        budget.threads_batch = _fastest(budget.prefill_ms)
    logger.info("threads: %d for decode steps %s, %d for steps with a prefill %s", budget.threads,
                _describe(budget.decode_ms), budget.threads_batch, _describe(budget.prefill_ms))
    return budget


def _time_each(candidates: range, step: Callable[[], None], probes: int) -> dict[int, float]:
    """Median time at each count; the counts take turns probe by probe, so a burst of other work on a shared
    machine slows every count alike instead of deciding the choice against the count it hit."""
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
    return {n: statistics.median(ms) for n, ms in samples.items()}


def _fastest(timings: dict[int, float]) -> int:
    best = min(timings.values())
    return min(n for n, ms in timings.items() if ms <= best * NEAR_BEST)


def _describe(timings: dict[int, float]) -> str:
    if not timings:
        return "(as set)"
    return "(timed: " + ", ".join(f"{n} thread{'s' * (n != 1)} {ms:.2f} ms" for n, ms in timings.items()) + ")"
