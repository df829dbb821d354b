"""The way back from the compiled CPU kernels: `cpu_kernels: eager` runs every step in plain PyTorch and
imports no numba; `compiled` (the default) needs numba, and says so in one line when it is missing."""
from __future__ import annotations

import importlib.util

MISSING_NUMBA = ("the compiled CPU kernels need numba, which is not installed: install it (pip install numba), "
                 "or run with --cpu-kernels eager (plain PyTorch, slower decode)")


def check_available() -> None:
    """ValueError with MISSING_NUMBA when numba cannot be imported."""
    try:
        found = importlib.util.find_spec("numba") is not None
    except ValueError:  # a module set to None in sys.modules (how the tests hide it)
        found = False
    if not found:
        raise ValueError(MISSING_NUMBA)
