"""Benchmarks (not tests): prefix caching on vs off vs plain transformers, side by side in one run."""
