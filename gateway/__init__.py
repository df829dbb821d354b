"""prefixgate's HTTP face: the OpenAI-compatible API over aiohttp on uvloop."""
import os

# OpenMP workers that spin between torch ops steal the core the event loop needs, and sleeping costs
# nothing measurable (a 1,000-token prefill: 1.9-2.9 s spinning, 1.9 s sleeping). Set before torch loads
# (`python -m gateway` imports this package first); an explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
