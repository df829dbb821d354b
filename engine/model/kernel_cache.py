"""Where numba keeps the CPU kernels' machine code: one folder per version of the kernels' sources.

numba throws a cached function away only when its own file changes, but the compiled decode step
(decode_step_cpu.py) has the attention kernel, the matmuls, the vector code and the bfloat16 reads of
the other files compiled into it: after an edit of those alone it would go on loading the old machine
code. A folder keyed by a hash of every kernel source turns any such edit into a fresh compile. Import
this module before defining a kernel with cache=True (numba picks the folder when the decorator runs).
NUMBA_CACHE_DIR, if set, is the parent of those folders; else the user cache ($XDG_CACHE_HOME or
~/.cache, then prefixgate/numba). Folders of older versions stay until removed (a few MB each).
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numba

KERNEL_SOURCES = ("simd.py", "bfloat16_bits.py", "paged_decode_cpu.py", "packed_matmul_cpu.py", "decode_step_cpu.py")


def folder() -> Path:
    base = os.environ.get("NUMBA_CACHE_DIR") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "prefixgate" / "numba"
    digest = hashlib.sha256()
    for name in KERNEL_SOURCES:
        digest.update((Path(__file__).parent / name).read_bytes())
    return Path(base) / digest.hexdigest()[:16]


numba.config.CACHE_DIR = str(folder())
