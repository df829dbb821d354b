"""prefixgate's inference engine: paged KV cache with automatic prefix caching.

The names below load on first use (PEP 562): a process that only talks to an engine (the API process)
imports `engine.config` or `engine.outputs` without pulling in torch through the model code.
"""
from __future__ import annotations

import importlib
import os

# OpenMP workers that spin for libgomp's long default steal the core another thread needs, and workers that
# sleep at once pay a wake-up per parallel op; a short spin (10,000 rounds) keeps them awake through a step and
# asleep between steps (measured: docs/speed.md#the-decode-step). It must be set before torch loads libgomp, so
# the engine package sets it on import (an explicit GOMP_SPINCOUNT or OMP_WAIT_POLICY wins: libgomp lets
# GOMP_SPINCOUNT override the policy).
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
