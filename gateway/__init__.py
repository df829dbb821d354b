"""prefixgate's HTTP face: the OpenAI-compatible API over aiohttp on uvloop."""
import os

# OpenMP workers that spin for libgomp's default ~7 ms after each op steal the core the event loop needs
# (a 1,000-token prefill: 1.9-2.9 s spinning, 1.9 s sleeping), and workers that sleep at once pay a wake-up
# per parallel op (a batch-1 decode step: 25 ms instead of 17). A ~0.3 ms spin keeps them awake through a
# step and asleep between steps. Set before torch loads (`python -m gateway` imports this package first);
# an explicit GOMP_SPINCOUNT or OMP_WAIT_POLICY wins (libgomp lets GOMP_SPINCOUNT override the policy).
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")
