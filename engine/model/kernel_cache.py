"""Where numba keeps the CPU kernels' machine code, so that it is never stale, never another machine's,
and never half-written.

- One folder per version of everything the code depends on: every kernel source (numba throws a cached
  function away only when its own file changes, but the compiled decode step has the attention kernel,
  the matmuls, the vector code and the bfloat16 reads of the other files compiled into it), numba's and
  llvmlite's versions, and the CPU's name and features (two CPU models on a shared volume never share an
  index; numba's CPU-name override counts too).
- Not keyed on where the checkout lies: numba's own locator names a subfolder after the source directory's
  absolute path, so each clone or worktree compiled everything anew; ours does not (`_KernelLocator`).
- A folder that cannot be written is reported, and the kernels are then compiled in memory (`CACHE` is
  False): numba would otherwise fall back to the source tree's __pycache__, keyed by one file only.
- Saving and loading hold an exclusive lock on the folder: numba picks a data file's name from the index
  it read, so two processes saving at once could map one signature to another's code.

NUMBA_CACHE_DIR, if set, is the parent of those folders; else the user cache ($XDG_CACHE_HOME or
~/.cache, then prefixgate/numba). Folders of older versions stay until removed (a few MB each). Import
this module before defining a kernel, and pass `cache=kernel_cache.CACHE` to its decorator.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import tempfile
from pathlib import Path

import llvmlite
import numba
from llvmlite import binding
from numba.core import caching

log = logging.getLogger("engine")
KERNEL_SOURCES = ("simd.py", "bfloat16_bits.py", "paged_decode_cpu.py", "paged_decode_loops.py",
                  "paged_decode_vectors.py", "packed_matmul_cpu.py", "quant_matmul_cpu.py", "quant_dot_cpu.py",
                  "decode_step_cpu.py", "work_phases.py")
LOCK_FILE = ".lock"


def target_cpu() -> tuple[str, str]:
    """The CPU numba compiles for: its name and features (numba's NUMBA_CPU_NAME / _FEATURES win; features
    "" are the named CPU's own)."""
    name = numba.config.CPU_NAME or binding.get_host_cpu_name()
    features = numba.config.CPU_FEATURES
    return name, binding.get_host_cpu_features().flatten() if features is None else features


def _enabled(features: str) -> set[str]:
    """The features an LLVM feature string turns on ("+avx2,-avx512f" -> {"avx2"})."""
    return {f[1:] for f in features.split(",") if f.startswith("+")}


def vector_isa(features: str) -> str:
    """The widest vector instruction set in an LLVM feature string: avx512, avx2, neon or generic."""
    enabled = _enabled(features)
    return next((isa for isa, feature in (("avx512", "avx512f"), ("avx2", "avx2"), ("neon", "neon"))
                 if feature in enabled), "generic")


def has_vnni(features: str) -> bool:
    """Whether an LLVM feature string has byte dot products into 32-bit sums on 256-bit vectors (`vpdpbusd`): AVX-VNNI,
    or AVX512-VNNI with AVX512-VL."""
    enabled = _enabled(features)
    return "avxvnni" in enabled or {"avx512vnni", "avx512vl"} <= enabled


def has_wide_vnni(features: str) -> bool:
    """Whether an LLVM feature string has `vpdpbusd` on 512-bit vectors and AVX-512's byte operations
    (AVX512-VNNI with AVX512-BW)."""
    return {"avx512vnni", "avx512bw"} <= _enabled(features)


def folder() -> Path:
    base = os.environ.get("NUMBA_CACHE_DIR") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "prefixgate" / "numba"
    digest = hashlib.sha256()
    for name in KERNEL_SOURCES:
        digest.update((Path(__file__).parent / name).read_bytes())
    digest.update(f"numba {numba.__version__} llvmlite {llvmlite.__version__} {' '.join(target_cpu())}".encode())
    return Path(base) / digest.hexdigest()[:16]


def has_compiled(qualified: str) -> bool:
    """Whether the cache folder holds code of the kernel `module.function` (numba's index of it, any signature):
    false on a first start, or after an edit of the kernels' sources, which moves the folder."""
    return CACHE and any(FOLDER.glob(f"*/{qualified}-*.nbi"))


def writable(path: Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def _folder_lock(path: str):
    with open(os.path.join(path, LOCK_FILE), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _locked(method):
    @functools.wraps(method)
    def under_lock(self, *args, **kwargs):
        os.makedirs(self._cache_path, exist_ok=True)
        with _folder_lock(self._cache_path):
            return method(self, *args, **kwargs)
    return under_lock


class _KernelLocator(caching.UserProvidedCacheLocator):
    """numba's locator for a cache folder of one's own, but for this package's kernels the subfolder is not keyed
    on the checkout's absolute path: the folder is keyed on the kernels' sources and numba checks each file's
    content hash, so a second clone or worktree of the same sources loads what the first compiled."""

    @classmethod
    def from_function(cls, py_func, py_file):
        path = Path(py_file).resolve()
        if path.name not in KERNEL_SOURCES or path.parent.parts[-2:] != ("engine", "model"):
            return None  # another package's cached function: numba's own locators
        return super().from_function(py_func, py_file)

    @classmethod
    def get_suitable_cache_subpath(cls, py_file):
        return "kernels"


_FEATURES = target_cpu()[1]
TARGET_ISA = vector_isa(_FEATURES)
TARGET_VNNI = has_vnni(_FEATURES)
TARGET_WIDE_VNNI = has_wide_vnni(_FEATURES)
FOLDER = folder()
CACHE = writable(FOLDER)
if CACHE:
    numba.config.CACHE_DIR = str(FOLDER)
    # numba's index and data files of one function: read and written under one lock (numba writes them
    # one after the other, each by rename, which is atomic per file but not for the pair)
    caching.IndexDataCacheFile.save = _locked(caching.IndexDataCacheFile.save)
    caching.IndexDataCacheFile.load = _locked(caching.IndexDataCacheFile.load)
    caching.CacheImpl._locator_classes.insert(0, _KernelLocator)
else:
    log.warning("the CPU kernels' cache folder %s cannot be written: compiling them in memory at every start "
                "(about 1.5 minutes on 2 cores); set NUMBA_CACHE_DIR to a writable folder", FOLDER)
