"""cpu_threads.use_threads: the numba kernels take torch's thread count on the calling thread, set again only
when it changed there."""
from __future__ import annotations

import threading

import numba
import pytest
import torch

from engine.model.cpu_threads import use_threads


@pytest.fixture
def torch_threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_numba_follows_torchs_count_as_it_changes(torch_threads):
    for n in (1, 2, 1):
        torch_threads(n)
        assert use_threads() == min(n, numba.config.NUMBA_NUM_THREADS) == numba.get_num_threads()


def test_each_thread_gets_the_count_set_on_it(torch_threads):
    """numba's setting is per thread: one set on this thread does not stand for a thread that never set it."""
    torch_threads(1)
    assert use_threads() == 1
    seen = []

    def other():
        seen.append((use_threads(), numba.get_num_threads()))

    worker = threading.Thread(target=other)
    worker.start()
    worker.join()
    assert seen == [(1, 1)]
