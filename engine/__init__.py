"""prefixgate's inference engine: paged KV cache with automatic prefix caching.

The names below load on first use (PEP 562): a process that only talks to an engine (the API process)
imports `engine.config` or `engine.outputs` without pulling in torch through the model code.
"""
from __future__ import annotations

import importlib
import os

# OpenMP workers that spin for libgomp's default ~7 ms after each op steal the core another thread needs
# (a 1,000-token prefill: 1.9-2.9 s spinning, 1.9 s sleeping), and workers that sleep at once pay a wake-up
# per parallel op (a batch-1 decode step: 25 ms instead of 17). A ~0.3 ms spin keeps them awake through a
# step and asleep between steps. It must be set before torch loads libgomp, so the engine package sets it
# on import (an explicit GOMP_SPINCOUNT or OMP_WAIT_POLICY wins: libgomp lets GOMP_SPINCOUNT override the policy).
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")

_EXPORTS = {
    "AsyncEngine": "engine.async_engine", "LLM": "engine.llm", "EngineConfig": "engine.config",
    "HashAlgo": "engine.config", "SchedulingPolicy": "engine.config", "CompletionOutput": "engine.outputs",
    "FinishReason": "engine.outputs", "RequestOutput": "engine.outputs", "SamplingParams": "engine.sampling_params",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
