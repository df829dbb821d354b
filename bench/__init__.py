"""Benchmarks (not tests): prefix caching on vs off vs plain transformers, side by side in one run."""
# every `python -m bench...` imports this package first: engine/__init__.py (no torch) sets the engine
# process's OpenMP spin default before torch loads, so an engine in a bench's process spins its threads as
# `serve`'s engine process does
import engine  # noqa: F401
