"""Gives the C heap's freed pages back to the OS once the engine has loaded (glibc keeps them otherwise)."""
from __future__ import annotations

import ctypes
import ctypes.util


def trim() -> bool:
    """glibc's malloc_trim(0). Loading leaves freed temporaries in the heap (the GGUF file's rows, packing, the
    start-up probes) that would otherwise count in the process's memory for its whole life. False where the C
    library has no malloc_trim (musl, macOS) or nothing could be returned."""
    try:
        return bool(ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0))
    except (OSError, AttributeError, TypeError):
        return False
