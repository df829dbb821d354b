"""The threads of the numba CPU kernels: as many as torch's, and one launch at a time."""
from __future__ import annotations

import threading

import numba
import torch

# numba's workqueue layer (the fallback where no OpenMP is found) must not be entered by two threads at once
launch_lock = threading.Lock()
_set = threading.local()  # the count numba.set_num_threads last got on this thread (its setting is per thread)


def use_threads() -> int:
    """numba's parallel regions use as many threads as torch's (the setting is per calling thread); returns
    that number."""
    threads = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)
    # only on a change: set_num_threads takes a lock and checks its argument in Python, 19 us of a decode
    # step's Python right after the step (docs/speed.md#the-decode-step)
    if getattr(_set, "threads", None) != threads:
        numba.set_num_threads(threads)
        _set.threads = threads
    return threads
