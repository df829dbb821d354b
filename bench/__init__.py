"""Benchmarks (not tests): prefix caching on vs off vs plain transformers, side by side in one run."""
# every `python -m bench...` imports this package first: gateway/__init__.py (stdlib only) sets the
# server's OpenMP spin default before torch loads, so the benchmarks run the threads as the server does
import gateway  # noqa: F401
