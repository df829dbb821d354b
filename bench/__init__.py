"""Benchmarks (not tests): prefix caching on vs off vs plain transformers, side by side in one run."""
import os

# Before torch loads OpenMP (every `python -m bench...` imports this package first): OpenMP workers spin
# ~0.3 ms after an op instead of libgomp's ~7 ms, as in the server (see gateway/__init__.py). Spinning
# for 7 ms made steps 5-10x slower under load on a shared 2-core machine; sleeping at once costs a
# wake-up per parallel op (a compiled batch-1 decode step: 25 ms instead of 17).
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")
