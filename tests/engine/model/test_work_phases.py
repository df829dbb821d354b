"""work_phases (the compiled decode step's one parallel region): every chunk of every phase is done exactly once,
no chunk starts before the phase ahead of it is done, and the region ends even where its threads' iterations run
one after the other."""
import numpy as np
import pytest
from numba import njit, prange

from engine.model import work_phases
from engine.model.cpu_threads import use_threads

SLOW_CHUNK_SPINS = 2_000_000  # chunk 0 of each phase works this long, so that a thread that did not wait for it shows


@njit(nogil=True)
def _walk(chunks, counters, done, early):
    """One thread's walk through the phases: done[p, c] counts chunk c of phase p; early[p] counts chunks of phase
    p that started while the phase before was not yet done."""
    for p in range(len(chunks)):
        for c in work_phases.claimed(counters, p, chunks[p]):
            if p > 0 and done[p - 1, :chunks[p - 1]].sum() != chunks[p - 1]:
                early[p] += 1
            if c == 0:
                total = 0.0
                for i in range(SLOW_CHUNK_SPINS):
                    total += np.sqrt(np.float64(i))
                if total < 0:  # (never: keeps the loop from being compiled away)
                    early[p] += 100
            done[p, c] += 1


@njit(nogil=True, parallel=True)
def _region(threads, chunks, done, early):
    counters = work_phases.new_counters(len(chunks))
    for _ in prange(threads):
        _walk(chunks, counters, done, early)


@njit(nogil=True)
def _one_after_another(threads, chunks, done, early):
    counters = work_phases.new_counters(len(chunks))
    for _ in range(threads):
        _walk(chunks, counters, done, early)


def _run(region, threads: int, chunks: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    chunks = np.array(chunks, np.int64)
    done = np.zeros((len(chunks), max(chunks) + 1), np.int64)
    early = np.zeros(len(chunks), np.int64)
    region(threads, chunks, done, early)
    return done, early, chunks


@pytest.mark.parametrize("chunks", [[2] * 8, [1, 5, 1, 3], [8, 1, 0, 4], [3]])
def test_every_chunk_runs_once_and_each_phase_after_the_one_before(chunks):
    done, early, counts = _run(_region, use_threads(), chunks)
    for p, count in enumerate(counts):
        assert done[p, :count].tolist() == [1] * count and done[p, count:].sum() == 0
    assert early.tolist() == [0] * len(chunks)


def test_threads_that_run_one_after_another_end_with_the_first_doing_every_chunk():
    done, early, counts = _run(_one_after_another, 3, [2, 3, 1])
    for p, count in enumerate(counts):
        assert done[p, :count].tolist() == [1] * count
    assert early.tolist() == [0, 0, 0]


def test_new_counters_are_zero_and_a_phase_each_on_its_own_lines():
    counters = work_phases.new_counters(3)
    assert counters.shape == (3, work_phases.STRIDE) and not counters.any()
    assert work_phases.STRIDE * 8 >= 2 * 64 and work_phases.HALF * 8 >= 64  # claims and completions: 64-byte lines


def test_the_claim_loop_is_compiled_with_each_caller_not_taken_from_the_cache():
    """numba cannot lower a caller of a generator that it loaded from its cache (a later process compiling the
    step for a new signature died in get_generator_impl), so `claimed` stays out of the cache."""
    assert type(work_phases.claimed._cache).__name__ == "NullCache"
