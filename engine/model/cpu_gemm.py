"""Prefill's float GEMM on CPU, out = x @ w.T over a block of dequantized weight rows: OpenBLAS on AMD cores,
oneMKL (torch's) elsewhere.

torch's CPU GEMM is oneMKL's, which on AMD's Zen cores runs 1.35-1.9x slower than OpenBLAS (numpy's) on
prefill's shapes (docs/speed.md#prefill-gemm-on-amd). OpenBLAS runs one thread a call here and the output
columns are split over the engine's threads: its own workers spin for about 0.1 s after each call and slow the
numba kernels that follow (the next block's dequantization ran 2x slower). threadpoolctl finds numpy's OpenBLAS
to set that (its library name and symbols differ between numpy builds).
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from threadpoolctl import ThreadpoolController

from engine.threads import usable_cores

MIN_PART_COLUMNS = 64  # narrower column parts leave OpenBLAS's kernel too little work a call


def cpu_vendor(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's vendor id ("AuthenticAMD", "GenuineIntel"), or "" where /proc/cpuinfo does not say."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


# the backend of every call: module-wide, so bench.prefill --gemm-too can time the other one in the same process
OPENBLAS = cpu_vendor() == "AuthenticAMD"

_lock = threading.Lock()
_workers: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    """Threads for all parts but the caller's, one for each other usable core (never resized: two engines in one
    process may multiply at once; parts beyond them wait their turn); the first call sets numpy's OpenBLAS to one
    thread a call, process-wide."""
    global _workers
    with _lock:
        if _workers is None:
            for library in ThreadpoolController().select(internal_api="openblas").lib_controllers:
                library.set_num_threads(1)
            _workers = ThreadPoolExecutor(max(usable_cores() - 1, 1), thread_name_prefix="prefixgate-gemm")
        return _workers


def matmul_nt(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """out = x @ w.T for float32 x [rows, K] and w [N, K], both contiguous, and out a [rows, N] view (strided
    columns of a wider output allowed); on torch's thread count."""
    if not OPENBLAS:
        out.copy_(torch.mm(x, w.T))
        return
    n = w.shape[0]
    parts = max(1, min(torch.get_num_threads(), n // MIN_PART_COLUMNS))
    xs, ws, outs = x.numpy(), w.numpy(), out.numpy()
    bounds = [n * p // parts for p in range(parts + 1)]

    def part(p: int) -> None:
        outs[:, bounds[p]:bounds[p + 1]] = xs @ ws[bounds[p]:bounds[p + 1]].T

    workers = _pool()
    others = [workers.submit(part, p) for p in range(1, parts)]
    part(0)
    for future in others:
        future.result()
